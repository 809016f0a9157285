"""A backend rank: its device, its part of the op protocol, and the op executor.

Environment (set by the launcher): COMFY_PARALLEL_RUN_DIR (private 0700 directory with the socket, the token and the
per-rank logs), COMFY_PARALLEL_CLIENT_PID (the workers exit when it dies), COMFY_PARALLEL_DEVICE (cpu|cuda),
COMFY_PARALLEL_MEMORY_POLICY (staged|resident|auto), COMFY_PARALLEL_SHM_PREFIX (names of this backend's arena segments).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ..rundir import RunDir
from ..serial import from_json, to_json
from . import stages  # noqa: F401  (registers its ops)
from .diagnostics import device_label, flush, memory_of  # and registers its ops
from .group import SHUTDOWN_OP, Group, OpHeader, Outcome, OutcomeStatus, broadcast_tensors
from .models import ResidentModels
from .ops import OpCancelled, OpContext, WidgetError, get_op
from .remote import beat, check_in, introduce, leave, node_rank

log = logging.getLogger("parallel_runtime.worker")

# How long one collective may wait: the client's watchdog sets it above its own deadlines
# (COMFY_PARALLEL_COLLECTIVE_TIMEOUT_S, see watchdog.Deadlines.collective_s), so it tears a stuck group down first and
# names what stopped; this is the last resort for ranks whose client is gone. Idle ranks wait on the store, never in a
# collective, so hours between queue runs do not count. The default is for ranks started without the pack's launcher.
DEFAULT_COLLECTIVE_TIMEOUT_S = 1860.0


def collective_timeout() -> timedelta:
    return timedelta(
        seconds=float(os.environ.get("COMFY_PARALLEL_COLLECTIVE_TIMEOUT_S") or DEFAULT_COLLECTIVE_TIMEOUT_S)
    )


def _out_of_memory(e: Exception) -> bool:
    """A failed allocation: CUDA's OutOfMemoryError, or the CPU allocator's (a RuntimeError, or Python's)."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(e)


class Rank:
    """This rank's part of the backend: device, group protocol, and the op executor."""

    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.run_dir = RunDir(os.environ["COMFY_PARALLEL_RUN_DIR"])
        self.device_kind = os.environ.get("COMFY_PARALLEL_DEVICE", "cpu")
        self.memory_policy = os.environ.get("COMFY_PARALLEL_MEMORY_POLICY", "staged")
        self.cancel_event = threading.Event()
        self.state: dict = {}
        self.send_progress = None  # set by rank 0's server

    def init(self) -> None:
        if self.device_kind == "cuda":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            backend = "cpu:gloo,cuda:nccl"  # gloo for the CPU tensors the protocol moves, NCCL for the work
        else:
            from .cpu_shims import apply_cpu_shims

            apply_cpu_shims()
            self.device = torch.device("cpu")
            backend = "gloo"
        self.state["models"] = ResidentModels(self.device, self.memory_policy)
        timeout = collective_timeout()
        # device_id binds NCCL to this rank's GPU at once (a broken link fails the start, not the first denoise) and
        # spares torch guessing the device from the global rank.
        device_id = self.device if self.device.type == "cuda" else None
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)
        with open(self.run_dir.token) as f:
            secret = f.read().strip()
        self.group = Group(dist.distributed_c10d._get_default_store(), self.rank, self.world_size, secret)
        self.node = node_rank()
        if self.rank == 0 and self.node != 0:
            raise RuntimeError(f"rank 0 started on node {self.node}: it must run on the ComfyUI host (node 0)")
        introduce(self.group)
        if self.rank == 0:
            check_in(self.group, self.run_dir)
        elif self.node != 0:
            beat(self.rank, self.group.sealer)
        # What the start-up imported lives as long as the rank: out of the collector's sight.
        flush(self.device, freeze=True)
        log.info(
            "rank %d/%d up on %s (%s, pid %d); a collective times out after %.0f s",
            self.rank,
            self.world_size,
            self.device,
            device_label(self.device),
            os.getpid(),
            timeout.total_seconds(),
        )

    def execute(self, header: OpHeader, tensors: dict[str, torch.Tensor]) -> tuple[Outcome, dict[str, torch.Tensor]]:
        """Run one op; return this rank's outcome and, on rank 0, its output tensors."""
        self.state.pop("estimate", None)  # what this op's memory check estimated, for an out-of-memory message
        try:
            op = get_op(header.op)
            args = from_json(op.args, header.args)
            if op.spmd and header.tensors:
                tensors = broadcast_tensors(tensors if self.rank == 0 else None, header.tensors)
            if not op.spmd and self.rank != 0:
                return Outcome(OutcomeStatus.OK), {}
            ctx = OpContext(
                rank=self.rank,
                world_size=self.world_size,
                local_rank=self.local_rank,
                local_world_size=self.local_world_size,
                device=self.device,
                spmd=op.spmd,
                cancel_event=self.cancel_event,
                send_progress=self.send_progress if self.rank == 0 else None,
                state=self.state,
            )
            result, out = op.fn(ctx, args, tensors)
            return Outcome(OutcomeStatus.OK, result=None if result is None else to_json(result)), out
        except OpCancelled as e:
            return Outcome(OutcomeStatus.CANCELLED, step=e.step), {}
        except WidgetError as e:  # a request that cannot work, refused before it loads anything
            return Outcome(OutcomeStatus.ERROR, error_type="InvalidInput", message=str(e), widget=e.widget), {}
        except Exception as e:  # reported to the client; the group protocol decides whether it can go on
            log.exception("op %s failed", header.op)
            if _out_of_memory(e):
                return Outcome(
                    OutcomeStatus.ERROR,
                    error_type="OutOfMemory",
                    message=self._out_of_memory(e),
                    traceback=traceback.format_exc(),
                ), {}
            return Outcome(
                OutcomeStatus.ERROR, error_type=type(e).__name__, message=str(e), traceback=traceback.format_exc()
            ), {}

    def _out_of_memory(self, e: Exception) -> str:
        memory = memory_of(self.device)
        estimate = self.state.get("estimate")
        needs = f"needs about {estimate}, " if estimate is not None else ""
        return (
            f"out of memory on rank {self.rank} ({device_label(self.device)}): {needs}free "
            f"{memory.free_bytes / 2**30:.1f} of {memory.total_bytes / 2**30:.1f} GiB there now ({e}). Use a strategy "
            "that splits the work (context_parallel or tensor_parallel), a smaller size or batch, or free the device"
        )

    def die(self, outcome: Outcome) -> None:
        """Leave the group for good: record why, and exit so that torchrun tears the rest down."""
        text = outcome.traceback or outcome.message or "rank left the group"
        with open(self.run_dir.rank_traceback(self.rank), "w") as f:
            f.write(text)
        if self.node != 0:
            leave(self.rank, self.group.sealer, text)
        log.error("rank %d leaves the group: the others are stuck in a collective it left", self.rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def follow(self) -> None:
        """Ranks 1..N-1: run every op rank 0 posts, in order, until shutdown."""
        seq = 0
        while True:
            header = self.group.next_header(seq + 1)
            if header is None:
                continue
            seq += 1
            if header.op == SHUTDOWN_OP:
                return
            outcome, _ = self.execute(header, {})
            if not self.group.report(seq, outcome):
                self.die(outcome)
