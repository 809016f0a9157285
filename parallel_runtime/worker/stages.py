"""The image-generation ops: encode, denoise, decode, free. Family-agnostic; the family adapters
(families/<name>.py) know each pipeline.

Every op runs on every rank, so resident models change on all ranks together. Encode, decode and the
``device_map`` transformer are rank-0 stages: one process places a component across several GPUs (balanced
text encoders, ``auto`` transformer, single-device VAE) while the other ranks only free what the stage
replaces. Context, tensor and data parallel denoising run on every rank (see strategies.py).
"""
from __future__ import annotations

import functools
import importlib
import json
import os
from types import ModuleType

import torch

from ..arena import DTYPES
from ..model_folders import PIPELINES
from . import strategies
from .models import ModelKey, ResidentModels
from .ops import OpContext, OpError, op


def family_of(model_dir: str) -> ModuleType:
    with open(os.path.join(model_dir, "model_index.json")) as f:
        class_name = json.load(f)["_class_name"]
    if class_name not in PIPELINES:
        raise OpError(f"{model_dir}: pipeline {class_name} is not supported; supported: {sorted(PIPELINES)}")
    return importlib.import_module(f".families.{PIPELINES[class_name][0]}", __package__)


def _models(ctx: OpContext) -> ResidentModels:
    return ctx.state["models"]


def _placement(ctx: OpContext, device_map: str | None, max_memory: dict | None) -> tuple[dict, str]:
    """The adapter's placement dict and its short description for the resident-model key."""
    max_memory = {int(k) if str(k).isdigit() else k: v for k, v in (max_memory or {}).items()} or None
    placement = {"device": str(ctx.device), "device_map": device_map, "max_memory": max_memory}
    if ctx.device.type == "cpu" or device_map is None:
        return placement, str(ctx.device)
    budget = ",".join(f"{k}:{v}" for k, v in (max_memory or {}).items())
    return placement, f"device_map={device_map}" + (f"[{budget}]" if budget else "")


def _on_step(ctx: OpContext):
    def on_step(step_index: int, total: int) -> None:
        ctx.progress(step_index + 1, total)
        ctx.check_cancel(step_index + 1)

    return on_step


@op("encode", spmd=True)
def encode(ctx: OpContext, args: dict, tensors: dict):
    model_dir, dtype = args["model_dir"], args["dtype"]
    placement, where = _placement(ctx, "balanced", args.get("max_memory"))
    key = ModelKey(args["model"], "text_encoders", where, dtype)
    if ctx.rank != 0:
        _models(ctx).make_room(key, policy=args["memory_policy"])
        return None, {}
    ctx.alone()
    family = family_of(model_dir)
    ctx.progress(0, 2, "loading text encoders")
    pipe = _models(ctx).get(key, lambda: family.load_text_encoders(model_dir, DTYPES[dtype], placement),
                            policy=args["memory_policy"])
    ctx.progress(1, 2, "encoding")
    embeds = family.encode(pipe, args["prompts"], args.get("prompts_2"), args["max_sequence_length"],
                           **_family_options(args, "negative_prompt"))
    ctx.progress(2, 2, "encoded")
    return {"shapes": {k: list(v.shape) for k, v in embeds.items()}}, embeds


def _family_options(args: dict, *names: str) -> dict:
    """Keyword arguments only some families take (Qwen-Image's true CFG); the client sends them only to those."""
    return {name: args[name] for name in names if name in args}


def _sampling_args(args: dict) -> dict:
    return {"steps": args["steps"], "guidance_scale": args["guidance_scale"], "width": args["width"],
            "height": args["height"], **_family_options(args, "true_cfg_scale")}


@op("denoise", spmd=True)
def denoise(ctx: OpContext, args: dict, tensors: dict):
    model_dir, dtype, strategy = args["model_dir"], args["dtype"], args["strategy"]
    family = family_of(model_dir)
    models = _models(ctx)
    if strategy["kind"] == "device_map":  # a rank-0 stage
        placement, where = _placement(ctx, "auto", args.get("max_memory"))
        key = ModelKey(args["model"], "transformer", where, dtype)
        if ctx.rank != 0:
            models.make_room(key, policy=args["memory_policy"])
            return None, {}
        ctx.alone()
        load = functools.partial(family.load_transformer, model_dir, DTYPES[dtype], placement)
    else:  # context / tensor / data parallel: every rank loads its part together
        key = ModelKey(args["model"], "transformer", strategies.describe(strategy), dtype)
        load = functools.partial(strategies.load_transformer, model_dir, DTYPES[dtype], ctx.device, strategy)
    ctx.progress(0, args["steps"], "loading transformer")
    transformer = models.get(key, load, policy=args["memory_policy"])

    # Data parallelism gives each rank a consecutive slice of the images; otherwise every rank (CP / TP) or rank 0
    # alone (device_map) runs the whole batch on identical inputs.
    batch_size, data_parallel = args["batch_size"], strategy["kind"] == "data_parallel"
    start, count = strategies.share(batch_size, ctx.rank, ctx.world_size) if data_parallel else (0, batch_size)
    samples = family.denoise(model_dir, transformer, strategies.slice_batch(tensors, batch_size, start, count),
                             seed=args["seed"] + start, batch_size=count, on_step=_on_step(ctx), **_sampling_args(args))
    if data_parallel:
        samples = strategies.gather_batch(samples, batch_size, ctx.world_size)
    if ctx.rank != 0:
        return None, {}
    ctx.progress(args["steps"], args["steps"], "denoised")
    return {"shape": list(samples.shape)}, {"samples": samples}


@op("decode", spmd=True)
def decode(ctx: OpContext, args: dict, tensors: dict):
    model_dir, dtype = args["model_dir"], args["dtype"]
    device = args.get("device") or str(ctx.device)
    key = ModelKey(args["model"], "vae", device, dtype)
    if ctx.rank != 0:
        _models(ctx).make_room(key, policy=args["memory_policy"])
        return None, {}
    ctx.alone()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise OpError(f"device: {device} was asked for, but the backend has no GPU; use cpu or auto")
    family = family_of(model_dir)
    ctx.progress(0, 1, "loading VAE")
    vae = _models(ctx).get(key, lambda: family.load_vae(model_dir, DTYPES[dtype], device), policy=args["memory_policy"])
    ctx.progress(0, 1, "decoding")
    images = family.decode(vae, tensors["samples"])
    ctx.progress(1, 1, "decoded")
    return {"shape": list(images.shape)}, {"images": images}


@op("free", spmd=True)
def free(ctx: OpContext, args: dict, tensors: dict):
    """Free resident models (``components``, or all) on every rank, e.g. before ComfyUI's own nodes need the GPUs."""
    components = args.get("components")
    return {"freed": _models(ctx).free(*components) if components else _models(ctx).free_all()}, {}
