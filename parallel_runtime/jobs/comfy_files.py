"""ParallelModelFromComfyFiles' step: ComfyUI's own files for a family checked from their headers, then converted once
into a cached diffusers folder (``comfy_files``), whose model name feeds the other nodes' ``model`` input."""

from __future__ import annotations

from collections.abc import Callable

from .. import comfy_files, families
from ..client import ProgressFn
from ..errors import InvalidInput


def validate_comfy_files(
    *,
    diffusion_model: str,
    text_encoder: str,
    text_encoder_2: str,
    vae: str,
    diffusion_model_2: str = comfy_files.NO_FILE,
    clip_vision: str = comfy_files.NO_FILE,
) -> comfy_files.FilesPlan:
    """The checks the node makes before it runs (also its validate_inputs): headers only, nothing converted; files
    that would convert into a pipeline no family of the pack runs (``families.REGISTRY``) are refused here, before a
    conversion of tens of gigabytes that the next node would refuse."""
    plan = comfy_files.plan_files(diffusion_model, text_encoder, text_encoder_2, vae, diffusion_model_2, clip_vision)
    pipeline = plan.contents.model_index["_class_name"]
    if families.for_pipeline(pipeline) is None:
        raise InvalidInput(
            "diffusion_model",
            f"{plan.variant} converts into a {pipeline} folder, which no node of this pack runs yet; pick a model "
            f"the pack runs: {families.supported()}",
        )
    return plan


def model_from_comfy_files(
    *,
    diffusion_model: str,
    text_encoder: str,
    text_encoder_2: str,
    vae: str,
    diffusion_model_2: str = comfy_files.NO_FILE,
    clip_vision: str = comfy_files.NO_FILE,
    on_progress: ProgressFn | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> tuple[str, comfy_files.FilesPlan]:
    """The model name of the files' diffusers folder (converted now, or found from an earlier run) and the plan."""
    plan = validate_comfy_files(
        diffusion_model=diffusion_model,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        vae=vae,
        diffusion_model_2=diffusion_model_2,
        clip_vision=clip_vision,
    )
    return comfy_files.convert(plan, on_progress=on_progress, should_cancel=should_cancel), plan
