"""ParallelModelFromComfyFiles' step: ComfyUI's own files for a family checked from their headers, then converted once
into a cached diffusers folder (``comfy_files``), whose model name feeds the other nodes' ``model`` input."""

from __future__ import annotations

from collections.abc import Callable

from .. import comfy_files
from ..client import ProgressFn


def validate_comfy_files(
    *,
    diffusion_model: str,
    text_encoder: str,
    text_encoder_2: str,
    vae: str,
    diffusion_model_2: str = comfy_files.NO_FILE,
) -> comfy_files.FilesPlan:
    """The checks the node makes before it runs (also its validate_inputs): headers only, nothing converted."""
    return comfy_files.plan_files(diffusion_model, text_encoder, text_encoder_2, vae, diffusion_model_2)


def model_from_comfy_files(
    *,
    diffusion_model: str,
    text_encoder: str,
    text_encoder_2: str,
    vae: str,
    diffusion_model_2: str = comfy_files.NO_FILE,
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
    )
    return comfy_files.convert(plan, on_progress=on_progress, should_cancel=should_cancel), plan
