"""Unequal ranks: data parallelism's images shared by each rank's speed, and the devices a lock-step run waits for.

Data parallelism gives each rank whole images in proportion to its speed, so a faster GPU makes more of the batch and
all of them finish together. A rank's speed is what it measured in its last data-parallel run (image-steps per second
of its denoising loop); before any rank has measured one, ``RANK_SPEEDS_ENV`` may declare relative speeds ("1,0.5":
rank 0 twice as fast as rank 1). It is an environment variable, not a widget, because it describes the machine's GPUs,
not a workflow: a workflow saved with it would carry one box's speeds to another. Without either, the split is even.
The images do not depend on the split: image i always uses seed + i, wherever it is made.

Context and tensor parallelism run every step on every rank together, so the slowest device sets the pace: the ranks
tell each other their device's name, and the sampler's node says so when they differ.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from ..wire import RANK_SPEEDS_ENV, BatchSplit
from .ops import OpContext, OpError, test_ops_enabled

# Test-only: "RANK:SECONDS" makes that rank sleep SECONDS for each of its images at every denoising step, a slower GPU
# on CPU ranks (one that takes longer for every image it denoises, so fewer images make it finish sooner). Honoured only
# by a backend that serves the test ops (COMFY_PARALLEL_TEST_OPS=1), never by a production one.
SLOW_RANK_ENV = "COMFY_PARALLEL_TEST_SLOW_RANK"
_SPEED = "dp_speed"  # ctx.state: this rank's image-steps per second in its last data-parallel run
_NAME_BYTES = 64  # a device name's bytes in the all-gather (gloo gathers fixed shapes)


def shares(batch_size: int, speeds: list[float]) -> list[int]:
    """Each rank's count of images, as near ``speeds``' proportions as whole images allow, and at least one each
    (every rank runs every step's collectives; the sampler refuses fewer images than ranks). The same on every rank,
    which all hold the same speeds: ties go to the lower rank."""
    total = sum(speeds)
    ideal = [batch_size * s / total for s in speeds]
    counts = [max(1, int(x)) for x in ideal]
    ranks = range(len(speeds))
    while sum(counts) < batch_size:
        counts[max(ranks, key=lambda r: (ideal[r] - counts[r], -r))] += 1
    while sum(counts) > batch_size:
        counts[min((r for r in ranks if counts[r] > 1), key=lambda r: (ideal[r] - counts[r], -r))] -= 1
    return counts


def _declared(world_size: int) -> list[float]:
    """The speeds ``RANK_SPEEDS_ENV`` declares, one per rank; [] when it is unset."""
    text = os.environ.get(RANK_SPEEDS_ENV, "").strip()
    if not text:
        return []
    try:
        speeds = [float(v) for v in text.split(",")]
    except ValueError:
        speeds = []
    if len(speeds) != world_size or not all(s > 0 for s in speeds):
        raise OpError(f"{RANK_SPEEDS_ENV}={text!r}: give one positive speed per rank ({world_size}), e.g. '1,0.5'")
    return speeds


def split_batch(ctx: OpContext, batch_size: int) -> BatchSplit:
    """How the ranks share ``batch_size`` images (collective: every rank calls it): by the speeds they measured in
    their last data-parallel run, else by those declared in rank 0's environment (a joined machine's may differ),
    else evenly."""
    mine = torch.tensor([ctx.state.get(_SPEED, 0.0)], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine)
    speeds, source = [float(s.item()) for s in gathered], "measured"
    if not all(s > 0 for s in speeds):
        declared, failure = torch.zeros(ctx.world_size, dtype=torch.float64), None
        if ctx.rank == 0:
            try:
                declared[:] = torch.tensor(_declared(ctx.world_size) or [0.0] * ctx.world_size, dtype=torch.float64)
            except OpError as e:
                failure = e
        ctx.agree(failure)
        dist.broadcast(declared, src=0)
        speeds, source = declared.tolist(), "declared"
    if not all(s > 0 for s in speeds):
        base, extra = divmod(batch_size, ctx.world_size)
        return BatchSplit(tuple(base + (1 if r < extra else 0) for r in range(ctx.world_size)))
    return BatchSplit(tuple(shares(batch_size, speeds)), tuple(speeds), source)


class BusyClock:
    """A rank's own time in its denoising loop: from the loop's start or the last step's agreed cancel check to the
    end of the next step's work. Every step ends in a collective (the cancel check) that waits for the slowest rank,
    so the loop's wall time is the same on every rank; only the time outside those waits tells the ranks apart."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._since: float | None = time.monotonic()

    def stop(self) -> None:
        if self._since is not None:
            self.seconds += time.monotonic() - self._since
            self._since = None

    def start(self) -> None:
        self._since = time.monotonic()


def measured(ctx: OpContext, images: int, steps: int, seconds: float) -> None:
    """Record this rank's speed from the data-parallel run it just made (``seconds``: its ``BusyClock``'s)."""
    if images > 0 and steps > 0 and seconds > 0:
        ctx.state[_SPEED] = images * steps / seconds


def _slowed() -> tuple[int, float] | None:
    """(rank, seconds per step) of the test-only slowdown, None without it."""
    value = os.environ.get(SLOW_RANK_ENV) if test_ops_enabled() else None
    if not value:
        return None
    rank, seconds = value.split(":")
    return int(rank), float(seconds)


def slow_down(ctx: OpContext, images: int) -> None:
    """The test-only slowdown (``SLOW_RANK_ENV``) of one denoising step of ``images`` images on this rank."""
    slowed = _slowed()
    if slowed is not None and slowed[0] == ctx.rank:
        time.sleep(slowed[1] * images)


def device_name(ctx: OpContext) -> str:
    """This rank's device as the node names it: the GPU's model, "cpu"; a rank the test switch slows says so."""
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    slowed = _slowed()
    return f"{name} (slowed for a test)" if slowed is not None and slowed[0] == ctx.rank else name


def unequal_devices(ctx: OpContext) -> tuple[str, ...]:
    """Every rank's device name when they are not all the same (collective), else ``()``."""
    if ctx.world_size == 1:
        return ()
    name = device_name(ctx)
    mine = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    encoded = name.encode()[:_NAME_BYTES]
    mine[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    names = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(names, mine)
    decoded = tuple(bytes(n.tolist()).rstrip(b"\0").decode(errors="replace") for n in names)
    return decoded if len(set(decoded)) > 1 else ()
