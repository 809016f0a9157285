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

import ctypes
import dataclasses
import errno
import glob
import math
import mmap
import os
import secrets

import torch

from .wire import TENSOR_DTYPES

SHM_DIR = "/dev/shm"
_ALIGN = 64
_MIN_CAPACITY = 1 << 20

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in TENSOR_DTYPES}


@dataclasses.dataclass(frozen=True)
class TensorDesc:
    """Where a tensor lies in an arena segment, as a message carries it (checked: a frame with a negative dimension or
    an unknown dtype is refused before anything maps memory for it)."""

    segment: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} cannot travel through the arena; supported: {sorted(TORCH_DTYPES)}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"shape {list(self.shape)} has a negative dimension")
        if self.offset < 0:
            raise ValueError(f"offset {self.offset} is negative")
        if "/" in self.segment or self.segment in (".", "..") or (not self.segment and self.nbytes):
            raise ValueError(f"bad segment name {self.segment!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise TypeError(f"tensors of dtype {dtype} cannot travel through the arena; supported: {sorted(TORCH_DTYPES)}")
    return name


# Fresh private memory for a tensor this big is mapped with transparent huge pages where the kernel offers
# them on request (THP "madvise", the common default): one fault per 2 MiB instead of one per 4 KiB. On a
# VM a 4 KiB fault costs more than copying the page, so this decides whether a copy-out costs 1× or 4×.
_HUGEPAGE_MIN_BYTES = 4 << 20


def _empty(shape: list[int], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """An uninitialised tensor; large ones on anonymous memory advised to use huge pages."""
    if nbytes < _HUGEPAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds a reference to ``mm``: the memory is unmapped when the last view of it dies.
    return torch.frombuffer(mm, dtype=torch.uint8).view(dtype).reshape(shape)


def _address(mm: mmap.mmap) -> int:
    """Where ``mm`` is mapped. (frombuffer does not keep the buffer exported, so ``mm`` can still close.)"""
    return torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()


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
        self._fd = -1
        self._reserved = 0  # bytes of the segment backed by reserved pages

    def _grow(self, needed: int) -> None:
        self.close()
        capacity = max(_MIN_CAPACITY, 1 << (needed - 1).bit_length())
        name = f"{self.prefix}-{secrets.token_hex(8)}"
        self._fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.name = name
        os.ftruncate(self._fd, capacity)
        self._mm = mmap.mmap(self._fd, capacity)
        self._base = _address(self._mm)
        self.capacity = capacity

    def _reserve(self, end: int) -> None:
        """Back the first ``end`` bytes with pages now. A sparse segment on a full /dev/shm kills the process that
        first touches a missing page with SIGBUS and no Python error (on the client's side, ComfyUI itself)."""
        if end <= self._reserved:
            return
        try:
            os.posix_fallocate(self._fd, 0, end)
        except OSError as e:
            raise SharedMemoryFull(end) from e
        self._reserved = end

    def write(self, tensors: dict[str, torch.Tensor]) -> dict[str, TensorDesc]:
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
        self._reserve(end)
        descs = {}
        for key, t, offset, nbytes in layout:
            if nbytes:
                src = t.detach().to("cpu").contiguous()
                ctypes.memmove(self._base + offset, src.data_ptr(), nbytes)
            descs[key] = TensorDesc(self.name or "", offset, _dtype_name(t.dtype), tuple(t.shape))
        return descs

    def close(self) -> None:
        """Unmap and unlink the segment. A reader that still has it mapped keeps its pages until it unmaps."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd, self._reserved = -1, 0
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
            self.close()
            path = os.path.join(SHM_DIR, name)
            self._mm = _map(path, os.stat(path).st_size)
            self._name = name
        return self._mm

    def _locate(self, key: str, d: TensorDesc) -> mmap.mmap | None:
        """The segment holding a described tensor (None for an empty one), checked to hold all of it."""
        if not d.nbytes:
            return None
        segment = self._segment(d.segment)
        if d.offset + d.nbytes > len(segment):
            raise ValueError(f"tensor {key!r} lies outside segment {d.segment}")
        return segment

    def read(self, descs: dict[str, TensorDesc]) -> dict[str, torch.Tensor]:
        """Copies of the described tensors: they stay valid after the writer reuses its segment."""
        out = {}
        for key, d in descs.items():
            segment = self._locate(key, d)
            out[key] = _empty(list(d.shape), d.torch_dtype, d.nbytes)
            if segment is not None:
                ctypes.memmove(out[key].data_ptr(), _address(segment) + d.offset, d.nbytes)
        return out

    def view(self, descs: dict[str, TensorDesc]) -> dict[str, torch.Tensor]:
        """The described tensors as views of the segment, without copying. Valid only until the writer
        reuses its segment: rank 0 reads its inputs this way, because the client writes again only after
        it has the reply. An op that keeps an input past its call must clone it."""
        out = {}
        for key, d in descs.items():
            segment = self._locate(key, d)
            if segment is not None:
                raw = torch.frombuffer(segment, dtype=torch.uint8, count=d.nbytes, offset=d.offset)
                out[key] = raw.view(d.torch_dtype).reshape(d.shape)
            else:
                out[key] = torch.empty(d.shape, dtype=d.torch_dtype)
        return out

    def close(self) -> None:
        # Dropped, not closed: a view handed out by ``view`` holds the mapping and keeps it valid.
        self._name, self._mm = None, None


def shm_free_bytes() -> int:
    """Free space in /dev/shm, where the arena's segments live."""
    stats = os.statvfs(SHM_DIR)
    return stats.f_bavail * stats.f_frsize


class SharedMemoryFull(OSError):
    """/dev/shm has no room for a segment; the message says how much was needed, what is free and the fix."""

    def __init__(self, needed: int):
        super().__init__(
            errno.ENOSPC,
            f"{SHM_DIR} has no room for a {needed / 2**20:.0f} MiB shared-memory segment "
            f"({shm_free_bytes() / 2**20:.0f} MiB free). Give it more room (Docker: "
            "--shm-size=8g or more; Linux: mount -o remount,size=16G /dev/shm), or make "
            "the batch or the image smaller",
        )
        self.needed = needed


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
