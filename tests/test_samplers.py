"""ParallelSampler's ``sampler`` and ``scheduler`` widgets (``parallel_runtime.samplers``): every allowed choice on 2
CPU ranks (Ulysses) against diffusers' one-shot pipeline given the same scheduler; the combinations refused by name
before anything loads; and, in a real ComfyUI, ``seed`` and ``steps`` linked from another node's INT output."""

from __future__ import annotations

import itertools

import diffusers
import pytest
import torch
from comfyui_host import ExecutionFailed
from comfyui_workflows import (
    ENCODER,
    SAMPLER,
    SIZE,
    assert_close_uint8,
    reference_uint8,
    saved_png,
    small_workflow,
    tiny_flux,
)
from comfyui_workflows import STEPS as WORKFLOW_STEPS
from helpers import MODEL, NEW_FAMILIES, PROMPT, TOKENS
from img2img import (
    DENOISE,
    GUIDANCE,
    HEIGHT,
    WIDTH,
    ours,
    pipeline_latents,
    pixels,
    posterior_mode,
)
from img2img import PROMPT as IMAGE_PROMPT
from img2img import STEPS as IMAGE_STEPS

from parallel_runtime import InvalidInput, default_spec, jobs
from parallel_runtime.families import family
from parallel_runtime.samplers import SAMPLERS, SCHEDULERS, Sampler, Scheduler

SEED = 5
# Three steps: with two, every schedule is the same two sigmas (the first and the last), so the test could not tell a
# schedule that was not applied.
STEPS = 3
# The image families' choices (uni_pc runs only Wan's folders: tests/test_wan.py).
CHOICES = list(itertools.product(family("flux").samplers, SCHEDULERS))
FAMILIES = {
    "flux": {
        "model": MODEL,
        "pipeline": diffusers.FluxPipeline,
        "max_sequence_length": TOKENS,
        "encode": {},
        "sample": {"guidance_scale": 3.5},
        "reference": {"guidance_scale": 3.5},
    },
    **NEW_FAMILIES,
}


def backend():
    return default_spec(ranks=2, device="cpu", memory_policy="staged")


def one_shot(models_dir, name: str, sampler: Sampler, scheduler: Scheduler) -> torch.Tensor:
    """diffusers' pipeline of the family with the chosen scheduler (the folder's config, the schedule's switch), its
    step noise (lcm) from torch's global generator seeded with the seed."""
    family = FAMILIES[name]
    pipe = family["pipeline"].from_pretrained(models_dir / family["model"], dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    scheduler_class = getattr(diffusers, SAMPLERS[sampler].scheduler_class)
    pipe.scheduler = scheduler_class.from_config(pipe.scheduler.config, **SCHEDULERS[scheduler].config)
    torch.manual_seed(SEED)
    return pipe(
        prompt=PROMPT,
        num_inference_steps=STEPS,
        width=64,
        height=64,
        max_sequence_length=family["max_sequence_length"],
        generator=[torch.Generator("cpu").manual_seed(SEED)],
        output_type="pt",
        **family["reference"],
    ).images.permute(0, 2, 3, 1)


def generate(name: str, sampler: Sampler, scheduler: Scheduler) -> torch.Tensor:
    family, spec = FAMILIES[name], backend()
    positive = jobs.encode_prompt(
        spec,
        model=family["model"],
        prompt=PROMPT,
        max_sequence_length=family["max_sequence_length"],
        **family["encode"],
    )
    transformer = jobs.plan_transformer(spec, model=family["model"], strategy="context_parallel", ulysses_degree=2)
    latent = jobs.sample(
        transformer,
        positive,
        seed=SEED,
        steps=STEPS,
        width=64,
        height=64,
        sampler=sampler.value,
        scheduler=scheduler.value,
        **family["sample"],
    )
    return jobs.decode(spec, model=family["model"], samples=latent)


def check_choice(models_dir, name: str, sampler: Sampler, scheduler: Scheduler) -> None:
    reference = one_shot(models_dir, name, sampler, scheduler)
    diff = (generate(name, sampler, scheduler) - reference).abs().max().item()
    print(f"{name} {sampler.value} {scheduler.value}: max |diff| vs one-shot {diff:.3g}")
    assert diff <= 1e-4
    if (sampler, scheduler) != (Sampler.EULER, Scheduler.SIMPLE):  # the choice changes the image
        assert (reference - one_shot(models_dir, name, Sampler.EULER, Scheduler.SIMPLE)).abs().max() > 1e-3


@pytest.mark.multirank
@pytest.mark.parametrize("sampler, scheduler", CHOICES, ids=[f"{a.value}-{b.value}" for a, b in CHOICES])
def test_every_choice_equals_diffusers_pipeline_with_that_scheduler(models_dir, sampler, scheduler):
    check_choice(models_dir, "flux", sampler, scheduler)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(NEW_FAMILIES))
@pytest.mark.parametrize("sampler, scheduler", CHOICES, ids=[f"{a.value}-{b.value}" for a, b in CHOICES])
def test_every_choice_equals_diffusers_pipeline_on_the_other_families(models_dir, name, sampler, scheduler):
    check_choice(models_dir, name, sampler, scheduler)


def test_img2img_runs_the_choice_as_diffusers_img2img_pipeline(load):
    """FLUX.1 img2img (2 of 3 steps) with lcm on the karras schedule equals FluxImg2ImgPipeline given that scheduler
    (single process: the ranks run the same adapter)."""
    adapter, model_dir, stages = load("flux")
    latent = adapter.encode_image(stages[2], pixels())
    samples = ours("flux", adapter, model_dir, stages, latent, sampler=Sampler.LCM, scheduler=Scheduler.KARRAS)
    pipe = diffusers.FluxImg2ImgPipeline.from_pretrained(model_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = diffusers.FlowMatchLCMScheduler.from_config(pipe.scheduler.config, use_karras_sigmas=True)
    torch.manual_seed(11)  # ours' seed
    reference = pipe(
        prompt=IMAGE_PROMPT,
        image=pipeline_latents("flux", stages[2], posterior_mode("flux", stages[2], pixels())),
        strength=DENOISE,
        num_inference_steps=IMAGE_STEPS,
        guidance_scale=GUIDANCE,
        width=WIDTH,
        height=HEIGHT,
        max_sequence_length=16,
        generator=torch.Generator("cpu").manual_seed(11),
        output_type="pt",
    ).images.permute(0, 2, 3, 1)
    diff = (adapter.decode(stages[2], samples) - reference).abs().max().item()
    print(f"flux img2img lcm karras vs diffusers max |diff| {diff:.3g}")
    assert diff <= 1e-5
    assert (samples - ours("flux", adapter, model_dir, stages, latent)).abs().max() > 1e-3  # not euler's


def test_the_choices_differ():
    """The choices are not one schedule under several names: each sampler × schedule sets a different scheduler."""
    seen = set()
    for sampler, scheduler in CHOICES:
        scheduler_class = getattr(diffusers, SAMPLERS[sampler].scheduler_class)
        made = scheduler_class(use_dynamic_shifting=False, shift=3.0, **SCHEDULERS[scheduler].config)
        made.set_timesteps(STEPS)
        seen.add((scheduler_class.__name__, tuple(round(s, 6) for s in made.sigmas.tolist())))
    assert len(seen) == len(CHOICES)


@pytest.mark.parametrize(
    "strategy, widgets, widget, hint",
    [
        ({"strategy": "context_parallel", "ulysses_degree": 2}, {"sampler": "heun"}, "sampler", "euler, lcm"),
        ({"strategy": "context_parallel", "ulysses_degree": 2}, {"sampler": "uni_pc"}, "sampler", "euler or lcm"),
        ({"strategy": "context_parallel", "ulysses_degree": 2}, {"scheduler": "normal"}, "scheduler", "karras"),
        ({"strategy": "data_parallel"}, {"sampler": "lcm"}, "sampler", "choose euler, or context_parallel"),
    ],
)
def test_a_choice_the_pack_cannot_run_is_refused_by_name(models_dir, strategy, widgets, widget, hint):
    transformer = jobs.plan_transformer(backend(), model=MODEL, **strategy)
    with pytest.raises(InvalidInput, match=hint) as info:
        jobs.validate_sample(transformer, None, steps=2, width=64, height=64, batch_size=2, **widgets)
    assert info.value.widget == widget


# --- widgets linked from other nodes, in a real ComfyUI ------------------------------------------------------------
PRIMITIVE_SEED, PRIMITIVE_STEPS, PRIMITIVE_SIZE, PRIMITIVE_PROMPT = "90", "91", "92", "93"


def linked_workflow(seed: int, steps: int) -> dict:
    """The small workflow with ParallelSampler's seed, steps, width and height and the encoder's prompt linked from
    ComfyUI's own primitive nodes (the frontend's widget-to-input conversion)."""
    workflow = small_workflow(seed=0)
    workflow[PRIMITIVE_SEED] = {"class_type": "PrimitiveInt", "inputs": {"value": seed}}
    workflow[PRIMITIVE_STEPS] = {"class_type": "PrimitiveInt", "inputs": {"value": steps}}
    workflow[PRIMITIVE_SIZE] = {"class_type": "PrimitiveInt", "inputs": {"value": SIZE}}
    prompt = workflow[ENCODER]["inputs"]["prompt"]
    workflow[PRIMITIVE_PROMPT] = {"class_type": "PrimitiveStringMultiline", "inputs": {"value": prompt}}
    workflow[ENCODER]["inputs"]["prompt"] = [PRIMITIVE_PROMPT, 0]
    workflow[SAMPLER]["inputs"].update(
        seed=[PRIMITIVE_SEED, 0], steps=[PRIMITIVE_STEPS, 0], width=[PRIMITIVE_SIZE, 0], height=[PRIMITIVE_SIZE, 0]
    )
    return workflow


@pytest.mark.comfyui
@pytest.mark.multirank
def test_widgets_linked_from_primitives_run_and_are_checked(comfyui_server, comfyui_models_dir):
    model_dir = tiny_flux(comfyui_models_dir)
    workflow = linked_workflow(seed=11, steps=WORKFLOW_STEPS)
    prompt = workflow[PRIMITIVE_PROMPT]["inputs"]["value"]
    prompt_id, _ = comfyui_server.run(workflow, timeout=300)
    assert_close_uint8(saved_png(comfyui_server, prompt_id), reference_uint8(model_dir, prompt, seed=11))

    # ComfyUI checks a typed-in value's range but not a linked one's: the node refuses it by the widget's name.
    for widget, bad in (("seed", -1), ("steps", 5000)):
        workflow = linked_workflow(
            seed=bad if widget == "seed" else 11, steps=bad if widget == "steps" else WORKFLOW_STEPS
        )
        with pytest.raises(ExecutionFailed) as failed:
            comfyui_server.run(workflow, timeout=300)
        error = failed.value.messages[-1]
        assert error["type"] == "execution_error" and error["data"]["node_id"] == SAMPLER, error
        assert error["data"]["exception_message"].startswith(f"{widget}: {bad} is outside"), error


def test_a_linked_number_outside_its_widget_range_is_refused_by_name(nodes):
    """What ParallelSampler checks when it runs: a value ComfyUI did not check (linked from another node)."""
    from parallel_nodes import comfy

    sampler = nodes["ParallelSampler"]
    comfy.check_ranges(sampler, {"seed": 2**64 - 1, "steps": 1000, "denoise": 0.0, "positive": object()})
    for widget, bad in (("seed", -1), ("seed", 2**64), ("steps", 0), ("denoise", 1.5), ("width", 8)):
        with pytest.raises(InvalidInput, match=f"{bad} is outside") as info:
            comfy.check_ranges(sampler, {widget: bad})
        assert info.value.widget == widget
