"""The samplers and sigma schedules ParallelSampler offers, in ComfyUI's words, each one a diffusers flow-matching
scheduler the families' pipelines run as they run their own: one table, read by the widgets (choices, tooltips), the
client's checks (``jobs/sample.py``) and the ranks (``families.base.scheduler_for``, where a family builds its
pipeline).

Not offered: ``heun`` — diffusers' ``FlowMatchHeunDiscreteScheduler.set_timesteps`` takes no ``sigmas``, which
FluxPipeline, Flux2Pipeline and QwenImagePipeline (and their img2img / inpaint twins) always pass, so none of them can
run it; and an ``euler_ancestral`` — ``FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)`` re-noises the
whole predicted image each step, which is ComfyUI's ``lcm`` step (``sample_lcm``), not its ancestral Euler, and is
``lcm`` here.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class Sampler(str, enum.Enum):
    """ParallelSampler's ``sampler`` widget (ComfyUI's ``sampler_name`` words)."""

    EULER = "euler"
    LCM = "lcm"
    UNI_PC = "uni_pc"


class Scheduler(str, enum.Enum):
    """ParallelSampler's ``scheduler`` widget: the sigma schedule (ComfyUI's ``scheduler`` words)."""

    SIMPLE = "simple"
    KARRAS = "karras"
    EXPONENTIAL = "exponential"
    BETA = "beta"


@dataclasses.dataclass(frozen=True)
class SamplerChoice:
    """A sampler as diffusers implements it. ``step_noise``: its step draws fresh noise, which diffusers' pipelines
    take from torch's global generator (they give the scheduler no generator)."""

    scheduler_class: str
    step_noise: bool
    description: str


@dataclasses.dataclass(frozen=True)
class SchedulerChoice:
    """A sigma schedule as the diffusers schedulers' config switches it on."""

    config: dict[str, Any]
    description: str


SAMPLERS: dict[Sampler, SamplerChoice] = {
    Sampler.EULER: SamplerChoice(
        "FlowMatchEulerDiscreteScheduler", False, "flow-match Euler (FlowMatchEulerDiscreteScheduler), the default"
    ),
    Sampler.LCM: SamplerChoice(
        "FlowMatchLCMScheduler",
        True,
        "LCM (FlowMatchLCMScheduler): each step re-noises the predicted image, for LCM- / few-step-distilled models",
    ),
    # Wan's own: WanPipeline's folders ship UniPCMultistepScheduler with flow sigmas, and a video equal to the
    # pipeline's needs it. The image families' folders hold a flow-match Euler config UniPC cannot read, so
    # ``jobs/sample.py`` offers it only to families whose folder's scheduler is UniPC (``FamilyAdapter.samplers``).
    Sampler.UNI_PC: SamplerChoice(
        "UniPCMultistepScheduler",
        False,
        "UniPC with flow sigmas (UniPCMultistepScheduler), Wan's own and its pipeline's default; Wan only",
    ),
}

SCHEDULERS: dict[Scheduler, SchedulerChoice] = {
    # The family's own schedule: evenly spaced sigmas, shifted for the image size as the model's config says.
    Scheduler.SIMPLE: SchedulerChoice({}, "the family's own shifted schedule, the default"),
    Scheduler.KARRAS: SchedulerChoice({"use_karras_sigmas": True}, "Karras sigmas (use_karras_sigmas)"),
    Scheduler.EXPONENTIAL: SchedulerChoice(
        {"use_exponential_sigmas": True}, "exponential sigmas (use_exponential_sigmas)"
    ),
    # diffusers' beta schedule needs scipy (ComfyUI's own requirements bring it).
    Scheduler.BETA: SchedulerChoice({"use_beta_sigmas": True}, "beta sigmas (use_beta_sigmas; needs scipy)"),
}


def describe(choices: dict[Any, Any]) -> str:
    """The choices of a table for a tooltip: ``word: description; ...``."""
    return "; ".join(f"{word.value}: {choice.description}" for word, choice in choices.items())
