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
from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

from parallel_runtime import InvalidInput, default_spec, get_backend, jobs
from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux
from parallel_runtime.families.qwenimage.tiny import make_tiny_model as make_tiny_qwenimage
from parallel_runtime.watchdog import Deadlines
from parallel_runtime.wire import CacheMode

FLUX, QWEN = "tiny-flux", "tiny-qwenimage"
PROMPT, NEGATIVE = "a photo of a horse in the city", "a blue painting"
STEPS, TOKENS = 8, 32
# The tiny random transformers' first-block residuals change by 0.35-0.55 (relative) from step to step; a real
# model's by a few percent. Each model's threshold makes its tiny one skip some steps and compute others, and lies
# between the two halves of the tokens' own measures at some pass, so that under context parallelism (Ulysses and
# Ring) only an agreed decision keeps the ranks together (test_the_threshold_parts_ranks_that_decide_alone holds it).
THRESHOLD = {FLUX: 0.385, QWEN: 0.39}
# How far the whole sequence's measure, which decides, stays from the threshold at every pass: the ranks' reduced
# float32 sums and one process's means differ by rounding (1e-6), never by this.
CLEAR = 5e-3


@pytest.fixture(scope="module")
def models_dir(models_root):
    make_tiny_flux(str(models_root / FLUX))
    make_tiny_qwenimage(str(models_root / QWEN))
    return models_root


@pytest.fixture(scope="module")
def pipes(models_dir):
    """diffusers' one-process pipeline of a model, loaded once."""
    loaded = {}

    def pipe(model: str):
        if model not in loaded:
            loaded[model] = (FluxPipeline if model == FLUX else QwenImagePipeline).from_pretrained(models_dir / model)
            loaded[model].set_progress_bar_config(disable=True)
        return loaded[model]

    return pipe


def _run(pipe, model: str) -> torch.Tensor:
    """The denoise every test here makes, in one process, as an IMAGE."""
    extra = (
        {"guidance_scale": 3.5, "max_sequence_length": TOKENS}
        if model == FLUX
        else {"negative_prompt": NEGATIVE, "true_cfg_scale": 4.0, "max_sequence_length": 8}
    )
    return pipe(
        prompt=PROMPT,
        num_inference_steps=STEPS,
        width=64,
        height=64,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="pt",
        **extra,
    ).images.permute(0, 2, 3, 1)


@pytest.fixture(scope="module")
def one_process(pipes):
    """diffusers' pipeline in one process with ``enable_cache(config)`` (None: no cache), as an IMAGE."""
    cache = {}

    def reference(model: str, config=None) -> torch.Tensor:
        key = (model, repr(config))
        if key not in cache:
            pipe = pipes(model)
            if config is not None:
                pipe.transformer.enable_cache(config)
            try:
                cache[key] = _run(pipe, model)
            finally:
                if config is not None:
                    pipe.transformer.disable_cache()
        return cache[key]

    return reference


def backend():
    return default_spec(ranks=2, device="cpu", memory_policy="resident")


@pytest.fixture(scope="module", autouse=True)
def parted_ranks_fail_fast():
    """Ranks that part (a cache decision not agreed) wait in collectives the other never joins: the watchdog ends
    such a run within minutes, where its default leaves a real model's first step half an hour."""
    shared = get_backend(backend())
    kept, shared.deadlines = shared.deadlines, Deadlines(load_s=120.0, stall_floor_s=60.0)
    yield
    shared.deadlines = kept


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
    image = generate(model, reports, cache=cache, cache_threshold=THRESHOLD[model], **strategy)
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
        expected = one_process(model, FirstBlockCacheConfig(threshold=THRESHOLD[model]))
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


def _measures(pipe, model: str, threshold: float) -> list[tuple[float, float, float]]:
    """One process's run with the first-block cache at ``threshold``, measured at every pass that compares with a
    previous one: the whole sequence's relative change (what decides) and each half's (what each of two
    context-parallel ranks holds: diffusers splits the tokens into equal consecutive chunks)."""
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    head = pipe.transformer.transformer_blocks[0]._diffusers_hook.get_hook(_FBC_LEADER_BLOCK_HOOK)
    decide, measured = head._should_compute_remaining_blocks, []

    def measure(residual: torch.Tensor) -> bool:
        previous = head.state_manager.get_state().head_block_residual
        if previous is not None:
            change, size = (residual - previous).abs().float(), previous.abs().float()
            halves = [(c.sum() / s.sum()).item() for c, s in zip(change.chunk(2, dim=1), size.chunk(2, dim=1))]
            measured.append(((change.sum() / size.sum()).item(), *halves))
        return decide(residual)

    head._should_compute_remaining_blocks = measure
    try:
        _run(pipe, model)
    finally:
        pipe.transformer.disable_cache()
    return measured


@pytest.mark.parametrize("model", [FLUX, QWEN])
def test_the_threshold_parts_ranks_that_decide_alone(pipes, model):
    """What lets the context-parallel cases above see ranks that do not agree: in the run they make (one process's
    here, cached at the same threshold), at some pass the two ranks' halves of the tokens measure on both sides of
    the threshold. Up to the first such pass, ranks deciding on their own measures decide as the whole does (its
    measure lies between the halves'), so they make the same run; there they part: one skips the remaining blocks
    while the other runs them, and their collectives no longer pair up. The whole's measure keeps clear of the
    threshold, so the agreed run's decisions do not hang on rounding."""
    threshold = THRESHOLD[model]
    measured = _measures(pipes(model), model, threshold)
    print(
        f"{model}: (whole, rank 0's half, rank 1's half) per pass {[tuple(round(m, 3) for m in p) for p in measured]}"
    )
    parted = [n for n, (_, first, second) in enumerate(measured) if (first > threshold) != (second > threshold)]
    assert parted, f"no pass where the halves lie on both sides of {threshold}: {measured}"
    assert all(abs(whole - threshold) > CLEAR for whole, _, _ in measured), measured


@pytest.mark.multirank
def test_cfg_parallel_halves_decide_for_their_own_pass(models_dir, one_process):
    """Under cfg_parallel each half keeps the state of its own pass, as one process keeps one per pass."""
    image = generate(QWEN, strategy="cfg_parallel", cache="first_block_cache", cache_threshold=THRESHOLD[QWEN])
    ranks = _decisions()
    print(f"cfg_parallel: passes per rank {[r.passes for r in ranks]}")
    assert [len(r.passes) for r in ranks] == [STEPS, STEPS] and not all(ranks[0].passes + ranks[1].passes)
    expected = one_process(QWEN, FirstBlockCacheConfig(threshold=THRESHOLD[QWEN]))
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
