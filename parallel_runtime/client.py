"""The client side, living in the ComfyUI process: start the backend lazily, call ops, watch its health.

``Backend.call`` sends one op and waits for its result with a deadline, feeding progress to a callback and
turning a cancel request into the protocol's ``cancel``. While it waits it watches every rank's process:
a dead rank becomes ``BackendDied`` naming that rank, the group is torn down, and the next call starts a
fresh one. Calls from several threads are serialised, never interleaved.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from . import launcher
from .arena import Arena, ArenaReader
from .errors import BackendDied, BackendStartError, Cancelled, DeadlineExceeded, OpFailed, ParallelRuntimeError, Refused
from .processes import process_alive
from .protocol import (
    BadFrame,
    Bye,
    Call,
    Cancel,
    CancelledReply,
    Channel,
    ChannelClosed,
    Error,
    Fatal,
    Hello,
    Progress,
    Result,
    Shutdown,
    Welcome,
)
from .protocol import Refused as RefusedFrame
from .serial import from_json, to_json
from .spec import BackendSpec
from .wire import FreeArgs, OpArgs, RankStatus, StatusArgs

log = logging.getLogger("parallel_runtime.client")

STARTUP_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 6 * 3600.0
POLL_S = 0.05  # how quickly a cancel or a progress event is noticed
HEALTH_S = 0.5  # how often the ranks' processes are looked at while waiting
# How long a dying group may take to finish dying before we stop waiting for its own account of it.
DEATH_REPORT_S = 3.0

ProgressFn = Callable[[int, int, "str | None"], None]
R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class CallResult(Generic[R]):
    """An op's answer: rank 0's result, every rank's (None where a rank has nothing to say), rank 0's tensors."""

    result: R | None
    per_rank: tuple[R | None, ...]
    tensors: dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class BackendStatus:
    """What ``Backend.status`` reports: every rank's device, memory and resident models."""

    world_size: int
    device: str
    ranks: tuple[RankStatus, ...]
    startup_s: float | None


class Backend:
    """A persistent multi-rank backend described by ``spec``. Starts on first use."""

    def __init__(self, spec: BackendSpec, *, startup_timeout: float = STARTUP_TIMEOUT_S):
        self.spec = spec
        self.startup_timeout = startup_timeout
        self._lock = threading.RLock()
        self._group: launcher.LaunchedGroup | None = None
        self._channel: Channel | None = None
        self._arena: Arena | None = None
        self._outputs = ArenaReader()
        self._ids = itertools.count(1)
        self._current_call: str | None = None
        self._pids: dict[int, int] = {}
        self.startup_s: float | None = None
        self._last_status: dict | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._group is not None

    @property
    def worker_pids(self) -> dict[int, int]:
        """Rank → pid of this machine's ranks (empty before start)."""
        return dict(self._pids)

    @property
    def run_dir(self) -> str | None:
        return self._group.run_dir if self._group else None

    @property
    def shm_prefix(self) -> str | None:
        return self._group.shm_prefix if self._group else None

    def start(self) -> None:
        with self._lock:
            if self._group is None:
                self._start()

    def _start(self) -> None:
        t0 = time.monotonic()
        group = launcher.launch(self.spec)
        self._group = group
        deadline = t0 + self.startup_timeout
        try:
            while not os.path.exists(group.socket_path):
                if group.proc.poll() is not None:
                    raise BackendStartError(self._start_failure("exited during start-up"))
                if time.monotonic() > deadline:
                    raise BackendStartError(self._start_failure(f"did not come up within {self.startup_timeout:.0f} s"))
                time.sleep(POLL_S)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(group.socket_path)
            channel = Channel(sock)
            channel.send(Hello(token=group.token))
            reply = channel.recv(max(1.0, deadline - time.monotonic()))
            if not isinstance(reply, Welcome):
                channel.close()
                reason = reply.reason if isinstance(reply, RefusedFrame) else f"answered {reply}"
                raise BackendStartError(self._start_failure(f"did not accept the client: {reason}"))
        except BaseException:
            self._teardown()
            raise
        self._channel = channel
        self._arena = Arena(f"{group.shm_prefix}-in")
        self._pids = group.worker_pids()
        self.startup_s = time.monotonic() - t0
        log.info(
            "parallel backend up: %d ranks on %s in %.1f s (%s)",
            self.spec.world_size,
            self.spec.device,
            self.startup_s,
            group.run_dir,
        )

    def _start_failure(self, what: str) -> str:
        g = self._group
        tails = "\n".join(f"--- rank {r} ---\n{g.log_tail(f'rank{r}.log')}" for r in sorted(g.worker_pids()))
        return (
            f"the parallel backend ({self.spec.ranks} {self.spec.device} ranks) {what}.\n"
            f"--- torchrun ---\n{g.log_tail('launcher.log')}\n{tails}"
        )

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every rank and free everything: no process and no shared-memory segment is left."""
        with self._lock:
            if self._group is None:
                return
            if self._channel is not None and self._group.proc.poll() is None:
                try:
                    self._channel.send(Shutdown())
                    deadline = time.monotonic() + timeout
                    while time.monotonic() < deadline:
                        if isinstance(self._channel.recv(POLL_S), Bye):
                            break
                    launcher.wait_exit(self._group, max(0.0, deadline - time.monotonic()))
                except (OSError, ChannelClosed, ValueError):
                    pass
            self._teardown()

    def _teardown(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._outputs.close()
        if self._group is not None:
            launcher.terminate(self._group)
            self._group = None
        self._pids = {}

    # -- health ---------------------------------------------------------------------------------------
    def _dead_ranks(self) -> list[int]:
        if self._group.proc.poll() is not None:
            return sorted(self._pids) or [0]
        return [r for r, pid in sorted(self._pids.items()) if not process_alive(pid)]

    def _die(self, reason: str, rank: int | None = None, tb: str = "") -> BackendDied:
        """Tear the group down and build the error that says which rank failed and why."""
        group = self._group
        first_dead = self._dead_ranks()
        launcher.wait_exit(group, DEATH_REPORT_S)  # let torchrun write its account of the failure
        if rank is None:
            rank = group.failed_rank()
        if rank is None and first_dead:
            rank = first_dead[0]
        tb = tb or (group.traceback_of(rank) if rank is not None else "")
        tail = group.log_tail(f"rank{rank}.log") if rank is not None else group.log_tail("launcher.log")
        # The pid of the rank named, which torchrun's account may pick over the first one seen dead.
        pid = self._pids.get(rank) if rank is not None else None
        self._teardown()
        who = (f"rank {rank}" + (f" (pid {pid})" if pid else "")) if rank is not None else "a rank"
        detail = f"\n{tb.strip().splitlines()[-1]}" if tb.strip() else ""
        return BackendDied(
            f"the parallel backend failed: {who} {reason}; it was shut down and the next run "
            f"starts a fresh one.{detail}",
            rank=rank,
            log_tail=tail,
            traceback=tb,
        )

    # -- calls ----------------------------------------------------------------------------------------
    def call(
        self,
        args: OpArgs,
        tensors: dict[str, torch.Tensor] | None = None,
        *,
        on_progress: ProgressFn | None = None,
        should_cancel: Callable[[], bool] | None = None,
        timeout: float = CALL_TIMEOUT_S,
    ) -> CallResult:
        """Run the op ``args`` names on the backend (starting it if needed) and return its result.

        ``on_progress(step, total, text)`` is called for each progress event; if it raises, the op is
        cancelled on every rank and the exception re-raised once the ranks have stopped. ``should_cancel``
        is polled while waiting. Raises OpFailed, Cancelled, BackendDied or DeadlineExceeded.
        """
        global _last_error
        with self._lock:
            try:
                return self._call(args, tensors, on_progress, should_cancel, timeout)
            except (BackendDied, BackendStartError, DeadlineExceeded, OpFailed) as e:
                _last_error = {
                    "op": args.op,
                    "type": type(e).__name__,
                    "message": str(e),
                    "rank": getattr(e, "rank", None),
                    "time": time.time(),
                }
                raise

    def _call(
        self,
        args: OpArgs,
        tensors: dict[str, torch.Tensor] | None,
        on_progress: ProgressFn | None,
        should_cancel: Callable[[], bool] | None,
        timeout: float,
    ) -> CallResult:
        if self._group is None:
            self._start()
        call_id = f"c{next(self._ids)}"
        descs = self._arena.write(tensors or {})
        self._current_call = call_id
        try:
            self._channel.send(Call(id=call_id, op=args.op, args=to_json(args), tensors=descs))
            return self._wait(args, call_id, on_progress, should_cancel, time.monotonic() + timeout)
        except (OSError, ChannelClosed) as e:
            raise self._die(f"closed the control connection ({e})") from None
        finally:
            self._current_call = None

    def cancel(self) -> None:
        """Ask every rank to stop the running call at its next step boundary (any thread may call this)."""
        call_id, channel = self._current_call, self._channel
        if call_id is not None and channel is not None:
            try:
                channel.send(Cancel(id=call_id))
            except OSError:
                pass

    def _wait(
        self,
        args: OpArgs,
        call_id: str,
        on_progress: ProgressFn | None,
        should_cancel: Callable[[], bool] | None,
        deadline: float,
    ) -> CallResult:
        pending_exc: BaseException | None = None
        next_health_check = 0.0
        while True:
            try:
                msg = self._channel.recv(POLL_S)
            except BadFrame as e:
                log.warning("ignored a control frame from rank 0: %s", e)
                continue
            if msg is None:
                if pending_exc is None and should_cancel is not None and should_cancel():
                    pending_exc = Cancelled("cancelled by the user", steps_by_rank=[])
                    self.cancel()
                if time.monotonic() >= next_health_check:
                    next_health_check = time.monotonic() + HEALTH_S
                    if self._dead_ranks():
                        raise self._die("exited")
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"op {call_id} ran past its deadline; the backend was shut down. "
                        f"{self._die('was still running at the deadline')}"
                    )
                continue
            if getattr(msg, "id", None) not in (call_id, None):
                continue  # a late event of an earlier, abandoned call
            if isinstance(msg, Progress):
                if on_progress is not None and pending_exc is None:
                    try:
                        on_progress(msg.step, msg.total, msg.text)
                    except BaseException as e:  # e.g. ComfyUI's InterruptProcessingException
                        pending_exc = e
                        self.cancel()
            elif isinstance(msg, Result):
                tensors = self._outputs.read(msg.tensors)
                if pending_exc is not None:
                    raise pending_exc
                kind = args.result
                return CallResult(
                    None if msg.result is None else from_json(kind, msg.result),
                    tuple(None if r is None else from_json(kind, r) for r in msg.per_rank),
                    tensors,
                )
            elif isinstance(msg, CancelledReply):
                if pending_exc is not None and not isinstance(pending_exc, Cancelled):
                    raise pending_exc
                raise Cancelled(f"cancelled at step {msg.steps_by_rank[0]}", steps_by_rank=list(msg.steps_by_rank))
            elif isinstance(msg, Error):
                if pending_exc is not None:
                    raise pending_exc
                who = f"rank {msg.rank}" if msg.rank is not None else "the backend"
                raise OpFailed(
                    f"{who}: {msg.error_type}: {msg.message}",
                    rank=msg.rank,
                    error_type=msg.error_type,
                    traceback=msg.traceback,
                )
            elif isinstance(msg, Fatal):
                raise self._die(f"failed and left the group stuck: {msg.message}", rank=msg.rank, tb=msg.traceback)
            elif isinstance(msg, RefusedFrame):
                raise Refused(f"the backend refused this client: {msg.reason}")

    def status(self) -> BackendStatus:
        """World size, and per rank: device, pid, memory, resident models."""
        r = self.call(StatusArgs(), timeout=60.0)
        self._last_status = BackendStatus(
            world_size=len(r.per_rank), device=self.spec.device, ranks=r.per_rank, startup_s=self.startup_s
        )
        return self._last_status

    def free(self) -> None:
        """Unload every resident model on every rank; the ranks stay up."""
        self.call(FreeArgs(), timeout=120.0)

    def snapshot(self) -> dict:
        """Status as JSON (the status panel's), without waiting: fresh when the backend is idle, the last one seen
        (``busy``) while an op runs, and never a reason to start a backend."""
        view = {
            "running": self.running,
            "busy": False,
            "spec": dataclasses.asdict(self.spec),
            "last_error": _last_error,
        }
        if not self._lock.acquire(blocking=False):
            return {**view, "busy": True, **(to_json(self._last_status) if self._last_status else {})}
        try:
            if self.running:
                view.update(to_json(self.status()))
        except ParallelRuntimeError:
            view.update(running=self.running, last_error=_last_error)
        finally:
            self._lock.release()
        return view


# -- the process-wide backend -------------------------------------------------------------------------
_current: Backend | None = None
_current_lock = threading.Lock()
_last_error: dict | None = None  # the last failure of any backend, for the status panel


def get_backend(spec: BackendSpec) -> Backend:
    """The backend for ``spec``. One backend owns the GPUs at a time, so a different spec replaces it."""
    global _current
    with _current_lock:
        if _current is not None and _current.spec != spec:
            log.info("backend configuration changed (%s -> %s): restarting", _current.spec, spec)
            _current.shutdown()
            _current = None
        if _current is None:
            _current = Backend(spec)
        return _current


def current_backend() -> Backend | None:
    return _current


def last_error() -> dict | None:
    """The last failure of any backend of this process: the status panel keeps showing it after the backend that
    failed was shut down or replaced."""
    return _last_error


def shutdown_backend() -> None:
    global _current
    with _current_lock:
        if _current is not None:
            _current.shutdown()
            _current = None


atexit.register(shutdown_backend)
