"""The constants a family's ComfyUI files layout writes into the diffusers folder it converts (what the weights do not
carry: the scheduler, the VAE's normalisation, the rotary axes) against the models' published configs, copied as data
into tests/data/published (its README names each file's source): the diffusers configs of the models' repositories
where a copy is stored, and the values in the models' authors' own code (``authors/``: black-forest-labs' flux and
flux2, Wan-Video's Wan2.1 and Wan2.2). The tiny models' reference folders are built from these same constants, so only
this holds them to the real models'."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import numpy as np
import pytest
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler

from parallel_runtime.families.flux import files as flux
from parallel_runtime.families.flux2 import files as flux2
from parallel_runtime.families.qwenimage import files as qwenimage
from parallel_runtime.families.wan import files as wan
from parallel_runtime.families.wan import tiny as wan_tiny

PUBLISHED = Path(__file__).parent / "data" / "published"
# What a saved config records about the saving, not about the model.
BOOKKEEPING = {"_diffusers_version", "_name_or_path"}


def published(model: str, name: str) -> dict:
    with open(PUBLISHED / model / f"{name}.json") as f:
        return {key: value for key, value in json.load(f).items() if key not in BOOKKEEPING}


def authors(repo: str) -> dict:
    """What ``authors/<owner>_<repo>.json`` copied from the models' authors' own code (its ``_source`` says where)."""
    with open(PUBLISHED / "authors" / f"{repo.replace('/', '_')}.json") as f:
        return json.load(f)


BFL_FLUX, BFL_FLUX2 = authors("black-forest-labs/flux"), authors("black-forest-labs/flux2")
WAN21, WAN22 = authors("Wan-Video/Wan2.1"), authors("Wan-Video/Wan2.2")


def test_flux1_schnell_scheduler_is_the_published_one():
    assert flux.SCHEDULER_SCHNELL == published("FLUX.1-schnell", "scheduler_config")


def test_flux1_dev_scheduler_differs_from_schnell_only_where_dev_shifts_with_the_resolution():
    schnell = published("FLUX.1-schnell", "scheduler_config")
    assert {k: v for k, v in flux.SCHEDULER_DEV.items() if schnell[k] != v} == {
        "shift": 3.0,
        "use_dynamic_shifting": True,
    }
    assert set(flux.SCHEDULER_DEV) == set(schnell)


def _ldm_vae_shapes(config: dict, quant_convs: bool = False) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of an ae.safetensors (black-forest-labs' layout) with ``config``'s sizes (diffusers' names):
    what a layout's ``vae_config`` reads of the file. The encoder keeps ``layers_per_block`` blocks a level, the
    decoder one more; FLUX.2's keeps its quant convs inside the encoder and decoder."""
    channels, blocks, latent = config["block_out_channels"], config["layers_per_block"], config["latent_channels"]
    shapes = {
        "encoder.conv_in.weight": (channels[0], config["in_channels"], 3, 3),
        "decoder.conv_in.weight": (channels[-1], latent, 3, 3),
        "decoder.conv_out.weight": (config["out_channels"], channels[0], 3, 3),
        "encoder.mid.attn_1.q.weight": (channels[-1], channels[-1], 1, 1),
    }
    for level, width in enumerate(channels):
        for block in range(blocks):
            shapes[f"encoder.down.{level}.block.{block}.conv1.weight"] = (width, width, 3, 3)
        for block in range(blocks + 1):
            shapes[f"decoder.up.{level}.block.{block}.conv1.weight"] = (width, width, 3, 3)
    if quant_convs:
        shapes["encoder.quant_conv.weight"] = (2 * latent, 2 * latent, 1, 1)
        shapes["decoder.post_quant_conv.weight"] = (latent, latent, 1, 1)
    return shapes


def test_flux1_vae_config_is_the_published_one():
    """Every value the pack writes into a converted FLUX.1 folder's vae/config.json, at the real VAE's sizes."""
    expected = published("FLUX.1-schnell", "vae_config")
    ours = flux.vae_config(_ldm_vae_shapes(expected))
    assert ours == {key: expected[key] for key in ours}
    assert (flux.VAE_SCALING_FACTOR, flux.VAE_SHIFT_FACTOR, flux.VAE_NORM_GROUPS) == (
        expected["scaling_factor"],
        expected["shift_factor"],
        expected["norm_num_groups"],
    )


def test_flux1_rotary_axes_are_the_published_ones():
    expected = published("FLUX.1-schnell", "transformer_config")
    assert list(flux.AXES_DIMS_ROPE) == expected["axes_dims_rope"]
    assert sum(flux.AXES_DIMS_ROPE) == expected["attention_head_dim"]


def test_flux2_transformer_constants_are_diffusers_conversion_ones():
    expected = published("FLUX.2-dev", "transformer_config")
    assert list(flux2.AXES_DIMS_ROPE) == expected["axes_dims_rope"]
    assert sum(flux2.AXES_DIMS_ROPE) == expected["attention_head_dim"]
    assert (flux2.ROPE_THETA, flux2.EPS) == (expected["rope_theta"], expected["eps"])


def test_flux2_scheduler_is_flux1_devs():
    """diffusers' conversion script gives FLUX.2-dev FLUX.1-dev's scheduler."""
    assert flux2.SCHEDULER == flux.SCHEDULER_DEV


@pytest.mark.parametrize(
    "name, ours",
    [
        ("batch_norm_eps", flux2.VAE_BATCH_NORM_EPS),
        ("batch_norm_momentum", flux2.VAE_BATCH_NORM_MOMENTUM),
        ("norm_num_groups", flux2.VAE_NORM_GROUPS),
    ],
)
def test_flux2_vae_constants_are_the_converted_vaes(name, ours):
    """diffusers' conversion script builds FLUX.2-dev's VAE as ``AutoencoderKLFlux2()``: its defaults are the
    published config's."""
    assert inspect.signature(AutoencoderKLFlux2.__init__).parameters[name].default == ours


# -- against the models' authors' own code ------------------------------------------------------------------------
def _diffusers_vae_sizes(ae: dict) -> dict:
    """``AutoEncoderParams``' sizes under diffusers' names."""
    return {
        "in_channels": ae["in_channels"],
        "out_channels": ae["out_ch"],
        "latent_channels": ae["z_channels"],
        "block_out_channels": [ae["ch"] * m for m in ae["ch_mult"]],
        "layers_per_block": ae["num_res_blocks"],
    }


@pytest.mark.parametrize("model", sorted(BFL_FLUX["models"]))
def test_flux1_constants_are_black_forest_labs_own(model):
    """FLUX.1 dev, schnell and Kontext [dev] (whose file FLUX.1's layout reads): the rotary axes summing to the head
    size, the VAE's normalisation and group norms, and the VAE config at ae.safetensors' real sizes."""
    params, ae = BFL_FLUX["models"][model]["params"], BFL_FLUX["models"][model]["ae_params"]
    assert list(flux.AXES_DIMS_ROPE) == params["axes_dim"]
    assert sum(flux.AXES_DIMS_ROPE) == params["hidden_size"] // params["num_heads"]
    ours = flux.vae_config(_ldm_vae_shapes(_diffusers_vae_sizes(ae)))
    assert {k: ours[k] for k in _diffusers_vae_sizes(ae)} == _diffusers_vae_sizes(ae)
    assert (ours["scaling_factor"], ours["shift_factor"]) == (ae["scale_factor"], ae["shift_factor"])
    assert ours["norm_num_groups"] == BFL_FLUX["vae_group_norm"]["num_groups"]


def _time_shift(mu: float, t: np.ndarray) -> np.ndarray:
    """The flow-matching time shift black-forest-labs' samplers apply (sigma 1): ``e^mu / (e^mu + (1/t - 1))``."""
    with np.errstate(divide="ignore"):
        return math.exp(mu) / (math.exp(mu) + (1 / t - 1))


def _pipeline_sigmas(config: dict, steps: int, mu: float) -> np.ndarray:
    """The ``steps`` sigmas diffusers' FLUX pipelines run with a scheduler of ``config``: ``retrieve_timesteps`` with
    ``linspace(1, 1/steps, steps)`` and the shift ``mu``."""
    from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    retrieve_timesteps(scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return scheduler.sigmas[:-1].double().numpy()


# (steps, image tokens): 1 MP is 4096 tokens, 2 MP (FLUX.2) 8192.
SCHEDULES = [(4, 256), (28, 1024), (50, 4096), (20, 8192)]


@pytest.mark.parametrize("model, config", [("flux-dev", flux.SCHEDULER_DEV), ("flux-schnell", flux.SCHEDULER_SCHNELL)])
@pytest.mark.parametrize("steps, tokens", SCHEDULES)
def test_flux1_schedules_are_black_forest_labs_own(model, config, steps, tokens):
    """FluxPipeline on the scheduler the pack writes runs the sigmas of black-forest-labs' ``get_schedule``: dev
    shifted by a ``mu`` linear in the image tokens between two published points, schnell not at all."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    schedule = BFL_FLUX["schedule"]
    t = np.linspace(1, 0, steps + 1)
    if schedule["shifted"][model]:
        slope = (schedule["max_shift"] - schedule["base_shift"]) / (schedule["max_seq_len"] - schedule["base_seq_len"])
        t = _time_shift(schedule["base_shift"] + slope * (tokens - schedule["base_seq_len"]), t)
    mu = calculate_shift(
        tokens, config["base_image_seq_len"], config["max_image_seq_len"], config["base_shift"], config["max_shift"]
    )
    np.testing.assert_allclose(_pipeline_sigmas(config, steps, mu), t[:-1], atol=1e-6)


def test_flux2_constants_are_black_forest_labs_own():
    params, ae = BFL_FLUX2["params"], BFL_FLUX2["ae_params"]
    assert list(flux2.AXES_DIMS_ROPE) == params["axes_dim"]
    assert sum(flux2.AXES_DIMS_ROPE) == params["hidden_size"] // params["num_heads"]
    assert (flux2.ROPE_THETA, flux2.EPS) == (params["theta"], BFL_FLUX2["layer_norm_eps"])
    assert list(flux2.HIDDEN_STATES_LAYERS) == BFL_FLUX2["text_encoder"]["output_layers"]
    ours = flux2.vae_config(_ldm_vae_shapes(_diffusers_vae_sizes(ae), quant_convs=True))
    assert {k: ours[k] for k in _diffusers_vae_sizes(ae)} == _diffusers_vae_sizes(ae)
    assert ours["decoder_block_out_channels"] is None  # the decoder's widths are the encoder's
    assert (ours["use_quant_conv"], ours["use_post_quant_conv"]) == (True, True)
    assert (ours["batch_norm_eps"], ours["batch_norm_momentum"]) == (ae["bn_eps"], ae["bn_momentum"])
    assert (ours["norm_num_groups"], ours["patch_size"]) == (ae["group_norm_groups"], ae["patch_size"])


@pytest.mark.parametrize("steps, tokens", [*SCHEDULES, (50, 4300), (8, 4301), (30, 16384)])
def test_flux2_schedule_is_black_forest_labs_own(steps, tokens):
    """Flux2Pipeline on the pack's FLUX.2 scheduler (the img2img schedule of ``families/flux2/adapter.py`` too) runs
    the sigmas of black-forest-labs' FLUX.2 ``get_schedule``: a ``mu`` interpolated in the step count between two
    lines in the image tokens (the 200-step line alone past a long sequence)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    fit = BFL_FLUX2["empirical_mu"]
    at_2 = fit["a2"] * tokens + fit["b2"]
    if tokens > fit["long_sequence"]:
        mu = at_2
    else:
        at_1 = fit["a1"] * tokens + fit["b1"]
        mu = at_1 + (at_2 - at_1) * (steps - fit["steps_1"]) / (fit["steps_2"] - fit["steps_1"])
    t = _time_shift(mu, np.linspace(1, 0, steps + 1))
    ours = _pipeline_sigmas(flux2.SCHEDULER, steps, compute_empirical_mu(image_seq_len=tokens, num_steps=steps))
    np.testing.assert_allclose(ours, t[:-1], atol=1e-6)


def _wan_transformer_shapes(config: dict, in_dim: int, z_dim: int, text_dim: int) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of a Wan text-to-video transformer file of ``config`` (Wan's own config) in Wan's layout."""
    dim, patch = config["dim"], config["patch_size"]
    shapes = {
        "patch_embedding.weight": (dim, in_dim, *patch),
        "head.head.weight": (z_dim * math.prod(patch), dim),
        "head.modulation": (1, 2, dim),
        "text_embedding.0.weight": (dim, text_dim),
        "time_embedding.0.weight": (dim, config["freq_dim"]),
        "blocks.0.ffn.0.weight": (config["ffn_dim"], dim),
    }
    for i in range(config["num_layers"]):
        shapes[f"blocks.{i}.modulation"] = (1, 6, dim)
    if config["cross_attn_norm"]:
        shapes["blocks.0.norm3.weight"] = (dim,)
    if config["qk_norm"]:
        shapes["blocks.0.self_attn.norm_q.weight"] = (dim,)
    return shapes


WAN_T2V = [(WAN21, "t2v-14B"), (WAN21, "t2v-1.3B"), (WAN22, "t2v-A14B")]


@pytest.mark.parametrize("published, name", WAN_T2V, ids=[name for _, name in WAN_T2V])
def test_wan_transformer_constants_are_wan_videos_own(published, name):
    """Wan's transformer config at each published text-to-video size: the heads (128 wide, the count not in the
    weights), the norms' epsilon, the rotary table's length and the latent channels, as Wan's own code has them."""
    config, vae = published["configs"][name], WAN21["vae"]
    shapes = _wan_transformer_shapes(config, WAN21["t2v_in_dim"], vae["z_dim"], text_dim=4096)
    ours = wan.transformer_config(shapes)
    assert ours["num_attention_heads"] == config["num_heads"]
    assert ours["num_attention_heads"] * ours["attention_head_dim"] == config["dim"]
    assert (ours["ffn_dim"], ours["freq_dim"], ours["num_layers"]) == (
        config["ffn_dim"],
        config["freq_dim"],
        config["num_layers"],
    )
    assert ours["patch_size"] == config["patch_size"] and ours["eps"] == config["eps"]
    assert ours["cross_attn_norm"] == config["cross_attn_norm"] and (ours["qk_norm"] is not None) == config["qk_norm"]
    assert ours["rope_max_seq_len"] == WAN21["rope_max_seq_len"]
    assert ours["in_channels"] == wan.T2V_CHANNELS == ours["out_channels"] == vae["z_dim"]
    assert wan.MAX_SEQUENCE_LENGTH == published["shared"]["text_len"]


def test_wan_sizes_are_named_by_the_authors_widths():
    sizes = [(WAN21, "t2v-14B"), (WAN21, "t2v-1.3B"), (WAN22, "ti2v-5B")]
    assert {authors["configs"][name]["dim"]: name.split("-")[1] for authors, name in sizes} == wan.SIZES


def test_wan22_ti2v_is_wan22s_own():
    """TI2V-5B's shift, its VAE's strides (16× spatially, 4× in time) and 32-pixel tokens, and its transformer's
    widths: the authors' config's."""
    from parallel_runtime.families import family

    config = WAN22["configs"]["ti2v-5B"]
    ti2v = family("wan_ti2v")
    assert wan.WAN22_TI2V_SHIFT == config["sample_shift"]
    assert (ti2v.latent.temporal_downscale, ti2v.latent.downscale, ti2v.latent.downscale) == tuple(config["vae_stride"])
    assert ti2v.pixels_per_token == config["vae_stride"][1] * config["patch_size"][1]
    assert config["dim"] == wan.HEAD_DIM * config["num_heads"]


def _wan_vae_shapes(vae: dict) -> dict[str, tuple[int, ...]]:
    """The tensor shapes ``vae_config`` reads of a Wan 2.1 VAE file of ``vae`` (Wan's ``_video_vae`` cfg)."""
    levels, blocks = len(vae["dim_mult"]), vae["num_res_blocks"]
    shapes = {
        "encoder.conv1.weight": (vae["dim"], 3, 3, 3, 3),
        "decoder.conv1.weight": (vae["dim"] * vae["dim_mult"][-1], vae["z_dim"], 3, 3, 3),
        "decoder.head.0.gamma": (vae["dim"], 1, 1, 1),
        "decoder.head.2.weight": (3, vae["dim"], 3, 3, 3),
    }
    # Each encoder level: its residual blocks, then a downsampling but the last; the decoder has one block more.
    for i in range(levels * blocks + levels - 1):
        shapes[f"encoder.downsamples.{i}.residual.0.gamma"] = (vae["dim"], 1, 1, 1)
    for i in range(levels * (blocks + 1) + levels - 1):
        shapes[f"decoder.upsamples.{i}.residual.0.gamma"] = (vae["dim"], 1, 1, 1)
    return shapes


def test_wan_vae_config_is_wan21s_own():
    """Wan 2.1's VAE (Wan 2.2 A14B's too, and the VAE Qwen-Image's layout reads: ``families/qwenimage/files.py``):
    its shape and per-channel latent statistics, which diffusers' config needs and the file does not carry."""
    vae = WAN21["vae"]
    assert all(WAN22["configs"][name]["vae_checkpoint"] == "Wan2.1_VAE.pth" for name in ("t2v-A14B", "i2v-A14B"))
    ours = wan.vae_config(_wan_vae_shapes(vae))
    published = {
        "base_dim": vae["dim"],
        "in_channels": 3,
        "out_channels": 3,
        **{k: vae[k] for k in ("z_dim", "dim_mult", "num_res_blocks", "attn_scales", "temperal_downsample")},
        **{"dropout": vae["dropout"], "latents_mean": vae["mean"], "latents_std": vae["std"]},
    }
    assert {k: ours[k] for k in published} == published
    assert (list(qwenimage.LATENTS_MEAN), list(qwenimage.LATENTS_STD)) == (vae["mean"], vae["std"])


def test_wan21_scheduler_is_the_one_wan_videos_readme_gives_diffusers():
    """UniPC on flow sigmas, shifted 3 (the README's 480P value; its 720P one is 5, and Wan2.1's own generate.py
    defaults every text-to-video size to 5): the converted folders' and the tiny Wan's."""
    readme = WAN21["diffusers_readme"]
    for config in (wan.scheduler(wan.WAN21_SHIFT), {"_class_name": "UniPCMultistepScheduler", **wan_tiny.SCHEDULER}):
        assert {k: config[k] for k in readme["scheduler"]} == readme["scheduler"]
        assert config["flow_shift"] == readme["flow_shift"]["480P"]
    assert wan.scheduler(wan.WAN21_SHIFT)["num_train_timesteps"] == WAN21["shared"]["num_train_timesteps"]


@pytest.mark.parametrize("name, i2v", [("t2v-A14B", False), ("i2v-A14B", True)])
def test_wan22_experts_boundary_and_shift_are_wan22s_own(name, i2v):
    config = WAN22["configs"][name]
    ours = (wan.WAN22_I2V_BOUNDARY, wan.WAN22_I2V_SHIFT) if i2v else (wan.WAN22_T2V_BOUNDARY, wan.WAN22_T2V_SHIFT)
    assert ours == (config["boundary"], config["sample_shift"])
    assert wan.model_index(i2v=i2v, experts=True)["boundary_ratio"] == config["boundary"]
    if not i2v:
        assert wan_tiny.BOUNDARY_RATIO == config["boundary"]
