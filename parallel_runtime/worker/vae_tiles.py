"""VAE decode over the ranks (VAEDecodeSingleGPU's ``decode_over_ranks``): diffusers' own tiled decode
(``enable_tiling()``: overlapping tiles, blended), with the tiles decoded on different ranks and joined on rank 0.

The tiling, the blending and the crop stay diffusers' own code: every rank runs the VAE's ``decode`` with tiling on
and its ``decoder`` wrapped. The wrapper counts the decoder's calls (one per tile, in diffusers' order); rank r runs
the real decoder for calls r, r + ranks, ... and hands back zeros of the tile's decoded shape for the others, so the
loop goes on without the work. The decoded tiles then travel to rank 0, which runs ``decode`` once more with the
wrapper handing back the decoded tiles in the same order: the image is diffusers' tiled decode, each tile decoded
once, and only rank 0 ever holds more than one rank's share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class _TileDecoder(torch.nn.Module):
    """Stands in for the VAE's ``decoder`` during one decode; ``answer(call, tile, args, kwargs)`` gives call
    ``call``'s decoded tile. It holds the real decoder as its child, because a VAE may size per-tile state by the
    decoder's layers (Qwen-Image's counts its causal convolutions for its feature cache)."""

    def __init__(self, real: torch.nn.Module, answer: Callable[[int, torch.Tensor, tuple, dict], torch.Tensor]) -> None:
        super().__init__()
        self.real, self.answer, self.calls = real, answer, 0

    def forward(self, tile: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self.answer(self.calls - 1, tile, args, kwargs)


def _decoded_shape(vae: torch.nn.Module, tile: torch.Tensor) -> tuple[int, ...]:
    """A tile's decoded shape: RGB, the VAE's spatial upscale on the last two axes (frames and batch unchanged)."""
    scale = getattr(vae, "spatial_compression_ratio", None) or 2 ** (len(vae.config.block_out_channels) - 1)
    return (tile.shape[0], 3, *tile.shape[2:-2], tile.shape[-2] * scale, tile.shape[-1] * scale)


def _decode_with(vae: torch.nn.Module, decode: Callable[[], torch.Tensor], stand_in: _TileDecoder) -> torch.Tensor:
    decoder, tiling = vae.decoder, vae.use_tiling
    vae.decoder, vae.use_tiling = stand_in, True
    try:
        return decode()
    finally:
        vae.decoder, vae.use_tiling = decoder, tiling


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int:
    """The device memory this rank's tensors held at most since ``reset_peak`` (CUDA; 0 elsewhere)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def decode_over_ranks(
    vae: torch.nn.Module, decode: Callable[[], torch.Tensor], rank: int, world_size: int
) -> tuple[torch.Tensor | None, tuple[int, ...], tuple[int, ...]]:
    """``decode()`` (the family's decode of the whole batch with ``vae``) as diffusers' tiled decode, its tiles shared
    over the ranks (collective). Rank 0 gets the images, how many tiles each rank decoded and each rank's peak device
    memory during the decode (CUDA; empty elsewhere); the others get None for the images."""
    real = vae.decoder
    reset_peak(vae.device)
    mine: list[torch.Tensor] = []
    shapes: list[tuple[int, ...]] = []

    def share(call: int, tile: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        shape = _decoded_shape(vae, tile)
        shapes.append(shape)
        if call % world_size != rank:
            return tile.new_zeros(shape)
        decoded = real(tile, *args, **kwargs)
        if tuple(decoded.shape) != shape:
            raise RuntimeError(
                f"decode_over_ranks: {type(vae).__name__} decoded a {list(tile.shape)} tile to "
                f"{list(decoded.shape)}, not {list(shape)}; decode this VAE with decode_over_ranks off"
            )
        # A copy: diffusers blends each tile into its neighbours in place, here with the stand-ins' zeros.
        mine.append(decoded.clone())
        return decoded

    _decode_with(vae, decode, _TileDecoder(real, share))
    tiles_per_rank = tuple(len(range(r, len(shapes), world_size)) for r in range(world_size))
    # One flat buffer per rank, padded to the longest, gathered on rank 0 (gloo gathers equal shapes only).
    sizes = [sum(torch.Size(shapes[k]).numel() for k in range(r, len(shapes), world_size)) for r in range(world_size)]
    flat = torch.zeros(max(sizes), dtype=vae.dtype)
    if mine:
        flat[: sizes[rank]] = torch.cat([t.reshape(-1).to("cpu", vae.dtype) for t in mine])
    gathered = [torch.empty_like(flat) for _ in range(world_size)] if rank == 0 else None
    dist.gather(flat, gathered, dst=0)
    peak = torch.tensor([peak_bytes(vae.device)], dtype=torch.int64)
    peaks = [torch.empty_like(peak) for _ in range(world_size)] if rank == 0 else None
    dist.gather(peak, peaks, dst=0)
    if rank != 0:
        return None, tiles_per_rank, ()
    offsets = [0] * world_size
    decoded: list[torch.Tensor] = []
    for call, shape in enumerate(shapes):
        owner, size = call % world_size, torch.Size(shape).numel()
        decoded.append(gathered[owner][offsets[owner] : offsets[owner] + size].view(shape))
        offsets[owner] += size

    def replay(call: int, tile: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        return decoded[call].to(tile.device)

    images = _decode_with(vae, decode, _TileDecoder(real, replay))
    if vae.device.type != "cuda":
        return images, tiles_per_rank, ()
    # Rank 0's peak counts the join too: every decoded tile and the blended image at once.
    return images, tiles_per_rank, (peak_bytes(vae.device), *(int(p) for p in peaks[1:]))
