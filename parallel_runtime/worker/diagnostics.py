"""Built-in diagnostic ops: what ``comfy-parallel doctor``, the status panel and the runtime's own tests exercise."""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

from ..wire import (
    AllreduceArgs,
    AllreduceResult,
    EchoArgs,
    EchoResult,
    FailArgs,
    FailMode,
    FailResult,
    Memory,
    OutputArgs,
    OutputResult,
    RankStatus,
    StatusArgs,
    StepsArgs,
    StepsResult,
)
from .ops import OpContext, OpResult, op


def memory_of(device: torch.device) -> Memory:
    """A device's memory: the GPU's, or on CPU the machine's and this rank's own RSS."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Memory(
            kind="cuda", total_bytes=total, free_bytes=free, allocated_bytes=torch.cuda.memory_allocated(device)
        )
    meminfo = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            meminfo[key] = int(value.split()[0]) * 1024
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return Memory(
        kind="cpu", total_bytes=meminfo["MemTotal"], free_bytes=meminfo["MemAvailable"], process_rss_bytes=rss
    )


@op(StatusArgs, spmd=True)
def status(ctx: OpContext, args: StatusArgs, tensors: dict) -> OpResult:
    models = ctx.state["models"]
    return RankStatus(
        rank=ctx.rank,
        local_rank=ctx.local_rank,
        world_size=ctx.world_size,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        device=str(ctx.device),
        device_name=torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        memory=memory_of(ctx.device),
        resident=models.describe(),
        load_counts=models.load_counts(),
        torch=torch.__version__,
        last_cache=ctx.state.get("last_cache"),
        last_passes=ctx.state.get("last_passes"),
    ), {}


@op(AllreduceArgs, spmd=True)
def allreduce(ctx: OpContext, args: AllreduceArgs, tensors: dict) -> OpResult:
    x = tensors["x"].to(ctx.device) * (ctx.rank + 1)
    dist.all_reduce(x)
    return AllreduceResult(expected_factor=ctx.world_size * (ctx.world_size + 1) // 2), {"x": x.cpu()}


@op(EchoArgs, spmd=False)
def echo(ctx: OpContext, args: EchoArgs, tensors: dict) -> OpResult:
    return EchoResult(count=len(tensors)), dict(tensors)


@op(StepsArgs, spmd=True)
def steps(ctx: OpContext, args: StepsArgs, tensors: dict) -> OpResult:
    for i in range(args.steps):
        ctx.check_cancel(i)
        time.sleep(args.seconds_per_step)
        if ctx.world_size > 1:
            dist.barrier()  # keep ranks in lock-step like a real CP/TP step would
        ctx.progress(i + 1, args.steps)
    return StepsResult(completed=args.steps), {}


@op(FailArgs, spmd=True, testing=True)
def fail(ctx: OpContext, args: FailArgs, tensors: dict) -> OpResult:
    """Fails on purpose on one rank (``FailMode`` says how), to drill error reporting and the watchdog."""
    if ctx.rank == args.rank:
        if args.how is FailMode.EXIT:
            os._exit(3)
        if args.how in (FailMode.HANG, FailMode.HANG_SILENT):
            if args.how is FailMode.HANG_SILENT:
                ctx.state["heartbeat"].stop()
            while True:
                time.sleep(3600)
        if args.how is FailMode.EXHAUST_MEMORY:
            hoard = []
            while True:  # 64 MiB at a time, every page touched, until the kernel (or a cgroup limit) says no
                hoard.append(torch.ones(16 << 20, dtype=torch.float32))
        raise RuntimeError(f"deliberate failure on rank {args.rank}")
    if args.how in (FailMode.RAISE_BEFORE_COLLECTIVE, FailMode.HANG, FailMode.HANG_SILENT) and ctx.world_size > 1:
        dist.barrier()
    return FailResult(), {}


@op(OutputArgs, spmd=False, testing=True)
def output(ctx: OpContext, args: OutputArgs, tensors: dict) -> OpResult:
    return OutputResult(args.nbytes), {"zeros": torch.zeros(args.nbytes, dtype=torch.uint8)}
