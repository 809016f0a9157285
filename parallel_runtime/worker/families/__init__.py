"""Model-family adapters: one module per family (FLUX.1, ...) that knows its pipeline class, how to encode a prompt,
how to pack / unpack latents and the VAE's scale and shift. The backend's stage ops are family-agnostic and call
these.

This module holds what the adapters share: how a `placement` dict becomes `from_pretrained` arguments, how a
batch's conditioning, noise and step reports are laid out, and how a decoded image becomes a ComfyUI IMAGE.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypedDict

import torch


logger = logging.getLogger(__name__)


class Placement(TypedDict, total=False):
    """Where a stage's components go.

    - `device`: the device to load onto when no `device_map` is given ("cpu", "cuda:0", ...).
    - `device_map`: diffusers / accelerate placement across several devices: "balanced" for a pipeline of text
      encoders, "auto" for a single model (the recipes of diffusers' distributed-inference guide).
    - `max_memory`: per-device budget for `device_map`, e.g. `{0: "16GB", 1: "16GB"}`.
    """

    device: str
    device_map: str | None
    max_memory: dict[int | str, str] | None


def placement_kwargs(placement: Placement, component: str) -> dict[str, Any]:
    """`from_pretrained` keyword arguments for `placement`; empty when the components load on `placement["device"]`.

    On CPU a `device_map` is dropped (and logged): diffusers' pipeline-level "balanced" silently does nothing there,
    "auto" raises NotImplementedError and a GPU `max_memory` raises without an accelerator. Skipping it keeps the CPU
    mode on the same code path as the GPU one.
    """
    device_map = placement.get("device_map")
    if device_map is None:
        return {}
    device = torch.device(placement.get("device", "cpu"))
    if device.type == "cpu":
        logger.info("%s: device_map=%r skipped on CPU; loading on the CPU.", component, device_map)
        return {}
    kwargs: dict[str, Any] = {"device_map": device_map}
    if placement.get("max_memory"):
        kwargs["max_memory"] = placement["max_memory"]
    return kwargs


def load_placed(cls: Any, model_dir: str, dtype: torch.dtype, placement: Placement, component: str,
                **kwargs: Any) -> Any:
    """``cls.from_pretrained(model_dir, dtype=dtype, **kwargs)`` placed as ``placement`` says: spread by its
    ``device_map``, or moved whole to its ``device``. One recipe for every family's pipelines and models."""
    placed = placement_kwargs(placement, component)
    loaded = cls.from_pretrained(model_dir, dtype=dtype, **kwargs, **placed)
    if "device_map" not in placed:
        loaded.to(placement.get("device", "cpu"))
    return loaded


def expand_batch(embeds: dict[str, torch.Tensor], batch_size: int) -> dict[str, torch.Tensor]:
    """One row per image: every conditioning tensor holds one row per prompt, repeated here for that prompt's
    ``batch_size / prompts`` images, prompt by prompt (the order of the pipelines' ``num_images_per_prompt``)."""
    prompts = next(iter(embeds.values())).shape[0]
    if batch_size % prompts:
        raise ValueError(f"batch_size {batch_size} is not a multiple of the number of prompts {prompts}.")
    return {name: tensor.repeat_interleave(batch_size // prompts, dim=0) for name, tensor in embeds.items()}


def generators(seed: int, batch_size: int) -> list[torch.Generator]:
    """Image ``i`` draws its noise from its own CPU generator seeded ``seed + i``: the same noise on every device and
    rank, and an image that does not depend on how a batch is split (data parallelism gives each rank a slice)."""
    return [torch.Generator("cpu").manual_seed(seed + i) for i in range(batch_size)]


def step_callback(on_step: Callable[[int, int], None] | None) -> Callable[..., dict]:
    """A pipeline's ``callback_on_step_end`` that calls ``on_step(step_index, total)`` after each step; an exception
    raised from ``on_step`` stops the loop, which is how a caller cancels."""

    def step_end(pipeline: Any, step_index: int, timestep: torch.Tensor, callback_kwargs: dict) -> dict:
        if on_step is not None:
            on_step(step_index, pipeline.num_timesteps)
        return {}

    return step_end


def comfy_image(decoded: torch.Tensor) -> torch.Tensor:
    """A VAE's [B, 3, H, W] output in [-1, 1] as a ComfyUI IMAGE [B, H, W, 3] float32 in 0..1 on the CPU: the
    pipelines' own post-processing (clamped); only the layout is ComfyUI's."""
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor().postprocess(decoded, output_type="pt").permute(0, 2, 3, 1).float().cpu()
