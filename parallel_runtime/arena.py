"""Tensors in POSIX shared memory, described in messages by ``{segment, offset, dtype, shape}``.

One ``Arena`` per direction (client → rank 0, rank 0 → client), with exactly one writer. Calls are strictly
request/response, so a writer reuses its segment only after the reader has answered: the region a reader
is reading is never overwritten (copy at enqueue: the sender copies into the arena and never hands out a
view of a live tensor). Reusing one segment keeps its pages mapped, which is what makes large transfers
cost about a memcpy instead of a page-fault storm. The segment grows (under a new, unguessable name)
when a message does not fit.

Segments are files under /dev/shm named ``<prefix>-<random>``, created 0600. Everything one backend
creates shares its prefix, so ``remove_segments(prefix)`` clears it after a shutdown or a crash.
"""
from __future__ import annotations

import glob
import mmap
import os
import secrets

import torch

SHM_DIR = "/dev/shm"
_ALIGN = 64
_MIN_CAPACITY = 1 << 20

# Every dtype images, latents, embeddings and masks use. Others are refused rather than guessed at.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"tensors of dtype {dtype} cannot travel through the arena; supported: {sorted(DTYPES)}")
    return name


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor's storage (works for bool, bfloat16 and 0-d tensors)."""
    return t.reshape(-1).view(torch.uint8)


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class Arena:
    """The writing side: copies tensors into one reusable shared-memory segment."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.name: str | None = None
        self.capacity = 0
        self._mm: mmap.mmap | None = None

    def _grow(self, needed: int) -> None:
        self.close()
        capacity = max(_MIN_CAPACITY, 1 << (needed - 1).bit_length())
        name = f"{self.prefix}-{secrets.token_hex(8)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, capacity)
            self._mm = mmap.mmap(fd, capacity)
        finally:
            os.close(fd)
        self.name, self.capacity = name, capacity

    def write(self, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
        """Copy ``tensors`` into the segment; returns their descriptors (valid until the next write)."""
        layout, end = [], 0
        for key, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor {key!r} is a {type(t).__name__}, not a torch.Tensor")
            nbytes = t.numel() * t.element_size()
            layout.append((key, t, end, nbytes))
            end = (end + nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        if end > self.capacity:
            self._grow(end)
        descs = {}
        for key, t, offset, nbytes in layout:
            if nbytes:
                src = _as_bytes(t.detach().to("cpu").contiguous())
                torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=offset).copy_(src)
            descs[key] = {"segment": self.name, "offset": offset, "dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
        return descs

    def close(self) -> None:
        """Unmap and unlink the segment. A reader that still has it mapped keeps its pages until it unmaps."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self.name is not None:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass
            self.name, self.capacity = None, 0


class ArenaReader:
    """The reading side: maps the writer's current segment and copies tensors out of it."""

    def __init__(self) -> None:
        self._name: str | None = None
        self._mm: mmap.mmap | None = None

    def _segment(self, name: str) -> mmap.mmap:
        if name != self._name:
            if "/" in name or not name:
                raise ValueError(f"bad segment name {name!r}")
            self.close()
            path = os.path.join(SHM_DIR, name)
            self._mm = _map(path, os.stat(path).st_size)
            self._name = name
        return self._mm

    def read(self, descs: dict[str, dict]) -> dict[str, torch.Tensor]:
        """Copies of the described tensors: they stay valid after the writer reuses its segment."""
        out = {}
        for key, d in descs.items():
            dtype = DTYPES.get(d["dtype"])
            if dtype is None:
                raise TypeError(f"tensor {key!r} has unsupported dtype {d['dtype']!r}")
            t = torch.empty(d["shape"], dtype=dtype)
            nbytes = t.numel() * t.element_size()
            if nbytes:
                src = torch.frombuffer(self._segment(d["segment"]), dtype=torch.uint8, count=nbytes, offset=d["offset"])
                _as_bytes(t).copy_(src)
            out[key] = t
        return out

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
        self._name, self._mm = None, None


def remove_segments(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with ``prefix``; returns the names removed."""
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except FileNotFoundError:
            pass
    return removed
