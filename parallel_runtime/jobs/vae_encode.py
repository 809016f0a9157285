"""VAEEncodeSingleGPU's step: check the IMAGE, crop it to whole transformer tokens, then encode on one device of the
backend (the posterior's mode: the same image always gives the same LATENT)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .. import families
from ..client import ProgressFn, get_backend
from ..errors import InvalidInput
from ..spec import BackendSpec
from ..wire import VaeEncodeArgs
from .decode import decode_device, validate_decode
from .widgets import resolve_dtype


@dataclasses.dataclass(frozen=True)
class Encoded:
    """VAEEncodeSingleGPU's result: the LATENT samples, and the pixel size encoded when the image was cropped to it
    (None when it was used whole)."""

    samples: torch.Tensor
    cropped_to: tuple[int, int] | None


def crop_pixels(pixels: torch.Tensor, multiple: int) -> torch.Tensor:
    """The centre of an IMAGE with both sides cut down to multiples of ``multiple``: what ComfyUI's VAEEncode does to
    sizes its VAE cannot take (``VAE.vae_encode_crop_pixels``), here to whole transformer tokens."""
    for dim in (1, 2):
        size = pixels.shape[dim]
        kept = size // multiple * multiple
        if kept != size:
            pixels = pixels.narrow(dim, (size % multiple) // 2, kept)
    return pixels


def vae_encode(
    spec: BackendSpec,
    *,
    model: str,
    pixels: torch.Tensor,
    device: str = "auto",
    dtype: str = "auto",
    on_progress: ProgressFn | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> Encoded:
    """Encode an IMAGE ``[B, H, W, 3]`` in 0..1 with the model's VAE on one device; LATENT samples in ComfyUI's
    convention of the family. Sides that are not multiples of the family's token size (16 pixels) are cropped to
    the centre, as ComfyUI's VAEEncode crops to its VAE's factor."""
    ref = validate_decode(model=model, device=device)
    device = decode_device(spec, device)
    family = families.family(ref.family)
    if not isinstance(pixels, torch.Tensor) or pixels.ndim != 4 or pixels.shape[-1] not in (3, 4):
        shape = list(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels).__name__
        raise InvalidInput("pixels", f"is not an IMAGE ([B, H, W, 3], got {shape}); link an IMAGE such as LoadImage's")
    multiple = family.pixels_per_token
    height, width = pixels.shape[1], pixels.shape[2]
    if height < multiple or width < multiple:
        raise InvalidInput(
            "pixels", f"{width}×{height} is smaller than {family.name}'s {multiple}-pixel patches; upscale the image"
        )
    if not torch.isfinite(pixels).all():
        raise InvalidInput("pixels", "holds NaN or infinite values; re-load the image")
    cropped = crop_pixels(pixels[..., :3], multiple)
    args = VaeEncodeArgs(model=ref, device=device, dtype=resolve_dtype(dtype, spec))
    result = get_backend(spec).call(
        args, {"pixels": cropped.float().contiguous()}, on_progress=on_progress, should_cancel=should_cancel
    )
    size = (cropped.shape[2], cropped.shape[1])
    return Encoded(result.tensors["samples"], size if size != (width, height) else None)
