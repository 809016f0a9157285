"""Wan 2.2 A14B's two experts held one at a time when they do not fit together (``worker/memory.py``'s
``one_expert_at_a_time``, the denoise's ``LaterExpert`` swap at the boundary): on a 2-rank CPU backend under the
``staged`` policy with a memory cap (``COMFY_PARALLEL_MEMORY_CAP_GB``) under which one expert fits beside the step but
not both, device_map loads the high-noise expert, runs the steps before the boundary, frees it, loads the low-noise
one and runs the rest, the scheduler's state carried across: the clip equals ``WanPipeline``'s one-shot (fp32,
≤ 1e-4), each expert loads once per run, the node says it swapped; slow: a LoRA on the low-noise expert applies to
it when it loads (device_map, Ulysses, tensor parallelism), its blocks compile then, and its step cache starts from
a state of its own. Without a backend: the
decision (ample memory changes nothing, ``resident`` is refused with the fix), and an emptied expert's memory going
while the pipeline's loop still holds the object."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import WAN_CLIP, wan_clip_prompt, wan_clip_sample, wan_one_shot

from parallel_runtime import default_spec, get_backend, jobs, shutdown_backend
from parallel_runtime.families import family
from parallel_runtime.families.tiny import make_tiny_lora, save_diffusers_lora
from parallel_runtime.families.wan.tiny import make_tiny_model
from parallel_runtime.strategy import StrategyPlan
from parallel_runtime.wire import COMPILE_BACKEND_ENV, Sampling
from parallel_runtime.worker import memory
from parallel_runtime.worker.ops import WidgetError

MODEL = "tiny-wan22-experts"
CFG_2 = 3.0
EXPERTS = ("transformer", "transformer_2")
LOW_NOISE_LORA = "low_noise.safetensors"
wan = family("wan")


@pytest.fixture(scope="module")
def folder(models_root):
    make_tiny_model(str(models_root / MODEL), 0, two_experts=True)
    return models_root / MODEL


def _sampling() -> Sampling:
    return Sampling(
        seed=3,
        steps=WAN_CLIP["num_inference_steps"],
        guidance_scale=1.0,
        width=WAN_CLIP["width"],
        height=WAN_CLIP["height"],
        true_cfg_scale=WAN_CLIP["guidance_scale"],
        frames=WAN_CLIP["num_frames"],
        guidance_scale_2=CFG_2,
    )


def _device_map() -> StrategyPlan:
    return jobs.plan_transformer(default_spec(ranks=2, device="cpu"), model=MODEL, strategy="device_map").plan


def _vae_bytes(folder) -> int:
    return memory.parameters_in(str(folder / "vae")) * 4


def _cap(folder, plan: StrategyPlan) -> str:
    """Room for one expert, the step and the VAE (which ``staged`` keeps), not for both experts."""
    sampling, tokens = _sampling(), WAN_CLIP["max_sequence_length"]
    return memory.cap_for_one_expert(wan, str(folder), plan, sampling, tokens, torch.float32, _vae_bytes(folder))


def _empty_latent() -> torch.Tensor:
    """A clip's LATENT to decode first: the VAE then stays resident (``staged``), as after any earlier run."""
    return torch.zeros(1, 16, 2, WAN_CLIP["height"] // 8, WAN_CLIP["width"] // 8)


@pytest.fixture(scope="module")
def lora(folder, loras_dir) -> str:
    """A LoRA for the low-noise expert, in diffusers' layout."""
    made = make_tiny_lora(folder, "wan", ranks={"proj_out": 2}, seed=7)
    save_diffusers_lora(made, loras_dir / LOW_NOISE_LORA, "wan")
    return LOW_NOISE_LORA


@pytest.fixture(scope="module")
def spec(folder):
    """A 2-rank staged backend started under the cap, with the VAE already resident (as after any earlier run)."""
    shutdown_backend()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(memory.CAP_ENV, _cap(folder, _device_map()))
        env.setenv(COMPILE_BACKEND_ENV, "aot_eager")  # inductor's code generation takes minutes on CPU ranks
        spec = default_spec(ranks=2, device="cpu", memory_policy="staged")
        jobs.decode(spec, model=MODEL, samples=_empty_latent())
        yield spec
        shutdown_backend()


def wan_layers(folder) -> int:
    return json.loads((folder / "transformer" / "config.json").read_text())["num_layers"]


def _run(
    spec, strategy: str = "device_map", loras=(), steps: int = WAN_CLIP["num_inference_steps"], **widgets
) -> tuple[torch.Tensor, list[str], list[str]]:
    """The clip's frames, the sampler node's notes and its progress texts."""
    positive = wan_clip_prompt(spec, MODEL)
    handle = jobs.plan_transformer(spec, model=MODEL, strategy=strategy, **widgets)
    for name, expert in loras:
        handle, _ = jobs.add_lora(handle, lora_name=name, expert=expert)
    notes, texts = [], []
    latent = wan_clip_sample(
        handle,
        positive,
        CFG_2,
        steps=steps,
        on_result=lambda result: notes.extend(result.notes()),
        on_progress=lambda step, total, text: texts.append(text) if text else None,
    )
    return jobs.decode(spec, model=MODEL, samples=latent), notes, texts


def _one_shot(folder, lora_path=None, cache=None, steps: int = WAN_CLIP["num_inference_steps"]) -> torch.Tensor:
    """WanPipeline in one call (both experts resident), with ``lora_path`` in the low-noise expert, ``cache`` (a
    diffusers cache config) on each expert."""
    from diffusers import WanPipeline

    if lora_path is None and cache is None and steps == WAN_CLIP["num_inference_steps"]:
        frames = wan_one_shot(folder, guidance_scale_2=CFG_2)
    else:
        pipe = WanPipeline.from_pretrained(folder, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        if lora_path is not None:
            pipe.load_lora_weights(str(lora_path), adapter_name="low", load_into_transformer_2=True)
        for expert in (pipe.transformer, pipe.transformer_2) if cache is not None else ():
            expert.enable_cache(cache)
        generator = torch.Generator("cpu").manual_seed(3)
        settings = {**WAN_CLIP, "num_inference_steps": steps, "guidance_scale_2": CFG_2}
        frames = pipe(**settings, generator=generator, output_type="pt").frames
    return frames.permute(0, 1, 3, 4, 2).flatten(0, 1)


def _load_counts(spec) -> list[dict[str, int]]:
    return [rank.load_counts for rank in get_backend(spec).status().ranks]


@pytest.mark.multirank
def test_short_of_memory_device_map_holds_one_expert_at_a_time_and_equals_the_pipeline(spec, folder, lora, loras_dir):
    frames, notes, texts = _run(spec)
    diff = (frames - _one_shot(folder)).abs().max().item()
    print(f"one expert at a time under device_map: max |diff| vs WanPipeline {diff:.3g}")
    assert diff <= 1e-4
    assert any("held one at a time" in note and "transformer → transformer_2" in note for note in notes), notes
    assert any(text.startswith("loading transformer_2 (one expert at a time)") for text in texts), texts
    counts = [f"{expert}:{MODEL}" for expert in EXPERTS]
    assert [_load_counts(spec)[0].get(name) for name in counts] == [1, 1]
    # What stays is the low-noise expert alone: one expert's weights, not two.
    resident = get_backend(spec).status().ranks[0].resident
    (transformer,) = [m for m in resident if m.component.startswith("transformer")]
    assert transformer.component == "transformer_2"
    assert transformer.parameter_bytes == memory.parameters_in(str(folder / "transformer_2")) * 4


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("strategy, args", [("device_map", {}), ("context_parallel", {"ulysses_degree": 2})])
def test_a_low_noise_lora_applies_to_the_expert_loaded_at_the_boundary(spec, folder, lora, loras_dir, strategy, args):
    """Under device_map (rank 0 alone) and Ulysses (every rank swaps at the same step, the load collective), each
    expert loading once per run."""
    before = _load_counts(spec)
    frames, notes, _ = _run(spec, strategy, loras=((lora, "low_noise"),), **args)
    expected, without = _one_shot(folder, loras_dir / lora), _one_shot(folder)
    assert (frames - expected).abs().max().item() <= 1e-4
    assert (expected - without).abs().max().item() > 1e-2  # the LoRA does something the test would see
    assert any("held one at a time" in note for note in notes), notes
    after = _load_counts(spec)
    loading = 1 if strategy == "device_map" else len(after)  # device_map loads on rank 0 alone
    for rank_before, rank_after in zip(before[:loading], after[:loading]):
        names = [f"{expert}:{MODEL}" for expert in EXPERTS]
        assert [rank_after.get(name, 0) - rank_before.get(name, 0) for name in names] == [1, 1]


@pytest.mark.multirank
@pytest.mark.slow
def test_compiled_blocks_cover_the_expert_loaded_at_the_boundary(spec, folder):
    """Regional compile (aot_eager) under Ulysses with the swap: the low-noise expert, loaded at the boundary, runs
    compiled blocks too, and the clip is the pipeline's."""
    frames, notes, _ = _run(spec, "context_parallel", compile="regional", ulysses_degree=2)
    assert (frames - _one_shot(folder)).abs().max().item() <= 1e-4
    assert any("compile regional" in note for note in notes), notes
    for rank in get_backend(spec).status().ranks:
        (transformer,) = [m for m in rank.resident if m.component.startswith("transformer")]
        assert transformer.component == "transformer_2"
        assert transformer.parallelism.get("compiled_blocks") == wan_layers(folder)


@pytest.mark.multirank
@pytest.mark.slow
def test_the_expert_loaded_at_the_boundary_caches_from_its_own_state(spec, folder):
    """first_block_cache (a threshold that skips every pass it may) over 6 steps, 2 with the high-noise expert: the
    low-noise expert, loaded at the boundary, computes its first step in full from a fresh state, the record and the
    pass count go on across the swap, and the clip is WanPipeline's with a cache on each expert."""
    from diffusers.hooks import FirstBlockCacheConfig

    steps, threshold = 6, 9.0
    frames, notes, _ = _run(spec, steps=steps, cache="first_block_cache", cache_threshold=threshold)
    assert any("held one at a time" in note for note in notes), notes
    rank = get_backend(spec).status().ranks[0]
    # each expert's first step (its conditional and unconditional pass) computes, every later one is skipped
    assert rank.last_cache.passes == (True, True, False, False, True, True) + (False,) * 6
    assert rank.last_passes == 2 * steps
    expected = _one_shot(folder, cache=FirstBlockCacheConfig(threshold=threshold), steps=steps)
    assert (frames - expected).abs().max().item() <= 1e-4


@pytest.mark.multirank
@pytest.mark.slow
def test_tensor_parallel_swaps_the_experts_sliced(spec, folder, lora, loras_dir):
    """Tensor parallelism, whose ranks hold 0.65 of each expert: a backend of its own, under a cap for that share (the
    module's backend goes first and comes back with the module's cap after), the LoRA fused into each rank's slices of
    the low-noise expert when it loads."""
    tp = jobs.plan_transformer(spec, model=MODEL, strategy="tensor_parallel").plan
    shutdown_backend()
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(memory.CAP_ENV, _cap(folder, tp))
            jobs.decode(spec, model=MODEL, samples=_empty_latent())
            frames, notes, _ = _run(spec, "tensor_parallel", loras=((lora, "low_noise"),))
            assert (frames - _one_shot(folder, loras_dir / lora)).abs().max().item() <= 1e-4
            assert any("held one at a time" in note for note in notes), notes
            for rank in _load_counts(spec):
                assert [rank.get(f"{expert}:{MODEL}") for expert in EXPERTS] == [1, 1]
    finally:
        shutdown_backend()


def _decide(folder, policy: str, cap: str | None, monkeypatch) -> bool:
    plan = _device_map()
    if cap is None:
        monkeypatch.delenv(memory.CAP_ENV, raising=False)
    else:
        monkeypatch.setenv(memory.CAP_ENV, cap)
    sampling, tokens = _sampling(), WAN_CLIP["max_sequence_length"]
    activations = memory.step_activations(wan, str(folder), plan, sampling, tokens, torch.float32)
    return memory.one_expert_at_a_time(
        wan, str(folder), plan, torch.float32, torch.device("cpu"), policy=policy, activations=activations,
        local_ranks=2, held=_vae_bytes(folder), freed_by_load=0,
    )  # fmt: skip


def test_the_experts_are_swapped_only_when_one_fits_and_two_do_not(folder, monkeypatch):
    plan = _device_map()
    assert not _decide(folder, "staged", None, monkeypatch)  # ample memory: both resident, as before
    assert _decide(folder, "staged", _cap(folder, plan), monkeypatch)
    assert _decide(folder, "auto", _cap(folder, plan), monkeypatch)
    # Not even one fits: nothing to swap; check_denoise refuses the size (it counts one expert when swapping).
    assert not _decide(folder, "staged", f"{_vae_bytes(folder) / 2**30:.12f}", monkeypatch)
    with pytest.raises(WidgetError, match="one fits, not both; set memory_policy to staged or auto") as refused:
        _decide(folder, "resident", _cap(folder, plan), monkeypatch)
    assert refused.value.widget == "memory_policy"


def test_an_emptied_expert_lets_its_memory_go_while_the_object_is_still_held(folder):
    """What the swap does to the first expert, which the pipeline's loop still holds: its parameters, its step
    cache's hooks and what the pack keeps on it (here a fused LoRA's kept original) are collected."""
    import gc
    import weakref

    from diffusers import WanTransformer3DModel
    from diffusers.hooks import TaylorSeerCacheConfig

    from parallel_runtime.worker.models import empty

    expert = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer")
    expert.enable_cache(TaylorSeerCacheConfig())
    expert._parallel_diffusers_loras = {"pristine": expert.proj_out.weight.detach().clone()}
    held = [weakref.ref(t) for t in (expert.proj_out.weight, expert._parallel_diffusers_loras["pristine"])]
    empty(expert)
    gc.collect()
    assert [ref() for ref in held] == [None, None]
    assert not list(expert.parameters()) and list(expert.children())  # the object stays, holding nothing
    expert.disable_cache()  # what the step cache's exit then calls: nothing left to remove
