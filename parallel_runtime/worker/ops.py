"""The op registry and the context an op runs in.

An op is a function ``fn(ctx, args, tensors) -> (result, out_tensors)`` registered for its arguments' type (a
``wire.OpArgs``, whose ``op`` names it; ``REGISTRY`` holds one function per such type, and every such type has one):
``args`` arrives rebuilt and checked, ``result`` is the op's result dataclass (or None on ranks that have nothing to
say). SPMD ops run on every rank (CP/TP/DP work, collectives inside); rank-0 ops run on rank 0 alone
(device_map placement across several GPUs in one process) while the other ranks wait for the next op. Each rank's
result is returned to the client (``per_rank``), rank 0's tensors too.

Input tensors on rank 0 are views of the client's shared-memory segment (no copy): they are valid until the op
returns, so an op that keeps one longer (in ``ctx.state``) must clone it.

Ops registered with ``testing=True`` (fault injection) are served only by a backend started with
``COMFY_PARALLEL_TEST_OPS=1``; a production backend answers them as unknown.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..wire import OpArgs

TEST_OPS_ENV = "COMFY_PARALLEL_TEST_OPS"  # "1": the backend serves the test ops (a test or a bench sets it)

OpResult = tuple[Any, dict[str, torch.Tensor]]  # (the op's result dataclass or None, output tensors)
OpFn = Callable[["OpContext", Any, dict[str, torch.Tensor]], OpResult]


class OpError(Exception):
    """A failure an op reports on purpose (bad arguments, missing file); the backend stays usable."""


class WidgetError(OpError):
    """A request that cannot work, found on the ranks before any weights load (it would not fit the memory): the
    client raises it as ``InvalidInput`` naming the widget."""

    def __init__(self, widget: str, message: str):
        super().__init__(message)
        self.widget = widget


class PeerFailed(OpError):
    """Raised on the ranks that did their part when another rank failed the op: the reply to the client carries that
    rank's own error, not this one."""


class OpCancelled(Exception):
    """Raised on every rank at the same step boundary once the client asked to cancel."""

    def __init__(self, step: int):
        super().__init__(f"cancelled at step {step}")
        self.step = step


@dataclasses.dataclass(frozen=True)
class Op:
    args: type[OpArgs]
    fn: OpFn
    spmd: bool
    testing: bool = False


REGISTRY: dict[str, Op] = {}  # by the op's name (its arguments' ``op``)


def op(args: type[OpArgs], *, spmd: bool, testing: bool = False) -> Callable[[OpFn], OpFn]:
    """Register ``fn`` as the op whose arguments are ``args``."""

    def register(fn: OpFn) -> OpFn:
        if args.op in REGISTRY:
            raise ValueError(f"op {args.op!r} registered twice")
        REGISTRY[args.op] = Op(args, fn, spmd, testing)
        return fn

    return register


def test_ops_enabled() -> bool:
    return os.environ.get(TEST_OPS_ENV) == "1"


def get_op(name: str) -> Op:
    found = REGISTRY.get(name)
    if found is None or (found.testing and not test_ops_enabled()):
        known = sorted(n for n, o in REGISTRY.items() if not o.testing or test_ops_enabled())
        raise OpError(f"unknown op {name!r}; known: {known}")
    return found


class OpContext:
    """What an op may use: where it runs, progress reporting and the agreed cancel check."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        local_world_size: int,
        device: torch.device,
        spmd: bool,
        cancel_event: threading.Event,
        send_progress: Callable[[int, int, str | None], None] | None,
        state: dict,
    ):
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.local_world_size = local_world_size  # ranks on this machine (they share its memory on CPU)
        self.device = device
        self.spmd = spmd
        self.state = state  # per-rank state that outlives one op (resident models, ...)
        self._cancel_event = cancel_event
        self._send_progress = send_progress

    def alone(self) -> None:
        """Declare that the rest of this op runs on this rank only (a rank-0 stage whose other ranks have
        returned): from here on the cancel check is local, since nobody else would join its broadcast."""
        self.spmd = False

    def progress(self, step: int, total: int, text: str | None = None) -> None:
        """Report progress to the client (rank 0 only; other ranks' calls are no-ops)."""
        if self._send_progress is not None:
            self._send_progress(step, total, text)

    def _together(self) -> bool:
        return self.spmd and self.world_size > 1

    def agree(self, refused: Exception | None, what: str = "refused this request before it changed anything") -> None:
        """Every rank of an SPMD op learns whether any rank refused the request (``refused``: this rank's reason, or
        None), before any of them goes on into a collective: the refusing rank raises its own error, the others a
        PeerFailed naming it (``what`` it did: refused, or failed a step such as a load that they all must undo), so
        no rank is left alone in the next collective and the reply carries the refusing rank's reason."""
        first = self.rank if refused is not None else self.world_size
        if self._together():
            flag = torch.tensor([first], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            first = int(flag.item())
        if refused is not None:
            try:
                raise refused
            finally:
                del refused  # this frame is in the error's traceback: no cycle that only the collector could free
        if first < self.world_size:
            raise PeerFailed(f"rank {first} {what} (its message says why)")

    def from_rank0(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (a broadcast on the CPU group in SPMD ops): a decision only rank 0 can make
        (it alone sees the client, or a stage's device), taken by all."""
        if not self._together():
            return flag
        shared = torch.tensor([int(flag) if self.rank == 0 else 0], dtype=torch.int32)
        dist.broadcast(shared, src=0)
        return bool(shared.item())

    def any_rank(self, flags: list[bool]) -> list[bool]:
        """Each of ``flags`` set where any rank set it (an all-reduce on the CPU group in SPMD ops): e.g. the models
        some rank must free, which every rank then frees."""
        if not self._together():
            return list(flags)
        shared = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        return [bool(v) for v in shared.tolist()]

    def check_cancel(self, step: int) -> None:
        """Raise OpCancelled if the client asked to cancel. In SPMD ops this is a collective: rank 0 decides
        and broadcasts, so every rank stops at the same step and none waits alone in the next collective."""
        if self.from_rank0(self._cancel_event.is_set()):
            raise OpCancelled(step)
