"""CFG parallelism and step caching on one 2-rank CPU backend (test_cfg_parallel.py has the 4-rank meshes and the
strategy's refusals).

CFG parallelism equals the one-process true-CFG image. Step caching (LoadShardedTransformer's ``cache``): every rank
that shares a pass takes the same decision at every step (read back from each rank), the image equals diffusers' own
one-process cached pipeline, and caching off changes nothing. Bad cache widgets are refused before anything loads."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline, QwenImagePipeline
from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

from parallel_runtime import InvalidInput, default_spec, get_backend, jobs
from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux
from parallel_runtime.families.qwenimage.tiny import make_tiny_model as make_tiny_qwenimage
from parallel_runtime.wire import CacheMode

FLUX, QWEN = "tiny-flux", "tiny-qwenimage"
PROMPT, NEGATIVE = "a photo of a horse in the city", "a blue painting"
STEPS, TOKENS = 8, 32
# The tiny random transformers' first-block residuals change by 0.35-0.55 (relative) from step to step; a real
# model's by a few percent. 0.4 makes the tiny ones skip some steps and compute others, and under context parallelism
# the ranks' own slices land on both sides of it, so only an agreed decision keeps them together.
THRESHOLD = 0.4


@pytest.fixture(scope="module")
def models_dir(models_root):
    make_tiny_flux(str(models_root / FLUX))
    make_tiny_qwenimage(str(models_root / QWEN))
    return models_root


@pytest.fixture(scope="module")
def one_process(models_dir):
    """diffusers' pipeline in one process with ``enable_cache(config)`` (None: no cache), as an IMAGE."""
    pipes, cache = {}, {}

    def reference(model: str, config=None) -> torch.Tensor:
        key = (model, repr(config))
        if key not in cache:
            if model not in pipes:
                pipes[model] = (FluxPipeline if model == FLUX else QwenImagePipeline).from_pretrained(
                    models_dir / model
                )
                pipes[model].set_progress_bar_config(disable=True)
            pipe = pipes[model]
            if config is not None:
                pipe.transformer.enable_cache(config)
            extra = (
                {"guidance_scale": 3.5, "max_sequence_length": TOKENS}
                if model == FLUX
                else {"negative_prompt": NEGATIVE, "true_cfg_scale": 4.0, "max_sequence_length": 8}
            )
            cache[key] = pipe(
                prompt=PROMPT,
                num_inference_steps=STEPS,
                width=64,
                height=64,
                generator=torch.Generator("cpu").manual_seed(3),
                output_type="pt",
                **extra,
            ).images.permute(0, 2, 3, 1)
            if config is not None:
                pipe.transformer.disable_cache()
        return cache[key]

    return reference


def backend():
    return default_spec(ranks=2, device="cpu", memory_policy="resident")


def generate(model: str, reports: list | None = None, **args) -> torch.Tensor:
    spec = backend()
    if model == FLUX:
        positive = jobs.encode_prompt(spec, model=model, prompt=PROMPT, max_sequence_length=TOKENS)
        sample = {"guidance_scale": 3.5}
    else:
        positive = jobs.encode_prompt(spec, model=model, prompt=PROMPT, negative_prompt=NEGATIVE, max_sequence_length=8)
        sample = {"guidance_scale": 3.5, "true_cfg_scale": 4.0}
    transformer = jobs.plan_transformer(spec, model=model, **args)
    latent = jobs.sample(
        transformer,
        positive,
        seed=3,
        steps=STEPS,
        width=64,
        height=64,
        on_cache_report=None if reports is None else reports.append,
        **sample,
    )
    return jobs.decode(spec, model=model, samples=latent)


@pytest.mark.multirank
def test_cfg_parallel_on_two_ranks_equals_one_process(models_dir, one_process):
    """Rank 0 runs only the conditional pass, rank 1 only the unconditional one; each step's exchange gives both
    ranks both predictions, so the image is the one-process true-CFG image."""
    image = generate(QWEN, strategy="cfg_parallel")
    diff = (image - one_process(QWEN)).abs().max().item()
    print(f"cfg_parallel 2 ranks: max |diff| vs one process {diff:.3g}")
    assert diff <= 1e-4
    transformers = [
        next(m for m in r.resident if m.component == "transformer") for r in get_backend(backend()).status().ranks
    ]
    assert [m.parallelism for m in transformers] == [{"cfg_degree": 2}] * 2
    # One transformer pass per step on each rank, where one process runs two.
    assert [r.last_passes for r in get_backend(backend()).status().ranks] == [STEPS, STEPS]


def _decisions() -> list:
    """Each rank's own record of its last denoise: one entry per transformer pass, True where every block ran."""
    return [r.last_cache for r in get_backend(backend()).status().ranks]


def _id(case) -> str:
    return (case.values if hasattr(case, "values") else case)[0]


CASES = [
    # (id, model, strategy args, cache, diffusers' config in one process)
    ("ulysses_first_block", FLUX, {"strategy": "context_parallel"}, "first_block_cache", FirstBlockCacheConfig),
    # Ring's passes exchange keys and values step by step: a rank that skipped alone would hang the other.
    ("ring_first_block", FLUX, {"strategy": "context_parallel", "ring_degree": 2}, "first_block_cache", None),
    ("tp_first_block", FLUX, {"strategy": "tensor_parallel"}, "first_block_cache", FirstBlockCacheConfig),
    ("ulysses_taylorseer", FLUX, {"strategy": "context_parallel"}, "taylorseer", TaylorSeerCacheConfig),
    # Qwen-Image's _cp_plan splits at the first block's input, where the cache's hook sits; true CFG: two passes a step.
    (
        "qwenimage_ulysses_first_block",
        QWEN,
        {"strategy": "context_parallel"},
        "first_block_cache",
        FirstBlockCacheConfig,
    ),
]


@pytest.mark.multirank
@pytest.mark.parametrize("name, model, strategy, cache, config", CASES, ids=[_id(c) for c in CASES])
def test_every_rank_takes_the_same_decision_at_every_step(
    models_dir, one_process, name, model, strategy, cache, config
):
    reports = []
    image = generate(model, reports, cache=cache, cache_threshold=THRESHOLD, **strategy)
    ranks = _decisions()
    assert all(r is not None and r.mode is CacheMode(cache) for r in ranks)
    print(f"{name}: {ranks[0].describe()}; passes per rank {[r.passes for r in ranks]}")
    passes = STEPS * (2 if model == QWEN else 1)
    assert (
        len(ranks[0].passes) == passes
        and [r.last_passes for r in get_backend(backend()).status().ranks] == [passes] * 2
    )
    for step in range(passes):  # per pass, every rank's own decision
        assert len({r.passes[step] for r in ranks}) == 1, f"pass {step}: {[r.passes[step] for r in ranks]}"
    assert not all(ranks[0].passes) and any(ranks[0].passes[1:])  # it skipped, and it did not skip everything
    assert reports == [ranks[0]]  # what ParallelSampler's text shows
    uncached = one_process(model)
    if config is FirstBlockCacheConfig:
        expected = one_process(model, FirstBlockCacheConfig(threshold=THRESHOLD))
    elif config is TaylorSeerCacheConfig:
        expected = one_process(model, TaylorSeerCacheConfig(taylor_factors_dtype=torch.float32))
    else:
        expected = None
    moved = (image - uncached).abs().max().item()
    print(f"{name}: max |diff| vs uncached {moved:.3g}")
    # The cache did change the image (the test would see a decision gone wrong), by little.
    assert 1e-3 < moved <= 0.02
    if expected is not None:
        # The agreed decisions are the ones one process takes over the whole sequence, so the image is diffusers'.
        assert (image - expected).abs().max() <= 1e-4


@pytest.mark.multirank
def test_cfg_parallel_halves_decide_for_their_own_pass(models_dir, one_process):
    """Under cfg_parallel each half keeps the state of its own pass, as one process keeps one per pass."""
    image = generate(QWEN, strategy="cfg_parallel", cache="first_block_cache", cache_threshold=THRESHOLD)
    ranks = _decisions()
    print(f"cfg_parallel: passes per rank {[r.passes for r in ranks]}")
    assert [len(r.passes) for r in ranks] == [STEPS, STEPS] and not all(ranks[0].passes + ranks[1].passes)
    expected = one_process(QWEN, FirstBlockCacheConfig(threshold=THRESHOLD))
    assert (image - expected).abs().max() <= 1e-4


@pytest.mark.multirank
@pytest.mark.parametrize("model", [FLUX, QWEN])
def test_cache_off_changes_nothing(models_dir, one_process, model):
    """On the resident context-parallel transformer the cached runs above used: their hooks left nothing behind."""
    reports = []
    image = generate(model, reports, strategy="context_parallel")
    assert reports == [] and _decisions() == [None, None]
    assert (image - one_process(model)).abs().max() <= 1e-4


@pytest.mark.parametrize(
    "widget, args, hint",
    [
        ("cache", {"cache": "teacache"}, "unknown cache 'teacache'; choose one of off, first_block_cache, taylorseer"),
        ("cache_threshold", {"cache": "first_block_cache", "cache_threshold": 0.0}, "small positive number"),
        ("cache_threshold", {"cache": "first_block_cache", "cache_threshold": float("nan")}, "finite"),
    ],
)
def test_bad_cache_widgets_are_refused_by_name(models_dir, widget, args, hint):
    with pytest.raises(InvalidInput, match=hint) as info:
        jobs.plan_transformer(backend(), model=FLUX, strategy="context_parallel", **args)
    assert info.value.widget == widget


# -- VAE decode over the ranks ----------------------------------------------------------------------------------------
# Latents whose images need several of diffusers' tiles: the tiny FLUX.1 VAE tiles at its sample_size (64 px, a
# quarter overlapping), Qwen-Image's at 256 px (192 px apart).
TILED = [
    ("flux", FLUX, (1, 16, 16, 12), (3, 3)),  # 128×96: 3 × 2 tiles
    # 320×320: 2 × 2 tiles; a video VAE whose per-tile state counts the decoder's layers.
    ("qwenimage", QWEN, (1, 16, 1, 40, 40), (2, 2)),
]


@pytest.mark.multirank
@pytest.mark.parametrize("key, model, shape, tiles", TILED, ids=[_id(t) for t in TILED])
def test_decode_over_ranks_equals_diffusers_tiled_decode(models_dir, key, model, shape, tiles):
    from parallel_runtime.families import family

    samples = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    shown = []
    image = jobs.decode(backend(), model=model, samples=samples, decode_over_ranks=True, on_result=shown.append)
    adapter = family(key)
    vae = adapter.load_vae(str(models_dir / model), torch.float32, "cpu")
    plain = adapter.decode(vae, samples)
    vae.enable_tiling()
    tiled = adapter.decode(vae, samples)
    diff = (image - tiled).abs().max().item()
    print(f"{key}: tiles per rank {shown[0].tiles_per_rank}; max |diff| vs diffusers' tiled decode {diff:.3g}")
    assert [r.tiles_per_rank for r in shown] == [tiles]
    assert diff <= 1e-5
    assert (tiled - plain).abs().max() > 1e-3  # the tiles were blended: a plain decode would not pass


def test_decode_over_ranks_needs_device_auto(models_dir):
    with pytest.raises(InvalidInput, match="set device to auto") as info:
        jobs.validate_decode(model=FLUX, device="cpu", decode_over_ranks=True)
    assert info.value.widget == "device"
