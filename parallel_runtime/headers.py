"""A safetensors file's header, read and checked as safetensors' loader checks it, without reading a tensor.

Both ComfyUI's own files (``comfy_files``) and a diffusers folder's weights (``model_folders``, its block counts
against the config) are judged from their headers before anything loads: a file that passes here does not fail later
on the ranks with safetensors' own message, and a hostile header is a ValueError saying what is wrong, never a raw
exception or an unbounded read.
"""

from __future__ import annotations

import json
import os

# Bits per element of every dtype safetensors knows (its Dtype enum).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
    "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64,
    "I64": 64, "U64": 64,
}  # fmt: skip
# A longer header is refused unread: a hostile length must not make validation read gigabytes.
MAX_HEADER_BYTES = 100 << 20


def read_header(path: str) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """The safetensors header: each tensor's (dtype, shape), and the metadata; ValueError saying what is wrong.

    Reads only the header, and checks it as safetensors' loader will (so that a file that passes here does not fail
    later on the ranks): every entry an object with a known dtype, a shape of non-negative integers and two offsets;
    each tensor's bytes its shape × dtype; the tensors back to back, without overlap, filling the file exactly (a file
    cut short fails here)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        length = int.from_bytes(head, "little")
        size = os.fstat(f.fileno()).st_size
        if length > MAX_HEADER_BYTES or length + 8 > size:
            raise ValueError("its header length is not plausible")
        try:
            data = json.loads(f.read(length))
        except RecursionError:
            raise ValueError("its header nests too deep to be a safetensors header") from None
        except UnicodeDecodeError:
            raise ValueError("its header is not text") from None
    if not isinstance(data, dict):
        raise ValueError("its header is not a JSON object")
    metadata = data.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("its __metadata__ is not an object of strings")
    tensors, spans = {}, []
    for key, entry in data.items():
        tensors[key] = _entry(key, entry, spans)
    end = 0
    for start, stop, key in sorted(spans):
        if start != end:
            what = "overlaps the tensor before it" if start < end else "leaves a gap before it"
            raise ValueError(f"the bytes of {key!r} start at {start}, which {what} (at {end}): the header is damaged")
        end = stop
    if end != size - 8 - length:
        raise ValueError(
            f"its tensors take {end} bytes but the file holds {size - 8 - length} after the header: it is cut short "
            "or damaged (download it again)"
        )
    return tensors, metadata


def _entry(key: str, entry: object, spans: list[tuple[int, int, str]]) -> tuple[str, tuple[int, ...]]:
    """One tensor's header entry checked: (dtype, shape); its byte span is added to ``spans``."""
    if not isinstance(entry, dict):
        raise ValueError(f"its header entry for {key!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise ValueError(f"{key!r} has the dtype {dtype!r}, which safetensors does not know")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"{key!r} has the shape {shape!r}, not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise ValueError(f"{key!r} has the data_offsets {offsets!r}, not two increasing byte offsets")
    n = 1
    for d in shape:
        n *= d
    if n * DTYPE_BITS[dtype] != 8 * (offsets[1] - offsets[0]):
        raise ValueError(
            f"{key!r} is {dtype} of shape {tuple(shape)} but {offsets[1] - offsets[0]} bytes long: the header is "
            "damaged"
        )
    spans.append((offsets[0], offsets[1], key))
    return dtype, tuple(shape)
