"""Widget values every step reads the same way: dtypes, device budgets, prompt text, finite numbers, clip lengths."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from ..errors import InvalidInput
from ..spec import BackendSpec, cuda_device_count
from ..wire import Dtype

if TYPE_CHECKING:
    from ..families import FamilyAdapter

DTYPE_OPTIONS = ("auto", *(d.value for d in Dtype))  # the dtype widgets's choices
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|KIB|MB|MIB|GB|GIB|TB|TIB)\s*$", re.IGNORECASE)
# A prompt widget holds at most this much text and, with one_prompt_per_line, this many prompts: far beyond what a
# text encoder reads (512-1024 tokens a prompt), and small enough that a pasted file cannot take the backend down.
MAX_PROMPT_BYTES = 256 << 10
MAX_PROMPTS = 256


def resolve_dtype(dtype: str, spec: BackendSpec, widget: str = "dtype") -> Dtype:
    if dtype not in DTYPE_OPTIONS:
        raise InvalidInput(widget, f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_OPTIONS)}")
    if dtype == "auto":
        # bf16 is what FLUX and Qwen-Image ship in; on CPU float32 is the fast and exact choice.
        return Dtype.BFLOAT16 if spec.device == "cuda" else Dtype.FLOAT32
    return Dtype(dtype)


def parse_max_memory(text: str, widget: str = "max_memory") -> dict[str, str] | None:
    """``"0:16GB,1:16GB,cpu:64GB"`` -> ``{"0": "16GB", "1": "16GB", "cpu": "64GB"}``; empty -> None (no limit)."""
    if not text or not text.strip():
        return None
    budget = {}
    for part in text.split(","):
        device, sep, size = part.partition(":")
        device = device.strip().lower()
        if not sep or not (device.isdigit() or device == "cpu") or not _SIZE.match(size):
            raise InvalidInput(
                widget,
                f"could not read {part.strip()!r}; write device:size pairs such as "
                "0:16GB,1:16GB (GPU index or cpu, size in MB/GB/GiB), or leave it empty",
            )
        if device in budget:
            raise InvalidInput(widget, f"device {device} is listed twice; give each device one size")
        budget[device] = size.strip().upper().replace("IB", "iB")
    gpus = [int(d) for d in budget if d.isdigit()]
    if gpus and max(gpus) >= max(cuda_device_count(), 1) and cuda_device_count() > 0:
        raise InvalidInput(
            widget,
            f"GPU {max(gpus)} does not exist; this machine has {cuda_device_count()} GPUs "
            f"(0..{cuda_device_count() - 1})",
        )
    return budget


def check_text(widget: str, text: str) -> None:
    """Text a tokenizer can take, within the size the pack accepts."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        code = f"U+{ord(text[e.start]):04X}"
        raise InvalidInput(
            widget,
            f"holds a character that is not valid Unicode (a lone surrogate, {code}, at "
            f"position {e.start}); delete it or paste the text again",
        ) from None
    if size > MAX_PROMPT_BYTES:
        raise InvalidInput(
            widget,
            f"is {size / 1024:.0f} KiB of text; a prompt widget takes at most "
            f"{MAX_PROMPT_BYTES >> 10} KiB (a text encoder reads only its first 512-1024 "
            "tokens anyway)",
        )


def prompt_list(widget: str, text: str, one_per_line: bool) -> list[str]:
    """The prompts a widget holds: the whole text, or each non-empty line of it (at most MAX_PROMPTS)."""
    check_text(widget, text)
    if not one_per_line:
        return [text]
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if len(prompts) > MAX_PROMPTS:
        raise InvalidInput(
            widget,
            f"has {len(prompts)} prompts (one per line); one_prompt_per_line takes at most "
            f"{MAX_PROMPTS}: split them over several runs",
        )
    return prompts


def check_finite(widget: str, value: float) -> None:
    """NaN and infinity pass ComfyUI's min/max checks (every comparison with NaN is false) and give a black image."""
    if not math.isfinite(value):
        raise InvalidInput(widget, f"{value} is not a number the sampler can use; give a finite value")


def check_length(family: FamilyAdapter, length: int) -> None:
    """A clip length the family's VAE makes: 4k + 1 frames for Wan (the first frame alone, then 4 per latent frame);
    1 for an image family."""
    step = family.latent.temporal_downscale
    if step == 1:
        if length != 1:
            raise InvalidInput("length", f"{length} frames, but {family.name} makes images; set length to 1")
        return
    if length < 1 or (length - 1) % step:
        lower = max(1, (length - 1) // step * step + 1)
        raise InvalidInput(
            "length",
            f"{length} frames is not {step}k + 1 ({family.name}'s VAE keeps the first frame and then packs {step} "
            f"frames into each latent frame); use {lower} or {lower + step}",
        )
