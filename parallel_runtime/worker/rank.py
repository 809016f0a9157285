"""A backend rank: torchrun's entry point. Rank 0 also serves the client (see server.py).

Environment (set by the launcher): COMFY_PARALLEL_RUN_DIR (private 0700 directory with the socket, the
token and the per-rank logs), COMFY_PARALLEL_CLIENT_PID (the workers exit when it dies),
COMFY_PARALLEL_DEVICE (cpu|cuda), COMFY_PARALLEL_SHM_PREFIX (names of this backend's arena segments).
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from . import diagnostics, stages  # noqa: F401  (register their ops)
from ..launcher import process_alive
from .group import Group, broadcast_tensors
from .models import ResidentModels
from .ops import OpCancelled, OpContext, get_op

log = logging.getLogger("parallel_runtime.worker")

# Ranks can sit idle between queue runs for hours; idle waits poll the store, so the work group's
# collectives only need to cover the longest single op.
COLLECTIVE_TIMEOUT = timedelta(hours=2)
SHUTDOWN_OP = "__shutdown__"


def _redirect_output(run_dir: str, rank: int) -> None:
    """Send this rank's stdout/stderr (Python and C++ alike) to ``rank<N>.log`` in the run directory."""
    fd = os.open(os.path.join(run_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)


def _watch_for_orphaning(client_pid: int, on_exit) -> None:
    """Exit when the client process dies or torchrun's agent (our parent) does: nobody is left to talk to."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            if not process_alive(client_pid) or os.getppid() != parent:
                log.warning("client or launcher died; exiting")
                on_exit()
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


class Rank:
    """This rank's part of the backend: device, group protocol, and the op executor."""

    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.run_dir = os.environ["COMFY_PARALLEL_RUN_DIR"]
        self.device_kind = os.environ.get("COMFY_PARALLEL_DEVICE", "cpu")
        self.cancel_event = threading.Event()
        self.state: dict = {}
        self.send_progress = None  # set by rank 0's server

    def init(self) -> None:
        if self.device_kind == "cuda":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            backend = "cpu:gloo,cuda:nccl"  # gloo for the CPU tensors the protocol moves, NCCL for the work
        else:
            from ..cpu_shims import apply_cpu_shims

            apply_cpu_shims()
            self.device = torch.device("cpu")
            backend = "gloo"
        self.state["models"] = ResidentModels(self.device)
        dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT)
        self.group = Group(dist.distributed_c10d._get_default_store(), self.rank, self.world_size)
        log.info("rank %d/%d up on %s (pid %d)", self.rank, self.world_size, self.device, os.getpid())

    def execute(self, header: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
        """Run one op; return this rank's outcome (JSON) and, on rank 0, its output tensors."""
        try:
            op = get_op(header["op"])
            if op.spmd and header.get("tensors"):
                tensors = broadcast_tensors(tensors if self.rank == 0 else None, header["tensors"])
            if not op.spmd and self.rank != 0:
                return {"ok": True, "result": None}, {}
            ctx = OpContext(rank=self.rank, world_size=self.world_size, local_rank=self.local_rank,
                            device=self.device, spmd=op.spmd, cancel_event=self.cancel_event,
                            send_progress=self.send_progress if self.rank == 0 else None, state=self.state)
            result, out = op.fn(ctx, header.get("args") or {}, tensors)
            return {"ok": True, "result": result}, out
        except OpCancelled as e:
            return {"ok": False, "kind": "cancelled", "step": e.step}, {}
        except Exception as e:  # reported to the client; the group protocol decides whether it can go on
            log.exception("op %s failed", header.get("op"))
            return {"ok": False, "kind": "error", "type": type(e).__name__, "message": str(e),
                    "traceback": traceback.format_exc()}, {}

    def die(self, outcome: dict) -> None:
        """Leave the group for good: record why, and exit so that torchrun tears the rest down."""
        with open(os.path.join(self.run_dir, f"rank{self.rank}.traceback"), "w") as f:
            f.write(outcome.get("traceback") or outcome.get("message") or "rank left the group")
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
            if header["op"] == SHUTDOWN_OP:
                return
            outcome, _ = self.execute(header, {})
            if not self.group.report(seq, outcome):
                self.die(outcome)


def main() -> None:
    run_dir = os.environ["COMFY_PARALLEL_RUN_DIR"]
    rank_id = int(os.environ["RANK"])
    if os.environ.get("COMFY_PARALLEL_LOG_TO_FILES", "1") == "1":
        _redirect_output(run_dir, rank_id)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank_id} %(name)s %(levelname)s: %(message)s")
    with open(os.path.join(run_dir, f"rank{rank_id}.pid"), "w") as f:
        f.write(str(os.getpid()))

    from ..arena import remove_segments

    shm_prefix = os.environ["COMFY_PARALLEL_SHM_PREFIX"]
    def clean_up_for_the_dead_client() -> None:
        # Whichever rank of the client's machine notices first cleans up: torchrun's agent stops the others as
        # soon as one exits, possibly before they get to it. Both steps are safe to repeat.
        if os.environ.get("GROUP_RANK", "0") == "0":
            remove_segments(shm_prefix)
            shutil.rmtree(run_dir, ignore_errors=True)

    _watch_for_orphaning(int(os.environ["COMFY_PARALLEL_CLIENT_PID"]), on_exit=clean_up_for_the_dead_client)
    me = Rank()
    me.init()
    try:
        if me.rank == 0:
            from .server import Server

            Server(me, socket_path=os.path.join(run_dir, "control.sock"), shm_prefix=shm_prefix).serve()
        else:
            me.follow()
    finally:
        if me.rank == 0:
            remove_segments(shm_prefix)
    dist.destroy_process_group()
    log.info("rank %d shut down", me.rank)
