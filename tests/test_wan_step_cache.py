"""The step cache on Wan (``worker/step_cache.py``): one cache per expert of Wan 2.2 A14B, each with its own state,
so nothing a pass of the high-noise expert left (its first block's residual, its Taylor factors) decides a pass of
the low-noise one: the switch's first pass runs in full. In one process against diffusers' ``enable_cache`` on each
of ``WanPipeline``'s transformers (the rule, with a threshold that skips every pass it can); on 2 CPU ranks (slow)
under Ulysses, both caches, every rank deciding alike, against the same one-process video.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLWan, WanPipeline
from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig
from helpers import WAN_CLIP, wan_clip_prompt

from parallel_runtime import default_spec, get_backend, jobs
from parallel_runtime.families import Placement, family
from parallel_runtime.families.base import latent_statistics
from parallel_runtime.families.wan.tiny import make_tiny_model
from parallel_runtime.samplers import Sampler
from parallel_runtime.wire import CacheMode, Prompts, Sampling, StepCache
from parallel_runtime.worker import step_cache

wan = family("wan")
MODEL = "tiny-wan22-cache"
STEPS = 6  # 2 with the high-noise expert (t >= 875), 4 with the low-noise one
SWITCH = 2 * 2  # the low-noise expert's first pass: step 2's conditional one (two passes a step: true CFG)
THRESHOLD = 9.0  # first_block_cache skips every pass it may: only a fresh state computes in full
CPU = Placement("cpu")


@pytest.fixture(scope="module")
def folder(models_root):
    make_tiny_model(str(models_root / MODEL), 0, two_experts=True)
    return models_root / MODEL


def sampling() -> Sampling:
    return Sampling(
        seed=3,
        steps=STEPS,
        guidance_scale=1.0,
        width=WAN_CLIP["width"],
        height=WAN_CLIP["height"],
        true_cfg_scale=WAN_CLIP["guidance_scale"],
        sampler=Sampler.UNI_PC,
        frames=WAN_CLIP["num_frames"],
    )


_UNCACHED: dict[str, torch.Tensor] = {}


def one_process(folder, config=None) -> torch.Tensor:
    """WanPipeline's LATENT (ComfyUI's: un-normalised), with ``config`` enabled on each of its transformers."""
    if config is None and str(folder) in _UNCACHED:
        return _UNCACHED[str(folder)]
    pipe = WanPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    if config is not None:
        for transformer in (pipe.transformer, pipe.transformer_2):
            transformer.enable_cache(config)
    latents = pipe(
        **{**WAN_CLIP, "num_inference_steps": STEPS},
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="latent",
    ).frames
    mean, inverse_std = latent_statistics(AutoencoderKLWan.load_config(folder, subfolder="vae"))
    if config is None:
        _UNCACHED[str(folder)] = latents / inverse_std + mean
    return latents / inverse_std + mean


TAYLORSEER = TaylorSeerCacheConfig(taylor_factors_dtype=torch.float32, cache_identifiers=list(wan.taylorseer_layers))
RULES = [
    # (mode, diffusers' config, the cache's decisions: True where a pass ran in full)
    (
        StepCache(CacheMode.FIRST_BLOCK_CACHE, THRESHOLD),
        FirstBlockCacheConfig(threshold=THRESHOLD),
        # each expert's first step (its conditional and unconditional pass) computes, every later one is skipped
        [True, True, False, False] + [True, True] + [False] * 6,
    ),
    # taylorseer: its warm-up steps (3 per state) again after the switch
    (StepCache(CacheMode.TAYLORSEER), TAYLORSEER, [True] * 4 + [True] * 6 + [False, False]),
]
IN_PROCESS = [  # the first rule in the default run; taylorseer's costs a second pipeline, so slow
    pytest.param(*RULES[0], id=RULES[0][0].mode.value),
    pytest.param(*RULES[1], id=RULES[1][0].mode.value, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("cache, config, decisions", IN_PROCESS)
def test_each_expert_caches_from_its_own_state(folder, cache, config, decisions):
    text = wan.load_text_encoders(str(folder), torch.float32, CPU)
    embeds = wan.encode(
        text,
        Prompts(
            (WAN_CLIP["prompt"],),
            negative_prompts=(WAN_CLIP["negative_prompt"],),
            max_sequence_length=WAN_CLIP["max_sequence_length"],
        ),
    )
    experts = [wan.load_transformer(str(folder), torch.float32, CPU, sub) for sub in ("transformer", "transformer_2")]
    with step_cache.step_cache(experts, cache, None, wan.taylorseer_layers) as record:
        latent = wan.denoise(str(folder), experts[0], embeds, sampling(), transformer_2=experts[1])
    print(f"{cache.mode.value}: {record.passes}")
    assert record.passes == decisions
    assert record.passes[SWITCH]  # the low-noise expert's first pass ran in full
    assert (latent - one_process(folder, config)).abs().max().item() <= 1e-5
    assert (latent - one_process(folder)).abs().max().item() > 1e-3  # the cache skipped something that shows


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("cache, config, decisions", RULES, ids=[r[0].mode.value for r in RULES])
def test_ranks_agree_on_two_experts_under_ulysses(folder, cache, config, decisions):
    spec = default_spec(ranks=2, device="cpu", memory_policy="resident")
    positive = wan_clip_prompt(spec, MODEL)
    transformer = jobs.plan_transformer(
        spec, model=MODEL, strategy="context_parallel", ulysses_degree=2, cache=cache.mode.value,
        cache_threshold=cache.threshold,
    )  # fmt: skip
    s = sampling()
    latent = jobs.sample(
        transformer,
        positive,
        seed=s.seed,
        steps=STEPS,
        guidance_scale=1.0,
        true_cfg_scale=s.true_cfg_scale,
        width=s.width,
        height=s.height,
        sampler="uni_pc",
        length=s.frames,
    )
    ranks = get_backend(spec).status().ranks
    assert [r.last_cache.passes for r in ranks] == [tuple(decisions)] * 2
    assert [r.last_passes for r in ranks] == [2 * STEPS] * 2
    assert (latent - one_process(folder, config)).abs().max().item() <= 1e-4
