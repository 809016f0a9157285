"""VAEDecodeSingleGPU's step: check the LATENT against the model's VAE, then decode on one device of the backend."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import families, model_folders
from ..client import ProgressFn, get_backend
from ..errors import InvalidInput
from ..spec import BackendSpec, cuda_device_count
from ..wire import DecodeArgs, DecodeResult, ModelRef
from .widgets import resolve_dtype


def decode_device_choices() -> list[str]:
    return ["auto", "cpu"] + [f"cuda:{i}" for i in range(cuda_device_count())]


def decode_device(spec: BackendSpec, device: str) -> str:
    """The device a decode runs on: ``auto`` is the backend's first GPU, or the CPU."""
    if device == "auto":
        return "cuda:0" if spec.device == "cuda" else "cpu"
    return device


def validate_decode(*, model: str, device: str = "auto", decode_over_ranks: bool = False) -> ModelRef:
    """The checks VAEDecodeSingleGPU can make before it runs (also its validate_inputs)."""
    ref = model_folders.resolve(model)
    if device not in decode_device_choices():
        raise InvalidInput(
            "device", f"{device!r} is not available here; choose one of {', '.join(decode_device_choices())}"
        )
    if decode_over_ranks and device != "auto":
        raise InvalidInput(
            "device",
            f"decode_over_ranks decodes on every rank's own device, so it cannot also decode on {device}; set device "
            "to auto, or turn decode_over_ranks off",
        )
    return ref


def decode(
    spec: BackendSpec,
    *,
    model: str,
    samples: torch.Tensor,
    device: str = "auto",
    dtype: str = "auto",
    decode_over_ranks: bool = False,
    on_progress: ProgressFn | None = None,
    should_cancel: Callable[[], bool] | None = None,
    on_result: Callable[[DecodeResult], None] | None = None,
) -> torch.Tensor:
    """Decode LATENT samples with the model's VAE on one device; IMAGE ``[B, H, W, 3]`` float32 in 0..1 (a video
    family's clips: ``[B·frames, H, W, 3]``, clip by clip, as ComfyUI's VAEDecode gives them). With
    ``decode_over_ranks``, diffusers' tiled decode (``enable_tiling()``) with its tiles shared over the backend's ranks,
    each on its own device. ``on_result`` gets the backend's answer (tiles per rank, peak memory per rank on CUDA)."""
    ref = validate_decode(model=model, device=device, decode_over_ranks=decode_over_ranks)
    device = decode_device(spec, device)
    family = families.family(ref.family)
    channels = family.latent.channels(model_folders.read_config(ref, "vae"))
    frames = samples.shape[2] if samples.ndim == 5 else 1  # video-VAE latents: [B, C, T, h, w]
    video = family.latent.temporal_downscale > 1  # a video family decodes clips; an image family one frame
    wrong_frames = frames != 1 and not video
    if samples.ndim not in family.latent.ndims or (channels and samples.shape[1] != channels) or wrong_frames:
        expected = " or ".join(f"{n}-D" for n in family.latent.ndims)
        raise InvalidInput(
            "samples",
            f"LATENT of shape {list(samples.shape)} does not fit {model}'s VAE "
            f"({family.name}: {expected}, {channels} channels{'' if video else ', one frame'}); decode it with "
            "the VAE of the model that made it",
        )
    args = DecodeArgs(model=ref, device=device, dtype=resolve_dtype(dtype, spec), over_ranks=bool(decode_over_ranks))
    result = get_backend(spec).call(
        args, {"samples": samples.float()}, on_progress=on_progress, should_cancel=should_cancel
    )
    if on_result is not None:
        on_result(result.result)
    return result.tensors["images"]


def over_ranks_text(result: DecodeResult) -> str:
    """What VAEDecodeSingleGPU shows after a decode over the ranks: the tiles each rank decoded and the memory each
    took above its VAE's weights, and why a rank had no tile."""
    tiles, peaks = result.tiles_per_rank, result.peak_bytes_per_rank
    text = f"decoded {sum(tiles)} tiles over the ranks ({', '.join(map(str, tiles))} per rank)"
    if peaks:
        text += f"; peak memory per rank above the VAE's weights: {', '.join(f'{p / 2**30:.2f}' for p in peaks)} GiB"
    if 0 in tiles:
        text += (
            "; the image or clip has fewer of the VAE's tiles than the backend has ranks, so some ranks had none "
            "(a plain decode, decode_over_ranks off, takes as long)"
        )
    return text
