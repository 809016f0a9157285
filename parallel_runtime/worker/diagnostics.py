"""Built-in diagnostic ops: what ``comfy-parallel doctor``, the status panel and the runtime's own tests exercise; and
a rank's device memory: what it has, what it held at its peak, and the flush after each stage."""

from __future__ import annotations

import gc
import itertools
import os
import socket
import time

import torch
import torch.distributed as dist

from ..wire import (
    AllreduceArgs,
    AllreduceResult,
    ArmFaultArgs,
    ArmFaultResult,
    EchoArgs,
    EchoResult,
    FailArgs,
    FailMode,
    FailResult,
    Memory,
    OutputArgs,
    OutputResult,
    PeerCopy,
    PeersArgs,
    PeersResult,
    RankStatus,
    StatusArgs,
    StepsArgs,
    StepsResult,
)
from .ops import OpContext, OpResult, op


def device_label(device: torch.device) -> str:
    """A device as the user knows it: "GPU 3" by nvidia-smi's number where the launcher chose the GPUs by number
    (PCI bus order), else torch's own index; "CPU"."""
    if device.type != "cuda":
        return "CPU"
    index = torch.cuda.current_device() if device.index is None else device.index
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" and index < len(visible) and visible[index].isdigit():
        return f"GPU {visible[index]}"
    return f"GPU {index}"


def _process_status(key: str) -> int:
    """A size from /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def memory_of(device: torch.device) -> Memory:
    """A device's memory: the GPU's, or on CPU the machine's and this rank's own RSS; with the peak since the last
    ``reset_peak``."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Memory(
            kind="cuda",
            total_bytes=total,
            free_bytes=free,
            allocated_bytes=torch.cuda.memory_allocated(device),
            peak_bytes=torch.cuda.max_memory_allocated(device),
        )
    meminfo = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            meminfo[key] = int(value.split()[0]) * 1024
    return Memory(
        kind="cpu",
        total_bytes=meminfo["MemTotal"],
        free_bytes=meminfo["MemAvailable"],
        process_rss_bytes=_process_status("VmRSS"),
        peak_bytes=_process_status("VmHWM"),
    )


def reset_peak(device: torch.device) -> None:
    """Start counting this rank's peak memory afresh: torch's on a GPU; on the CPU the process's peak RSS (writing 5
    to /proc/self/clear_refs resets VmHWM, Linux 4.0 and later)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # an older kernel, or a sandbox that hides it: the peak then counts from the start
        pass


def flush(device: torch.device, everything: bool = False, freeze: bool = False) -> None:
    """Give back what the last stage left: Python's cycles first, then the blocks torch's CUDA allocator keeps cached,
    so ComfyUI and the next stage see them free.

    A full collection walks every object of the process: half a second for the 500 000 that diffusers and
    transformers bring. So after a stage that went well (``freeze``), what survives is frozen out of the collector's
    sight (``gc.freeze``) and the next flush walks only what came since, in milliseconds. Never after a failure: the
    error in flight and the frames it holds (a failed load's half-built weights) would be frozen with it and never
    collected. Frozen objects that become garbage (a freed model's modules, which hold each other in cycles) are
    collected only once unfrozen: ``everything`` does that, for a flush after dropping a model; the next stage that
    goes well freezes the rest again."""
    if everything:
        gc.unfreeze()
    gc.collect()
    if freeze:
        gc.freeze()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gpu_uuids() -> tuple[str, ...]:
    """The GPUs this rank sees, by UUID."""
    if not torch.cuda.is_available():
        return ()
    return tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))


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
        gpus=gpu_uuids(),
        last_cache=ctx.state.get("last_cache"),
        last_passes=ctx.state.get("last_passes"),
    ), {}


@op(AllreduceArgs, spmd=True)
def allreduce(ctx: OpContext, args: AllreduceArgs, tensors: dict) -> OpResult:
    x = tensors["x"].to(ctx.device) * (ctx.rank + 1)
    dist.all_reduce(x)
    return AllreduceResult(expected_factor=ctx.world_size * (ctx.world_size + 1) // 2), {"x": x.cpu()}


def _pattern(nbytes: int, source: int, target: int, device: torch.device) -> torch.Tensor:
    """A pair's own bytes (a wrong pair's or a zeroed buffer never matches)."""
    return ((torch.arange(nbytes // 4, dtype=torch.int32) * 7 + source * 131 + target * 17) % 65521).to(device)


def _peer_copy(nbytes: int, source: int, target: int) -> PeerCopy:
    """Rank 0 copies between two of its GPUs (the device_map path: activations move GPU to GPU in one process)."""
    expected = _pattern(nbytes, source, target, torch.device("cpu"))
    sent = expected.to(f"cuda:{source}")
    torch.cuda.synchronize(source)
    t0 = time.perf_counter()
    got = sent.to(f"cuda:{target}")
    torch.cuda.synchronize(target)
    seconds = time.perf_counter() - t0
    ok = torch.equal(got.cpu(), expected)
    return PeerCopy(
        source, target, "copy", ok, seconds, nbytes, torch.cuda.can_device_access_peer(source, target),
        "" if ok else "the copy arrived with different bytes",
    )  # fmt: skip


def _peer_exchange(ctx: OpContext, nbytes: int, source: int, target: int) -> PeerCopy | None:
    """Ranks ``source`` and ``target`` send each other a pattern and check what arrives (NCCL's peer-to-peer path
    on GPUs); the other ranks skip the pair. The source's account, None elsewhere."""
    if ctx.rank not in (source, target):
        return None
    peer = target if ctx.rank == source else source
    outgoing = _pattern(nbytes, ctx.rank, peer, ctx.device)
    incoming = torch.zeros_like(outgoing)
    t0 = time.perf_counter()
    if ctx.rank == source:
        dist.send(outgoing, peer)
        dist.recv(incoming, peer)
    else:
        dist.recv(incoming, peer)
        dist.send(outgoing, peer)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    seconds = time.perf_counter() - t0
    ok = torch.equal(incoming.cpu(), _pattern(nbytes, peer, ctx.rank, torch.device("cpu")))
    # Both ends must know: the source reports, so it needs the target's verdict too.
    verdict = torch.tensor([int(ok)], dtype=torch.int32)
    if ctx.rank == source:
        dist.recv(verdict, peer)
        ok = ok and bool(verdict.item())
    else:
        dist.send(verdict, peer)
        return None
    return PeerCopy(source, target, "collective", ok, seconds, 2 * nbytes, error="" if ok else "wrong bytes arrived")


@op(PeersArgs, spmd=True)
def peers(ctx: OpContext, args: PeersArgs, tensors: dict) -> OpResult:
    """Every pair of ranks exchanges a pattern, one pair at a time (the others wait on the CPU group, so a pair that
    hangs is the last one rank 0 announced); then rank 0 copies between every pair of its GPUs."""
    found = []
    for source, target in itertools.combinations(range(ctx.world_size), 2):
        ctx.progress(0, 1, f"peer check: ranks {source} and {target}")
        pair = _peer_exchange(ctx, args.nbytes, source, target)
        if pair is not None:
            found.append(pair)
        dist.all_reduce(torch.zeros(1))  # a CPU tensor: the gloo group, whatever NCCL is doing
    if ctx.rank == 0 and ctx.device.type == "cuda":
        for source, target in itertools.permutations(range(torch.cuda.device_count()), 2):
            ctx.progress(0, 1, f"peer check: GPU {source} to GPU {target} in one process")
            found.append(_peer_copy(args.nbytes, source, target))
    return PeersResult(tuple(found)), {}


@op(ArmFaultArgs, spmd=True, testing=True)
def arm_fault(ctx: OpContext, args: ArmFaultArgs, tensors: dict) -> OpResult:
    """Arm ``args.fault`` for the next transformer load on rank ``args.rank`` (stages.py springs it)."""
    if ctx.rank == args.rank:
        ctx.state["fault"] = args.fault
    return ArmFaultResult(), {}


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
