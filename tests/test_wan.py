"""The Wan family (text-to-video, Wan 2.1 and Wan 2.2 A14B's two experts): the adapter's staged path against
diffusers' one-shot ``WanPipeline`` in one process, its LATENT against ComfyUI's Wan 2.1 convention, the sampler's
video widgets refused by name before anything loads, the strategies on real CPU ranks against the one-shot
pipeline (fp32, ≤ 1e-4), and the decode over the ranks against diffusers' tiled decode (≤ 1e-5). Tiny models: 4
heads, 5 frames (2 latent frames) of 48×32."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import WAN_CLIP, wan_clip_latent, wan_one_shot

from parallel_runtime import InvalidInput, default_spec, get_backend, jobs
from parallel_runtime.families import Placement
from parallel_runtime.families import family as family_adapter
from parallel_runtime.families.wan.tiny import make_tiny_model
from parallel_runtime.samplers import Sampler
from parallel_runtime.wire import DecodeResult, Prompts, Sampling

wan = family_adapter("wan")
PROMPT, NEGATIVE, CFG = WAN_CLIP["prompt"], WAN_CLIP["negative_prompt"], WAN_CLIP["guidance_scale"]
WIDTH, HEIGHT, FRAMES = WAN_CLIP["width"], WAN_CLIP["height"], WAN_CLIP["num_frames"]
STEPS, TOKENS = WAN_CLIP["num_inference_steps"], WAN_CLIP["max_sequence_length"]
CFG_2 = 3.0
CPU = Placement("cpu")
MODELS = {"wan21": "tiny-wan21", "wan22": "tiny-wan22"}  # Wan 2.2 A14B: two experts


@pytest.fixture(scope="module")
def wan_dir(models_root):
    """The module's model folder with a tiny Wan 2.1 and a tiny Wan 2.2 A14B."""
    make_tiny_model(str(models_root / MODELS["wan21"]), 0)
    make_tiny_model(str(models_root / MODELS["wan22"]), 0, two_experts=True)
    return models_root


def one_shot(
    folder,
    seed: int = 3,
    batch_size: int = 1,
    guidance_scale_2: float | None = None,
    output_type: str = "pt",
    **overrides,
) -> torch.Tensor:
    """WanPipeline's clips as an IMAGE [B·frames, H, W, 3] (with ``output_type="latent"``: its latents); ``overrides``
    of ``WAN_CLIP``'s pipeline arguments (``width``, ``num_frames``, ...)."""
    second = {"guidance_scale_2": guidance_scale_2} if guidance_scale_2 is not None else {}
    frames = wan_one_shot(folder, seed, batch_size, output_type, **second, **overrides)
    return frames if output_type == "latent" else frames.permute(0, 1, 3, 4, 2).flatten(0, 1)


# -- the adapter in one process ---------------------------------------------------------------------------------
def staged(folder, seed: int = 3, experts: dict | None = None, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """(LATENT, IMAGE) through the adapter's stages: encode, denoise, decode."""
    text = wan.load_text_encoders(str(folder), torch.float32, CPU)
    embeds = wan.encode(text, Prompts((PROMPT,), negative_prompts=(NEGATIVE,), max_sequence_length=TOKENS))
    subfolders = wan.transformer_subfolders(str(folder))
    loaded = [wan.load_transformer(str(folder), torch.float32, CPU, subfolder) for subfolder in subfolders]
    sampling = Sampling(
        **{
            "seed": seed,
            "steps": STEPS,
            "guidance_scale": 1.0,
            "width": WIDTH,
            "height": HEIGHT,
            "true_cfg_scale": CFG,
            "sampler": Sampler.UNI_PC,
            "frames": FRAMES,
            **overrides,
        }
    )
    experts = experts if experts is not None else dict(zip(subfolders[1:], loaded[1:]))
    latent = wan.denoise(str(folder), loaded[0], embeds, sampling, **experts)
    return latent, wan.decode(wan.load_vae(str(folder), torch.float32, "cpu"), latent)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_staged_equals_one_shot(wan_dir, name):
    """The staged clip is WanPipeline's, frame for frame; its LATENT is ComfyUI's Wan 2.1 one: [B, 16, T, h, w]."""
    folder = wan_dir / MODELS[name]
    latent, frames = staged(folder, guidance_scale_2=CFG_2 if name == "wan22" else None)
    assert latent.shape == (1, 16, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8) and latent.dtype == torch.float32
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3)
    diff = (frames - one_shot(folder, guidance_scale_2=CFG_2 if name == "wan22" else None)).abs().max().item()
    print(f"{name}: staged vs one-shot max |diff| {diff:.3g}")
    assert diff <= 1e-5


def test_two_experts_switch_at_the_boundary(wan_dir):
    """Wan 2.2's second expert runs the low-noise steps with its own guidance: with the first expert in its place,
    or guidance_scale_2 changed, the clip changes."""
    folder = wan_dir / MODELS["wan22"]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["transformer_2"][1] == "WanTransformer3DModel"
    latent = staged(folder)[0]
    first = wan.load_transformer(str(folder), torch.float32, CPU)
    assert (latent - staged(folder, experts={"transformer_2": first})[0]).abs().max() > 1e-3
    assert (latent - staged(folder, guidance_scale_2=CFG_2)[0]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="transformer_2"):
        staged(folder, experts={})


def test_latent_decodes_as_comfyui_decodes_it(wan_dir):
    """ComfyUI's VAEDecode for Wan 2.1's VAE: the LATENT as it is (``Wan21.process_out`` ran in the sampler), clamp
    ((x + 1) / 2), frames folded into the batch clip by clip; and the LATENT is the pipeline's latents
    un-normalised by the VAE's per-channel mean and std."""
    folder = wan_dir / MODELS["wan21"]
    latent, frames = staged(folder)
    vae = wan.load_vae(str(folder), torch.float32, "cpu")
    with torch.no_grad():
        raw = vae.decode(latent).sample
    comfy = torch.clamp((raw + 1.0) / 2.0, 0.0, 1.0).movedim(1, -1)
    assert (frames - comfy.reshape(-1, HEIGHT, WIDTH, 3)).abs().max().item() <= 1e-6
    # ComfyUI's latent_formats.Wan21.process_in, which its Wan model applies to the LATENT: the pipeline's latents.
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    pipeline_latents = one_shot(folder, output_type="latent")
    assert ((latent - mean) / std - pipeline_latents).abs().max().item() <= 1e-5
    assert (latent - pipeline_latents).abs().max().item() > 0.1  # the normalisation is not the identity


# -- the widgets, before anything loads ------------------------------------------------------------------------
def backend(ranks: int = 2):
    return default_spec(ranks=ranks, device="cpu", memory_policy="staged")


def _validate(name: str, strategy: str = "device_map", **widgets) -> None:
    transformer = jobs.plan_transformer(backend(), model=MODELS[name], strategy=strategy)
    args = {"steps": STEPS, "width": WIDTH, "height": HEIGHT, "batch_size": 1, "true_cfg_scale": CFG}
    jobs.validate_sample(transformer, None, **{**args, "sampler": "uni_pc", "length": FRAMES, **widgets})


@pytest.mark.parametrize(
    "widget, call, hint",
    [
        ("length", lambda: _validate("wan21", length=6), "use 5 or 9"),
        ("length", lambda: _validate("wan21", length=0), "4k \\+ 1"),
        ("width", lambda: _validate("wan21", width=40), "multiple of 16"),
        ("height", lambda: _validate("wan21", height=24), "multiple of 16"),
        ("guidance_scale_2", lambda: _validate("wan21", guidance_scale_2=3.0), "second expert"),
        ("guidance_scale_2", lambda: _validate("wan22", guidance_scale_2=3.0, true_cfg_scale=1.0), "true_cfg_scale"),
        ("scheduler", lambda: _validate("wan21", scheduler="karras"), "choose simple"),
        (
            "width",
            lambda: _validate("wan21", "context_parallel", width=48, height=48, length=1),
            "do not split over 2",
        ),
    ],
)
def test_video_widgets_fail_before_anything_runs(wan_dir, widget, call, hint):
    with pytest.raises(InvalidInput, match=hint) as info:
        call()
    assert info.value.widget == widget


def test_a_wan22_folder_without_its_second_expert_is_refused(wan_dir, tmp_path):
    """model_index.json names transformer_2, its folder is gone: LoadShardedTransformer refuses the model."""
    import shutil

    broken = wan_dir / "tiny-wan22-no-expert"
    shutil.copytree(wan_dir / MODELS["wan22"], broken)
    shutil.rmtree(broken / "transformer_2")
    with pytest.raises(InvalidInput, match="transformer_2/ holds no model") as info:
        jobs.plan_transformer(backend(), model=broken.name)
    assert info.value.widget == "model"


# -- the strategies on real ranks -----------------------------------------------------------------------------
def generate(name: str, strategy: str, *, batch_size: int = 1, ranks: int = 2, **strategy_args) -> torch.Tensor:
    """The clips' frames of ``name`` under ``strategy`` through the nodes' steps."""
    spec = backend(ranks)
    model = MODELS[name]
    second = CFG_2 if name == "wan22" else 0.0
    latent = wan_clip_latent(spec, model, strategy, strategy_args, batch_size=batch_size, guidance_scale_2=second)
    assert latent.shape == (batch_size, 16, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)
    # The degrees the status panel reads back from the resident transformer (both experts' together).
    applied = {"tensor_parallel": {"tp_degree": ranks}, "cfg_parallel": {"cfg_degree": 2}}.get(strategy, {})
    held = [m.parallelism for r in get_backend(spec).status().ranks for m in r.resident if m.component == "transformer"]
    assert held and all(applied.items() <= degrees.items() for degrees in held), held
    return jobs.decode(spec, model=model, samples=latent)


def check(
    wan_dir, name: str, strategy: str, *, batch_size: int = 1, ranks: int = 2, tolerance: float = 1e-4, **args
) -> None:
    frames = generate(name, strategy, batch_size=batch_size, ranks=ranks, **args)
    second = CFG_2 if name == "wan22" else None
    reference = one_shot(wan_dir / MODELS[name], batch_size=batch_size, guidance_scale_2=second)
    assert frames.shape == reference.shape == (batch_size * FRAMES, HEIGHT, WIDTH, 3)
    diff = (frames - reference).abs().max().item()
    print(f"{name} {strategy} {args} on {ranks} ranks: max |diff| vs one-shot {diff:.3g}")
    assert diff <= tolerance


CASES = [
    # (id, family, strategy, widgets, batch_size)
    ("ulysses", "wan21", "context_parallel", {"ulysses_degree": 2}, 1),
    ("cfg_parallel_two_experts", "wan22", "cfg_parallel", {}, 1),
    ("data_parallel", "wan21", "data_parallel", {}, 2),
    ("device_map_two_experts", "wan22", "device_map", {}, 1),
    # The pack's own plan (families/wan/tp_plan.py): q/k's RMSNorm over all heads reduced across the ranks; each
    # expert sliced from its own subfolder.
    ("tensor_parallel_two_experts", "wan22", "tensor_parallel", {}, 1),
]


@pytest.mark.multirank
@pytest.mark.parametrize("name, strategy, args, batch_size", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_strategy_matches_one_shot(wan_dir, name, strategy, args, batch_size):
    # Data parallel is not bit-exact: CPU GEMM kernels block differently for another batch size.
    check(wan_dir, name, strategy, batch_size=batch_size, tolerance=1e-5 if batch_size > 1 else 1e-4, **args)


SLOW_CASES = [
    ("ring", "wan21", "context_parallel", {"ring_degree": 2, "ulysses_degree": 1}, 2),
    ("ulysses_two_experts", "wan22", "context_parallel", {"ulysses_degree": 2}, 2),
    ("cfg_x_ulysses", "wan21", "cfg_parallel", {"ulysses_degree": 2}, 4),
    ("unified", "wan21", "context_parallel", {"ring_degree": 2, "ulysses_degree": 2}, 4),
    ("tensor_parallel", "wan21", "tensor_parallel", {}, 2),
    ("tp_cp", "wan21", "tp_cp", {"tp_degree": 2, "ulysses_degree": 2}, 4),
    ("tp_cp_two_experts", "wan22", "tp_cp", {"tp_degree": 2, "ulysses_degree": 2}, 4),
]


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("name, strategy, args, ranks", [c[1:] for c in SLOW_CASES], ids=[c[0] for c in SLOW_CASES])
def test_more_strategies_match_one_shot(wan_dir, name, strategy, args, ranks):
    check(wan_dir, name, strategy, ranks=ranks, **args)


ODD = {"width": 48, "height": 48, "length": 9}  # 3 latent frames of 3 × 3 patches: 27 tokens, odd


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [{"ulysses_degree": 2, "anything": True}, {"ring_degree": 2, "ulysses_degree": 1, "anything": True}],
    ids=["ulysses_anything", "ring_anything"],
)
def test_anything_splits_a_clip_whose_tokens_do_not_divide(wan_dir, args):
    """A clip whose video tokens do not divide over the ranks: refused by name without ``anything``, and with it split
    unevenly (diffusers' ulysses_anything / ring_anything), equal to WanPipeline's clip."""
    spec, model = backend(2), MODELS["wan21"]
    with pytest.raises(InvalidInput, match="anything"):
        wan_clip_latent(spec, model, "context_parallel", {**args, "anything": False}, **ODD)
    latent = wan_clip_latent(spec, model, "context_parallel", args, **ODD)
    frames = jobs.decode(spec, model=model, samples=latent)
    sizes = {"width": ODD["width"], "height": ODD["height"], "num_frames": ODD["length"]}
    reference = one_shot(wan_dir / model, **sizes)
    assert frames.shape == reference.shape == (ODD["length"], ODD["height"], ODD["width"], 3)
    diff = (frames - reference).abs().max().item()
    print(f"wan21 context_parallel {args} on 27 tokens: max |diff| vs one-shot {diff:.3g}")
    assert diff <= 1e-4


# -- the decode over the ranks --------------------------------------------------------------------------------------
def decode_over_ranks(folder, samples: torch.Tensor, ranks: int, tiles: tuple[int, ...]) -> None:
    """VAEDecodeSingleGPU's ``decode_over_ranks`` of a clip equals diffusers' own tiled decode in one process
    (``enable_tiling()``: 256-px tiles 192 px apart, each decoded latent frame by latent frame through its causal
    cache, blended): the same arithmetic, so within float32 rounding. The tiles per rank show it tiled."""
    shown = []
    frames = jobs.decode(
        backend(ranks), model=folder.name, samples=samples, decode_over_ranks=True, on_result=shown.append
    )
    vae = wan.load_vae(str(folder), torch.float32, "cpu")
    vae.enable_tiling()
    tiled = wan.decode(vae, samples)
    diff = (frames - tiled).abs().max().item()
    print(f"{folder.name} on {ranks} ranks: tiles per rank {shown[0].tiles_per_rank}; max |diff| {diff:.3g}")
    assert frames.shape == tiled.shape == (samples.shape[2] * 4 - 3, *tiled.shape[1:])
    assert [r.tiles_per_rank for r in shown] == [tiles]
    assert len(shown[0].peak_bytes_per_rank) == ranks
    assert diff <= 1e-5


@pytest.mark.multirank
def test_a_clip_decodes_over_the_ranks_as_diffusers_tiles_it(wan_dir):
    """5 frames (2 latent frames) at 320×320: 2 × 2 tiles, 2 per rank."""
    samples = torch.randn(1, 16, 2, 40, 40, generator=torch.Generator().manual_seed(0))
    decode_over_ranks(wan_dir / MODELS["wan21"], samples, 2, (2, 2))
    # A clip within one tile (48×32): diffusers decodes it whole, so the first rank does, and the text says why.
    small, shown = torch.randn(1, 16, 2, 4, 6, generator=torch.Generator().manual_seed(1)), []
    frames = jobs.decode(
        backend(), model=MODELS["wan21"], samples=small, decode_over_ranks=True, on_result=shown.append
    )
    assert shown[0].tiles_per_rank == (1, 0) and "some ranks had none" in jobs.over_ranks_text(shown[0])
    plain = wan.decode(wan.load_vae(str(wan_dir / MODELS["wan21"]), torch.float32, "cpu"), small)
    assert (frames - plain).abs().max().item() <= 1e-5


def test_the_decode_text_gives_tiles_and_memory_per_rank():
    result = DecodeResult((5, 320, 320, 3), tiles_per_rank=(2, 2), peak_bytes_per_rank=(3 << 29, 1 << 29))
    assert jobs.over_ranks_text(result) == (
        "decoded 4 tiles over the ranks (2, 2 per rank); peak memory per rank above the VAE's weights: 1.50, 0.50 GiB"
    )


@pytest.mark.multirank
@pytest.mark.slow
def test_a_longer_clip_decodes_over_four_ranks(wan_dir):
    """9 frames (3 latent frames) at 400×400: 3 × 3 tiles over 4 ranks, one more on the first."""
    samples = torch.randn(1, 16, 3, 50, 50, generator=torch.Generator().manual_seed(1))
    decode_over_ranks(wan_dir / MODELS["wan21"], samples, 4, (3, 2, 2, 2))


@pytest.mark.multirank
@pytest.mark.slow
def test_a_wan22_vae_clip_decodes_over_the_ranks(wan_dir):
    """Wan 2.2 TI2V-5B's VAE layout (48 latent channels, 16× spatially: 8× in the decoder, then 2 × 2 patches
    unpatchified after the blend), tiny: its tiles are blended in the patches' grid, which the ranks' decoded shapes
    must follow. 5 frames at 320×320: 2 × 2 tiles."""
    folder = wan_dir / "tiny-wan22-ti2v"
    if not folder.exists():
        make_tiny_model(str(folder), 2, ti2v=True)
    samples = torch.randn(1, 48, 2, 20, 20, generator=torch.Generator().manual_seed(2))
    decode_over_ranks(folder, samples, 2, (2, 2))


# A random Wan 2.1-layout VAE decoding 9 frames at 256², measured in a process of its own: in the test process the
# heap's history (pages glibc keeps from earlier tests, other threads' arenas) moved the peak by a third.
_DECODE_PEAK = """
import torch
from diffusers import AutoencoderKLWan
from parallel_runtime.worker import vae_tiles
torch.manual_seed(0)
vae = AutoencoderKLWan(base_dim=32, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                       temperal_downsample=[False, True, True]).eval()
samples = torch.randn(1, 16, 3, 32, 32)
cpu = torch.device("cpu")
with torch.no_grad():
    vae.decode(samples[:, :, :1])  # the first call's one-off allocations are not the decode's
    held = vae_tiles.reset_peak(cpu)
    vae.decode(samples)
    print(vae_tiles.peak_above(cpu, held))
"""


def test_the_decode_estimate_holds_a_clips_decode():
    """A clip's decode holds about ``Wan.decode_copies`` first-level feature maps (one frame's), far more than an image
    VAE's 8: the memory check's estimate (``memory.decode_need``) against the peak a random Wan 2.1-layout VAE's
    decode takes on this CPU (its resident set over the weights, ``vae_tiles``' measure), 9 frames at 256²."""
    import subprocess
    import sys

    from parallel_runtime.worker import memory

    wan = family_adapter("wan")
    config = {"base_dim": 32, "z_dim": 16}
    need = memory.decode_need(wan, config, *memory.samples_size(wan, torch.zeros(1, 16, 3, 32, 32)), torch.float32)
    as_an_image = memory.decode_need(family_adapter("flux"), {"block_out_channels": [32]}, 1, 256, 256, torch.float32)
    assert need * 8 == 76 * as_an_image  # 76 maps, not 8
    run = subprocess.run([sys.executable, "-c", _DECODE_PEAK], capture_output=True, text=True, timeout=300, check=True)
    peak = int(run.stdout.split()[-1])
    print(f"Wan decode, 9 frames at 256²: peak {peak / 2**20:.0f} MiB, estimate {need / 2**20:.0f} MiB")
    assert 0.6 * need < peak < 1.2 * need


def test_a_clip_too_large_to_decode_is_refused_naming_decode_over_ranks(monkeypatch):
    """A 480p clip of 81 frames on a device with 4 GiB free (Wan 2.1's VAE in bf16 takes about 5.4 GiB): refused by
    the decode's check with the frames it counted and the node's own fix first."""
    from parallel_runtime.wire import Memory
    from parallel_runtime.worker import memory
    from parallel_runtime.worker.ops import WidgetError

    free = 4 * 2**30
    monkeypatch.setattr(memory, "memory_of", lambda device: Memory(kind="cuda", total_bytes=free, free_bytes=free))
    samples = torch.zeros(1, 16, 21, 60, 104)
    with pytest.raises(WidgetError) as info:
        memory.check_decode(family_adapter("wan"), {"base_dim": 96}, samples, torch.bfloat16, torch.device("cuda", 0))
    assert info.value.widget == "samples"
    assert "1 image(s) of 832×480 × 81 frames needs about 5.4 GiB" in str(info.value)
    assert "turn on decode_over_ranks" in str(info.value)
