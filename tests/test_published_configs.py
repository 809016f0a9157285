"""The constants a family's ComfyUI files layout writes into the diffusers folder it converts (what the weights do not
carry: the scheduler, the VAE's normalisation, the rotary axes) against the models' published configs, copied as data
into tests/data/published (its README names each file's source). The tiny models' reference folders are built from
these same constants, so only this holds them to the real models'."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from diffusers import AutoencoderKLFlux2

from parallel_runtime.families.flux import files as flux
from parallel_runtime.families.flux2 import files as flux2

PUBLISHED = Path(__file__).parent / "data" / "published"
# What a saved config records about the saving, not about the model.
BOOKKEEPING = {"_diffusers_version", "_name_or_path"}


def published(model: str, name: str) -> dict:
    with open(PUBLISHED / model / f"{name}.json") as f:
        return {key: value for key, value in json.load(f).items() if key not in BOOKKEEPING}


def test_flux1_schnell_scheduler_is_the_published_one():
    assert flux.SCHEDULER_SCHNELL == published("FLUX.1-schnell", "scheduler_config")


def test_flux1_dev_scheduler_differs_from_schnell_only_where_dev_shifts_with_the_resolution():
    schnell = published("FLUX.1-schnell", "scheduler_config")
    assert {k: v for k, v in flux.SCHEDULER_DEV.items() if schnell[k] != v} == {
        "shift": 3.0,
        "use_dynamic_shifting": True,
    }
    assert set(flux.SCHEDULER_DEV) == set(schnell)


def _flux1_vae_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of an ae.safetensors with ``config``'s sizes: what ``vae_config`` reads of the file."""
    channels, blocks = config["block_out_channels"], config["layers_per_block"]
    shapes = {
        "encoder.conv_in.weight": (channels[0], config["in_channels"], 3, 3),
        "decoder.conv_in.weight": (channels[-1], config["latent_channels"], 3, 3),
        "decoder.conv_out.weight": (config["out_channels"], channels[0], 3, 3),
        "encoder.mid.attn_1.q.weight": (channels[-1], channels[-1], 1, 1),
    }
    for level, width in enumerate(channels):
        for block in range(blocks):
            shapes[f"encoder.down.{level}.block.{block}.conv1.weight"] = (width, width, 3, 3)
    return shapes


def test_flux1_vae_config_is_the_published_one():
    """Every value the pack writes into a converted FLUX.1 folder's vae/config.json, at the real VAE's sizes."""
    expected = published("FLUX.1-schnell", "vae_config")
    ours = flux.vae_config(_flux1_vae_shapes(expected))
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
