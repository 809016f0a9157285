"""CFG parallelism (``strategy="cfg_parallel"``): Qwen-Image's true-CFG passes on two halves of the ranks with context
parallelism inside each half (4 ranks), through the nodes' steps on real CPU ranks, against diffusers' one-shot
pipeline; and every widget combination that cannot work, refused before anything loads. The 2-rank case shares a
backend with the step-cache tests in test_speed.py."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImagePipeline

from parallel_runtime import InvalidInput, default_spec, get_backend, jobs
from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux
from parallel_runtime.families.qwenimage.tiny import make_tiny_model as make_tiny_qwenimage

QWEN, FLUX = "tiny-qwenimage", "tiny-flux"
PROMPT, NEGATIVE = "a photo of a horse in the city", "a blue painting"
# The prompt (13 tokens) and the negative prompt are cut to 8 tokens, so plain Ulysses / Ring split them evenly.
STEPS, TOKENS, TRUE_CFG = 2, 8, 4.0


@pytest.fixture(scope="module")
def models_dir(models_root):
    make_tiny_qwenimage(str(models_root / QWEN))
    make_tiny_flux(str(models_root / FLUX))
    return models_root


@pytest.fixture(scope="module")
def one_process(models_dir):
    """The one-shot QwenImagePipeline's true-CFG IMAGE (two transformer passes per step in one process)."""
    pipe = QwenImagePipeline.from_pretrained(models_dir / QWEN)
    pipe.set_progress_bar_config(disable=True)
    cache = {}

    def reference(width: int = 64, height: int = 64, batch_size: int = 1) -> torch.Tensor:
        key = (width, height, batch_size)
        if key not in cache:
            cache[key] = pipe(
                prompt=PROMPT,
                negative_prompt=NEGATIVE,
                true_cfg_scale=TRUE_CFG,
                num_inference_steps=STEPS,
                width=width,
                height=height,
                max_sequence_length=TOKENS,
                num_images_per_prompt=batch_size,
                generator=[torch.Generator("cpu").manual_seed(3 + i) for i in range(batch_size)],
                output_type="pt",
            ).images.permute(0, 2, 3, 1)
        return cache[key]

    return reference


def backend(ranks: int):
    return default_spec(ranks=ranks, device="cpu", memory_policy="staged")


def generate(spec, *, width=64, height=64, batch_size=1, **strategy_args) -> torch.Tensor:
    positive = jobs.encode_prompt(spec, model=QWEN, prompt=PROMPT, negative_prompt=NEGATIVE, max_sequence_length=TOKENS)
    transformer = jobs.plan_transformer(spec, model=QWEN, strategy="cfg_parallel", **strategy_args)
    latent = jobs.sample(
        transformer,
        positive,
        seed=3,
        steps=STEPS,
        guidance_scale=3.5,
        width=width,
        height=height,
        batch_size=batch_size,
        true_cfg_scale=TRUE_CFG,
    )
    return jobs.decode(spec, model=QWEN, samples=latent)


def _applied(spec) -> list[dict]:
    """What each rank's resident transformer was built with, read back from the model."""
    ranks = get_backend(spec).status().ranks
    return [next(m for m in r.resident if m.component == "transformer").parallelism for r in ranks]


@pytest.mark.multirank
@pytest.mark.four_ranks
@pytest.mark.parametrize(
    "args, applied",
    [
        # CI runs one (about 45 s on a loaded 2-core machine); Ulysses inside each half only before a release.
        ({"ring_degree": 2, "ulysses_degree": 1}, {"cfg_degree": 2, "ring_degree": 2, "ulysses_degree": 1}),
        pytest.param({}, {"cfg_degree": 2, "ring_degree": 1, "ulysses_degree": 2}, marks=pytest.mark.slow),
    ],
    ids=["ring", "ulysses_fills_each_half"],
)
def test_cfg_parallel_with_context_parallel_inside_each_half(models_dir, one_process, args, applied):
    """4 ranks: CFG 2 × Ring 2, and CFG 2 × Ulysses 2 (ulysses_degree 0 fills each half), on one backend."""
    spec = backend(4)
    diff = (generate(spec, **args) - one_process()).abs().max().item()
    print(f"cfg_parallel 4 ranks {applied}: max |diff| vs one process {diff:.3g}")
    assert diff <= 1e-4, args
    assert _applied(spec) == [applied] * 4, args


@pytest.mark.parametrize(
    "widget, ranks, model, args, hint",
    [
        ("strategy", 3, QWEN, {}, "needs an even number of ranks; the backend has 3"),
        ("ulysses_degree", 4, QWEN, {"ulysses_degree": 4}, "make the product 2"),
        ("ulysses_degree", 4, QWEN, {"ring_degree": 2, "ulysses_degree": 2}, "= 4; make the product 2"),
        ("strategy", 2, FLUX, {}, "FLUX.1 has no true CFG.*use context_parallel"),
    ],
)
def test_cfg_parallel_widgets_are_refused_by_name(models_dir, widget, ranks, model, args, hint):
    with pytest.raises(InvalidInput, match=hint) as info:
        jobs.plan_transformer(backend(ranks), model=model, strategy="cfg_parallel", **args)
    assert info.value.widget == widget


def test_context_parallel_widgets_are_unused_when_each_half_is_one_rank(models_dir):
    """2 ranks: each half is one rank, so a workflow made for 4 (anything on) still runs, without the split."""
    plan = jobs.plan_transformer(backend(2), model=QWEN, strategy="cfg_parallel", anything=True).plan
    assert (plan.cp_degree, plan.anything, plan.splits_tokens, plan.describe()) == (1, False, False, "cfg2")
    plan = jobs.plan_transformer(backend(4), model=QWEN, strategy="cfg_parallel", anything=True).plan
    assert (plan.ulysses_degree, plan.anything, plan.splits_tokens, plan.describe()) == (
        2,
        True,
        True,
        "cfg2xcp:ring1xulysses2+anything:auto",
    )


def test_cfg_parallel_needs_true_cfg_at_the_sampler(models_dir):
    transformer = jobs.plan_transformer(backend(2), model=QWEN, strategy="cfg_parallel")
    args = {"steps": STEPS, "width": 64, "height": 64, "batch_size": 1}
    with pytest.raises(InvalidInput, match=r"turns true CFG off.*raise true_cfg_scale above 1") as info:
        jobs.validate_sample(transformer, None, true_cfg_scale=1.0, **args)
    assert info.value.widget == "true_cfg_scale"
    jobs.validate_sample(transformer, None, true_cfg_scale=TRUE_CFG, **args)
