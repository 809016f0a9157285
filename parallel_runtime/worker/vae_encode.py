"""The VAE encode op (VAEEncodeSingleGPU): IMAGE pixels to a LATENT with the model's VAE on one device, a rank-0
stage like the decode (stages.py), sharing its resident VAE."""

from __future__ import annotations

import json
import os

import torch

from ..arena import DTYPES
from ..families import family
from ..wire import VaeEncodeArgs, VaeEncodeResult
from . import memory
from .models import ModelKey
from .ops import OpContext, OpError, OpResult, op


@op(VaeEncodeArgs, spmd=True)
def vae_encode(ctx: OpContext, args: VaeEncodeArgs, tensors: dict) -> OpResult:
    # The decode's key: one resident VAE serves both directions.
    key = ModelKey(args.model.name, "vae", args.device, args.dtype.value)
    models = ctx.state["models"]
    if ctx.rank != 0:
        models.make_room(key)
        return None, {}
    ctx.alone()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise OpError(f"device: {args.device} was asked for, but the backend has no GPU; use cpu or auto")
    adapter, dtype, pixels = family(args.model.family), DTYPES[args.dtype.value], tensors["pixels"]
    with open(os.path.join(args.model.path, "vae", "config.json")) as f:
        memory.check_encode(adapter, json.load(f), pixels, dtype, torch.device(args.device))
    ctx.progress(0, 1, "loading VAE")
    vae = models.get(key, lambda: adapter.load_vae(args.model.path, dtype, args.device))
    ctx.progress(0, 1, "encoding")
    samples = adapter.encode_image(vae, pixels)
    ctx.progress(1, 1, "encoded")
    return VaeEncodeResult(tuple(samples.shape)), {"samples": samples}
