"""Model-family adapters: one module per family (FLUX.1, ...) that knows its pipeline class, how to encode a prompt,
how to pack / unpack latents and the VAE's scale and shift. The backend's stage ops are family-agnostic and call
these.

This module holds what the adapters share: how a `placement` dict becomes `from_pretrained` arguments.
"""

from __future__ import annotations

import logging
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
