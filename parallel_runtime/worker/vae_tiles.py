"""VAE decode over the ranks (VAEDecodeSingleGPU's ``decode_over_ranks``): diffusers' own tiled decode
(``enable_tiling()``: overlapping tiles, blended), with the tiles decoded on different ranks and joined on rank 0.

The tiling, the blending and the crop stay diffusers' own code: every rank runs the VAE's ``decode`` with tiling on
and its ``decoder`` wrapped. The wrapper counts the decoder's calls in diffusers' order and which tile each belongs
to: an image VAE calls it once per tile; a video VAE (Wan's) once per latent frame of a tile, each frame through the
causal cache the tile's earlier frames filled, so a tile's calls all run on one rank. Rank r runs the real decoder for
tiles r, r + ranks, ... (every frame of them) and hands back zeros of the chunk's decoded shape for the rest, so the
loop goes on without the work. The decoded chunks then travel to rank 0, which runs ``decode`` once more with the
wrapper handing them back in the same order: the image or clip is diffusers' tiled decode, each tile decoded once.

Everything the wrapper hands back lies on the CPU, where diffusers then joins and blends it: a rank's device holds
one chunk's decode at a time, never the clip (rank 0 holds the joined clip in host memory, as the IMAGE it returns).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..wire import Memory
from . import diagnostics


class _TileDecoder(torch.nn.Module):
    """Stands in for the VAE's ``decoder`` during one decode; ``answer(tile, first, chunk, args, kwargs)`` gives the
    decoded ``chunk``, which belongs to tile ``tile`` (counted from 0) and is its first chunk or not. A video VAE (one
    with a causal cache, Wan's and Qwen-Image's) decodes a tile latent frame by latent frame, every chunk through the
    cache its earlier chunks filled, and clears the cache at each tile's start: a tile is the calls between two
    clears. Another VAE's every call is a tile. It holds the real decoder as its child, because a VAE may size
    per-tile state by the decoder's layers (Qwen-Image's counts its causal convolutions for its feature cache)."""

    def __init__(self, real: torch.nn.Module, causal: bool, answer: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.real, self.causal, self.answer = real, causal, answer
        self.calls, self.tiles, self.fresh = 0, 0, True

    def cleared(self) -> None:
        self.fresh = True

    def forward(self, chunk: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        first = self.fresh
        self.tiles += first
        self.calls += 1
        self.fresh = not self.causal
        return self.answer(self.tiles - 1, first, chunk, args, kwargs)


def _decoded_shape(vae: torch.nn.Module, chunk: torch.Tensor, first: bool) -> tuple[int, ...]:
    """A chunk's decoded shape: the VAE's output channels; its spatial upscale on the last two axes (a patchified
    VAE's, Wan 2.2's, up to the patches' grid: it unpatchifies after the blend); a video VAE's temporal upscale on the
    frames (a tile's first chunk keeps its first frame alone); the batch unchanged."""
    config = vae.config
    patch = config.get("patch_size") or 1
    scale = getattr(vae, "spatial_compression_ratio", None) or 2 ** (len(config.block_out_channels) - 1)
    spatial = (chunk.shape[-2] * scale // patch, chunk.shape[-1] * scale // patch)
    if chunk.ndim == 4:  # an image VAE's tile: [B, C, h, w]
        return (chunk.shape[0], config.get("out_channels", 3), *spatial)
    frames, factor = chunk.shape[2], 2 ** sum(config.get("temperal_downsample") or ())
    frames = 1 + (frames - 1) * factor if first else frames * factor
    return (chunk.shape[0], config.get("out_channels", 3), frames, *spatial)


def _decode_with(vae: torch.nn.Module, decode: Callable[[], torch.Tensor], stand_in: _TileDecoder) -> torch.Tensor:
    decoder, tiling = vae.decoder, vae.use_tiling
    vae.decoder, vae.use_tiling = stand_in, True
    if stand_in.causal:
        clear = vae.clear_cache

        def clear_cache() -> None:
            clear()
            stand_in.cleared()

        vae.clear_cache = clear_cache
    try:
        return decode()
    finally:
        vae.decoder, vae.use_tiling = decoder, tiling
        if stand_in.causal:
            del vae.clear_cache  # the class's method again


def reset_peak(device: torch.device) -> int:
    """Start counting a decode's peak memory afresh (``diagnostics.reset_peak``); what the rank holds now, which
    ``peak_above`` subtracts: torch's allocated GPU memory, or on the CPU the rank's resident set. On the CPU the heap
    is trimmed first: a CPU rank's glibc keeps freed pages resident (launcher.py raises its trim threshold), and a
    decode that reused them would take memory without the resident set growing."""
    if device.type == "cpu":
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: its resident set has no kept pages to give back
            pass
    diagnostics.reset_peak(device)
    return _held(diagnostics.memory_of(device))


def peak_above(device: torch.device, held: int) -> int:
    """The most memory the rank held since ``reset_peak`` above the ``held`` it returned: what the decode itself took
    (its activations and tiles, not the VAE's weights loaded before it)."""
    return max(0, (diagnostics.memory_of(device).peak_bytes or 0) - held)


def _held(memory: Memory) -> int:
    return (memory.allocated_bytes if memory.kind == "cuda" else memory.process_rss_bytes) or 0


def decode_over_ranks(
    vae: torch.nn.Module, decode: Callable[[], torch.Tensor], rank: int, world_size: int
) -> tuple[torch.Tensor | None, tuple[int, ...], tuple[int, ...]]:
    """``decode()`` (the family's decode of the whole batch with ``vae``) as diffusers' tiled decode, its tiles shared
    over the ranks (collective). Rank 0 gets the images, how many tiles each rank decoded and each rank's peak memory
    above what it held before the decode (``peak_above``); the others get None for the images."""
    real, causal = vae.decoder, callable(getattr(vae, "clear_cache", None))
    held = reset_peak(vae.device)
    mine: list[torch.Tensor] = []
    shapes: list[tuple[int, ...]] = []
    owners: list[int] = []

    def share(tile: int, first: bool, chunk: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        shape = _decoded_shape(vae, chunk, first)
        shapes.append(shape)
        owners.append(tile % world_size)
        if owners[-1] == rank:
            decoded = real(chunk, *args, **kwargs)
            if tuple(decoded.shape) != shape:
                raise RuntimeError(
                    f"decode_over_ranks: {type(vae).__name__} decoded a {list(chunk.shape)} chunk to "
                    f"{list(decoded.shape)}, not {list(shape)}; decode this VAE with decode_over_ranks off"
                )
            mine.append(decoded.to("cpu"))
        # Zeros on the CPU, also for this rank's own chunks: this pass only decodes them; diffusers joins and blends
        # what the decoder gives where it lies, so the device never holds more than one chunk's decode.
        return torch.zeros(shape, dtype=vae.dtype)

    first_pass = _TileDecoder(real, causal, share)
    _decode_with(vae, decode, first_pass)
    tiles_per_rank = tuple(len(range(r, first_pass.tiles, world_size)) for r in range(world_size))
    # One flat buffer per rank, padded to the longest, gathered on rank 0 (gloo gathers equal shapes only).
    sizes = [0] * world_size
    for owner, shape in zip(owners, shapes):
        sizes[owner] += torch.Size(shape).numel()
    flat = torch.zeros(max(sizes), dtype=vae.dtype)
    if mine:
        flat[: sizes[rank]] = torch.cat([t.reshape(-1) for t in mine])
    mine.clear()
    gathered = [torch.empty_like(flat) for _ in range(world_size)] if rank == 0 else None
    dist.gather(flat, gathered, dst=0)
    peak = torch.tensor([peak_above(vae.device, held)], dtype=torch.int64)
    peaks = [torch.empty_like(peak) for _ in range(world_size)] if rank == 0 else None
    dist.gather(peak, peaks, dst=0)
    if rank != 0:
        return None, tiles_per_rank, ()
    offsets = [0] * world_size
    decoded: list[torch.Tensor] = []
    for owner, shape in zip(owners, shapes):
        size = torch.Size(shape).numel()
        decoded.append(gathered[owner][offsets[owner] : offsets[owner] + size].view(shape))
        offsets[owner] += size

    def replay(tile: int, first: bool, chunk: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        return decoded[replaying.calls - 1]

    replaying = _TileDecoder(real, causal, replay)
    images = _decode_with(vae, decode, replaying)
    # On the CPU, rank 0's peak counts the join too: every decoded chunk and the blended clip at once.
    return images, tiles_per_rank, (peak_above(vae.device, held), *(int(p) for p in peaks[1:]))
