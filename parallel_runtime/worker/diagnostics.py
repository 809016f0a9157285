"""Built-in diagnostic ops: what ``comfy-parallel doctor`` and the runtime's own tests exercise."""
from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

from .ops import OpContext, OpError, op


def _memory(device: torch.device) -> dict:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"kind": "cuda", "total_bytes": total, "free_bytes": free,
                "allocated_bytes": torch.cuda.memory_allocated(device)}
    meminfo = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            meminfo[key] = int(value.split()[0]) * 1024
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"kind": "cpu", "total_bytes": meminfo["MemTotal"], "free_bytes": meminfo["MemAvailable"],
            "process_rss_bytes": rss}


@op("status", spmd=True)
def status(ctx: OpContext, args: dict, tensors: dict):
    models = ctx.state.get("models")
    return {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "world_size": ctx.world_size,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(ctx.device),
        "device_name": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "memory": _memory(ctx.device),
        "resident": models.describe() if models is not None else [],
        "load_counts": models.load_counts() if models is not None else {},
        "torch": torch.__version__,
    }, {}


@op("allreduce", spmd=True)
def allreduce(ctx: OpContext, args: dict, tensors: dict):
    """Each rank contributes ``x * (rank + 1)``; the sum proves every rank took part exactly once."""
    x = tensors["x"].to(ctx.device) * (ctx.rank + 1)
    dist.all_reduce(x)
    return {"expected_factor": ctx.world_size * (ctx.world_size + 1) // 2}, {"x": x.cpu()}


@op("echo", spmd=False)
def echo(ctx: OpContext, args: dict, tensors: dict):
    """Returns its input tensors: an arena round trip."""
    return {"count": len(tensors)}, dict(tensors)


@op("steps", spmd=True)
def steps(ctx: OpContext, args: dict, tensors: dict):
    """A stand-in for a denoising loop: ``steps`` steps of ``seconds_per_step`` with progress and cancel."""
    total = int(args.get("steps", 10))
    delay = float(args.get("seconds_per_step", 0.05))
    for i in range(total):
        ctx.check_cancel(i)
        time.sleep(delay)
        if ctx.world_size > 1:
            dist.barrier()  # keep ranks in lock-step like a real CP/TP step would
        ctx.progress(i + 1, total)
    return {"completed": total}, {}


@op("fail", spmd=True)
def fail(ctx: OpContext, args: dict, tensors: dict):
    """Fails on purpose on one rank, to drill error reporting.

    ``how``: ``raise`` (every other rank finishes the op: the group stays usable), ``raise_before_collective``
    (the others wait in a collective the failing rank never joins: the group must be torn down),
    ``exit`` (the process dies).
    """
    target, how = int(args.get("rank", 0)), args.get("how", "raise")
    if how not in ("raise", "raise_before_collective", "exit"):
        raise OpError(f"fail: how must be raise, raise_before_collective or exit, not {how!r}")
    if ctx.rank == target:
        if how == "exit":
            os._exit(3)
        raise RuntimeError(f"deliberate failure on rank {target}")
    if how == "raise_before_collective" and ctx.world_size > 1:
        dist.barrier()
    return {}, {}
