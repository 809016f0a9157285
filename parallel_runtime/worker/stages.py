"""The image-generation ops: encode, denoise, decode, free. Family-agnostic: each op looks its family up in the
registry (by the key its arguments carry) and calls the family's stage.

Every op runs on every rank, so resident models change on all ranks together. Encode, decode and the ``device_map``
transformer are rank-0 stages: one process places a component across several GPUs (balanced text encoders, ``auto``
transformer, single-device VAE) while the other ranks only free what the stage replaces. Context, tensor and data
parallel denoising run on every rank (see strategies.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable

import torch

from ..arena import DTYPES
from ..families import Placement, family
from ..wire import DecodeArgs, DecodeResult, DenoiseArgs, DenoiseResult, EncodeArgs, EncodeResult, FreeArgs, FreeResult
from . import lora, memory, step_cache, strategies, vae_tiles
from .models import ModelKey, ResidentModels
from .ops import OpContext, OpError, OpResult, WidgetError, op


def _models(ctx: OpContext) -> ResidentModels:
    return ctx.state["models"]


def _placement(ctx: OpContext, device_map: str, max_memory: dict[str, str] | None) -> tuple[Placement, str]:
    """Where a rank-0 stage's component goes, and its short description for the resident-model key."""
    budget = {int(k) if k.isdigit() else k: v for k, v in (max_memory or {}).items()} or None
    placement = Placement(device=str(ctx.device), device_map=device_map, max_memory=budget)
    if ctx.device.type == "cpu":
        return placement, str(ctx.device)
    shown = ",".join(f"{k}:{v}" for k, v in (max_memory or {}).items())
    return placement, f"device_map={device_map}" + (f"[{shown}]" if shown else "")


def _on_step(ctx: OpContext) -> Callable[[int, int], None]:
    def on_step(step_index: int, total: int) -> None:
        ctx.progress(step_index + 1, total)
        ctx.check_cancel(step_index + 1)

    return on_step


@op(EncodeArgs, spmd=True)
def encode(ctx: OpContext, args: EncodeArgs, tensors: dict) -> OpResult:
    placement, where = _placement(ctx, "balanced", args.max_memory)
    key = ModelKey(args.model.name, "text_encoders", where, args.dtype.value)
    if ctx.rank != 0:
        _models(ctx).make_room(key)
        return None, {}
    ctx.alone()
    adapter = family(args.model.family)
    ctx.progress(0, 2, "loading text encoders")
    pipe = _models(ctx).get(
        key, lambda: adapter.load_text_encoders(args.model.path, DTYPES[args.dtype.value], placement)
    )
    ctx.progress(1, 2, "encoding")
    embeds = adapter.encode(pipe, args.prompts)
    ctx.progress(2, 2, "encoded")
    return EncodeResult({k: tuple(v.shape) for k, v in embeds.items()}), embeds


@op(DenoiseArgs, spmd=True)
def denoise(ctx: OpContext, args: DenoiseArgs, tensors: dict) -> OpResult:
    spec, sampling = args.transformer, args.sampling
    adapter, plan, dtype = family(spec.model.family), spec.plan, DTYPES[spec.dtype.value]
    if plan.ranks != ctx.world_size:
        raise OpError(f"the strategy was planned for {plan.ranks} ranks, but this backend has {ctx.world_size}")
    models = _models(ctx)
    if not plan.spmd:  # device_map: a rank-0 stage
        placement, where = _placement(ctx, "auto", spec.max_memory)
        key = ModelKey(spec.model.name, "transformer", where, spec.dtype.value)
        if ctx.rank != 0:
            models.make_room(key)
            return None, {}
        ctx.alone()
        load = functools.partial(adapter.load_transformer, spec.model.path, dtype, placement)
    else:  # context / tensor / data parallel: every rank loads its part together
        key = ModelKey(spec.model.name, "transformer", plan.describe(), spec.dtype.value)
        load = functools.partial(
            strategies.load_transformer, adapter.transformer_class(), spec.model.path, dtype, ctx.device, plan
        )
    if plan.cfg_degree > 1 and not ((sampling.true_cfg_scale or 1) > 1 and "negative_prompt_embeds" in tensors):
        raise OpError("true_cfg_scale: cfg_parallel needs true CFG (true_cfg_scale > 1 and a negative prompt)")
    text_tokens = max(tensors[name].shape[1] for name in ("prompt_embeds", "negative_prompt_embeds") if name in tensors)
    refused = None
    try:
        memory.check_denoise(adapter, spec.model.path, plan, sampling, text_tokens, dtype, ctx.device,
                             local_ranks=ctx.local_world_size, loads_weights=not models.resident(key),
                             freed_by_load=models.freed_by_loading(key))  # fmt: skip
    except WidgetError as e:
        refused = e
    ctx.agree(refused)  # one rank short of memory: all refuse, before any of them loads
    ctx.progress(0, sampling.steps, "loading transformer")
    transformer = models.get(key, load)
    # The LoRAs are not part of the key: changing them changes the resident transformer, never reloads it.
    lora.apply_loras(ctx, transformer, spec, adapter)

    # Data parallelism gives each rank a consecutive slice of the images; otherwise every rank (CP / TP) or rank 0
    # alone (device_map) runs the whole batch on identical inputs.
    batch_size = sampling.batch_size
    start, count = strategies.share(batch_size, ctx.rank, ctx.world_size) if plan.splits_batch else (0, batch_size)
    mine = dataclasses.replace(sampling, seed=(sampling.seed + start) % 2**64, batch_size=count)
    group = step_cache.agreement_group(plan, transformer)
    with (
        step_cache.count_passes(transformer) as passes,
        step_cache.step_cache(transformer, spec.cache, group) as record,
    ):
        samples = adapter.denoise(
            spec.model.path,
            transformer,
            strategies.slice_batch(tensors, batch_size, start, count),
            mine,
            on_step=_on_step(ctx),
        )
    cache = ctx.state["last_cache"] = record.report() if record is not None else None
    ctx.state["last_passes"] = passes[0]
    if plan.splits_batch:
        samples = strategies.gather_batch(samples, batch_size, ctx.world_size)
    if ctx.rank != 0:
        return None, {}
    ctx.progress(sampling.steps, sampling.steps, "denoised")
    return DenoiseResult(tuple(samples.shape), cache=cache), {"samples": samples}


@op(DecodeArgs, spmd=True)
def decode(ctx: OpContext, args: DecodeArgs, tensors: dict) -> OpResult:
    if args.over_ranks:
        return _decode_over_ranks(ctx, args, tensors)
    key = ModelKey(args.model.name, "vae", args.device, args.dtype.value)
    if ctx.rank != 0:
        _models(ctx).make_room(key)
        return None, {}
    ctx.alone()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise OpError(f"device: {args.device} was asked for, but the backend has no GPU; use cpu or auto")
    adapter = family(args.model.family)
    with open(os.path.join(args.model.path, "vae", "config.json")) as f:
        memory.check_decode(
            adapter, json.load(f), tensors["samples"], DTYPES[args.dtype.value], torch.device(args.device)
        )
    ctx.progress(0, 1, "loading VAE")
    vae = _models(ctx).get(key, lambda: adapter.load_vae(args.model.path, DTYPES[args.dtype.value], args.device))
    ctx.progress(0, 1, "decoding")
    vae_tiles.reset_peak(vae.device)
    images = adapter.decode(vae, tensors["samples"])
    ctx.progress(1, 1, "decoded")
    peaks = (vae_tiles.peak_bytes(vae.device),) if vae.device.type == "cuda" else ()
    return DecodeResult(tuple(images.shape), peak_bytes_per_rank=peaks), {"images": images}


def _decode_over_ranks(ctx: OpContext, args: DecodeArgs, tensors: dict) -> OpResult:
    """Every rank loads the VAE on its own device and decodes its share of diffusers' tiles (see vae_tiles.py)."""
    adapter, dtype = family(args.model.family), DTYPES[args.dtype.value]
    key = ModelKey(args.model.name, "vae", str(ctx.device), args.dtype.value)
    ctx.progress(0, 1, "loading VAE")
    vae = _models(ctx).get(key, lambda: adapter.load_vae(args.model.path, dtype, str(ctx.device)))
    ctx.progress(0, 1, "decoding tiles over the ranks")
    images, tiles, peaks = vae_tiles.decode_over_ranks(
        vae, lambda: adapter.decode(vae, tensors["samples"]), ctx.rank, ctx.world_size
    )
    if ctx.rank != 0:
        return None, {}
    ctx.progress(1, 1, "decoded")
    return DecodeResult(tuple(images.shape), tiles_per_rank=tiles, peak_bytes_per_rank=peaks), {"images": images}


@op(FreeArgs, spmd=True)
def free(ctx: OpContext, args: FreeArgs, tensors: dict) -> OpResult:
    """Free resident models (``components``, or all) on every rank, e.g. before ComfyUI's own nodes need the GPUs."""
    models = _models(ctx)
    return FreeResult(tuple(models.free(*args.components) if args.components else models.free_all())), {}
