"""The client side, living in the ComfyUI process: start the backend lazily, call ops, watch its health.

``Backend.call`` sends one op and waits for its result, feeding progress to a callback and turning a cancel request
into the protocol's ``Cancel``. While it waits it watches every process of the group (``watchdog``): a dead, stopped
or silent rank, the torchrun agent's death, or an op that stops making progress becomes ``BackendDied`` naming what
stopped responding, within a deadline; the group is torn down and the next call starts a fresh one. Calls from
several threads are serialised, never interleaved; ``shutdown`` never waits for a running call.
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

from . import launcher, machines, rendezvous
from .arena import Arena, ArenaReader
from .errors import (
    BackendDied,
    BackendStartError,
    Cancelled,
    DeadlineExceeded,
    InvalidInput,
    OpFailed,
    ParallelRuntimeError,
    Refused,
)
from .processes import children, memory_cgroup, oom_kills, process_alive
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
from .watchdog import Deadlines, Watchdog
from .wire import FreeArgs, OpArgs, RankStatus, StatusArgs

log = logging.getLogger("parallel_runtime.client")

STARTUP_TIMEOUT_S = 180.0
POLL_S = 0.05  # how quickly a cancel or a progress event is noticed
HEALTH_S = 0.5  # how often the ranks' processes are looked at while waiting
# How long a dying group may take to finish dying before we stop waiting for its own account of it.
DEATH_REPORT_S = 3.0
# A rank on another machine whose heartbeat (relayed every second) is this old when the group fails went first.
REMOTE_SILENT_S = 2.5

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
    """A persistent multi-rank backend described by ``spec``. Starts on first use.

    ``deadlines`` bound every wait of a call (``watchdog``); by default they are read from the environment.
    """

    def __init__(
        self, spec: BackendSpec, *, startup_timeout: float = STARTUP_TIMEOUT_S, deadlines: Deadlines | None = None
    ):
        self.spec = spec
        self.startup_timeout = startup_timeout
        self.deadlines = deadlines or Deadlines.from_env()
        self._lock = threading.RLock()
        self._group: launcher.LaunchedGroup | None = None
        self._channel: Channel | None = None
        self._arena: Arena | None = None
        self._outputs = ArenaReader()
        self._ids = itertools.count(1)
        self._current_call: str | None = None
        self._watchdog: Watchdog | None = None
        self._pids: dict[int, int] = {}
        self._memory: dict[int, dict[str, int | None]] = {}  # rank -> {memory cgroup: its OOM kills when first seen}
        self._aborted: str | None = None  # why another thread ended the group under a running call
        self.startup_s: float | None = None
        self._last_status: BackendStatus | None = None
        self._gpus: tuple[str, ...] | None = None  # the running group's GPUs, by UUID

    # -- lifecycle ------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._group is not None

    @property
    def worker_pids(self) -> dict[int, int]:
        """Rank → pid of this machine's ranks (empty before start)."""
        return dict(self._pids)

    @property
    def agent_pid(self) -> int | None:
        return self._group.proc.pid if self._group else None

    @property
    def run_dir(self) -> str | None:
        return self._group.run_dir.path if self._group else None

    @property
    def shm_prefix(self) -> str | None:
        return self._group.shm_prefix if self._group else None

    def start(self) -> None:
        with self._lock:
            if self._group is None:
                self._start()

    def _start(self) -> None:
        t0 = time.monotonic()
        group = launcher.launch(self.spec, collective_timeout_s=self.deadlines.collective_s)
        self._group, self._aborted = group, None
        # Over several machines the ranks start only once every machine has joined the rendezvous.
        join_by = t0 + rendezvous.join_deadline() if self.spec.nnodes > 1 else None
        deadline = t0 + self.startup_timeout + (rendezvous.join_deadline() if join_by else 0.0)
        try:
            while not os.path.exists(group.run_dir.socket):
                if group.proc.poll() is not None:
                    raise BackendStartError(self._start_failure("exited during start-up"))
                # torchrun's agent starts the ranks once the rendezvous is complete
                if join_by is not None and time.monotonic() > join_by and not children(group.proc.pid):
                    raise BackendStartError(self._missing_nodes())
                if time.monotonic() > deadline:
                    raise BackendStartError(self._start_failure(f"did not come up within {self.startup_timeout:.0f} s"))
                time.sleep(POLL_S)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(group.run_dir.socket)
            channel = Channel(sock)
            channel.send(Hello(token=group.token))
            reply = channel.recv(max(1.0, deadline - time.monotonic()))
            if not isinstance(reply, Welcome):
                channel.close()
                reason = reply.reason if isinstance(reply, RefusedFrame) else f"answered {reply}"
                raise BackendStartError(self._start_failure(f"did not accept the client: {reason}"))
        except BaseException as e:
            aborted = self._aborted
            self._teardown()
            if aborted:  # shutdown() killed the group: that, not its death, is what the caller needs to hear
                raise BackendStartError(
                    f"the parallel backend ({self.spec.ranks} {self.spec.device} ranks) was shut down while it started "
                    "(the Parallel panel's Shut down, or another backend's settings); run the prompt again to start it"
                ) from e
            raise
        self._channel = channel
        self._arena = Arena(f"{group.shm_prefix}-in")
        self._pids = group.worker_pids()
        self._memory = {}
        self._follow_memory_cgroups()
        self.startup_s = time.monotonic() - t0
        log.info(
            "parallel backend up: %d ranks on %s in %.1f s (%s)",
            self.spec.world_size,
            self.spec.device,
            self.startup_s,
            group.run_dir.path,
        )

    def _start_failure(self, what: str) -> str:
        g = self._group
        if g.start_spoiled_by_store():
            reachable = (
                "another user of this machine"
                if self.spec.nnodes == 1
                else f"anyone who reaches {self.spec.rdzv_endpoint}"
            )
            what += (
                f": a stranger's writes into its store broke its start-up (the store takes writes from {reachable}); "
                "nothing of theirs ran. Run the prompt again"
            )
        tails = "\n".join(f"--- rank {r} ---\n{g.log_tail(r)}" for r in sorted(g.worker_pids()))
        return (
            f"the parallel backend ({self.spec.ranks} {self.spec.device} ranks) {what}.\n"
            f"--- torchrun ---\n{g.log_tail()}\n{tails}"
        )

    def _missing_nodes(self) -> str:
        """Which machines did not join in time, and the command to run on each (without the secret: errors are
        logged)."""
        spec, group = self.spec, self._group
        joined = machines.claims(spec.rdzv_endpoint, group.rdzv_id, spec.nnodes, rendezvous.cluster_secret())
        missing = [k for k in range(1, spec.nnodes) if k not in joined]
        waited = f"within {rendezvous.join_deadline():.0f} s (COMFY_PARALLEL_JOIN_S)"
        if not missing:
            return (
                f"the parallel backend over {spec.nnodes} machines did not start: every machine claimed its node "
                f"({', '.join(f'node {k}: {c.host}' for k, c in sorted(joined.items()))}) but the rendezvous did not "
                f"complete {waited}; check that each machine reaches {spec.rdzv_endpoint} and the others (firewall, "
                "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME).\n--- torchrun ---\n" + group.log_tail()
            )
        return "the parallel backend did not start: " + "; ".join(
            f"node {k} of {spec.nnodes} did not join {waited}: on that machine run `"
            f"{machines.join_command(spec.rdzv_endpoint, k)}` (it must reach this machine at {spec.rdzv_endpoint})"
            for k in missing
        )

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every rank and free everything: no process and no shared-memory segment is left.

        Never waits for a running op: while one runs (maybe stuck in a collective), the group is killed from here
        and the op's caller gets ``BackendDied`` saying the backend was shut down.
        """
        if not self._lock.acquire(timeout=1.0):
            group = self._group
            if group is not None:
                self._aborted = "was shut down while the op ran"
                launcher.kill(group)
            if not self._lock.acquire(timeout=timeout + DEATH_REPORT_S + 10.0):
                log.error("the call running on the backend did not end after its group was killed")
                return
        try:
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
        finally:
            self._lock.release()

    def _teardown(self, grace: float = 5.0) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._outputs.close()
        if self._group is not None:
            launcher.terminate(self._group, grace=grace)
            self._group = None
        self._pids, self._memory, self._gpus = {}, {}, None

    # -- health ---------------------------------------------------------------------------------------
    def _follow_memory_cgroups(self) -> None:
        """Note every memory cgroup each rank is seen in, with its OOM-kill count then, so that a rank's death can be
        told from the kernel's out-of-memory kill (a dying task may already show another cgroup: none is forgotten)."""
        for rank, pid in self._pids.items():
            cgroup = memory_cgroup(pid) if process_alive(pid) else None
            seen = self._memory.setdefault(rank, {})
            if cgroup is not None and cgroup not in seen:
                seen[cgroup] = oom_kills(cgroup)

    def _look(self) -> str | None:
        """None while every process of the group runs; otherwise what ended."""
        self._follow_memory_cgroups()
        if self._group.proc.poll() is not None or any(not process_alive(pid) for pid in self._pids.values()):
            return "exited"
        return None

    def _died(self) -> tuple[int | None, str, str | None]:
        """Which process of a group that is ending went first, in words, and what killed it when that is known."""
        group = self._group
        agent = group.proc.returncode
        if agent is not None and agent < 0:  # the agent itself was killed by a signal, not by a rank's failure
            return None, f"the torchrun agent (pid {group.proc.pid})", f"was killed by signal {-agent}"
        rank = group.failed_rank()
        dead = [r for r, pid in sorted(self._pids.items()) if not process_alive(pid)]
        if rank is None and dead:
            rank = dead[0]
        if rank is None:
            return None, "a rank", None
        who = group.describe(rank)
        if any(
            (oom_kills(cgroup) or 0) > before
            for cgroup, before in self._memory.get(rank, {}).items()
            if before is not None
        ):
            return (
                rank,
                who,
                (
                    f"ran out of memory: the kernel's out-of-memory killer ended it (out of memory on rank "
                    f"{rank}); use a strategy that splits the work, a smaller size or batch, or free memory "
                    "on this machine"
                ),
            )
        return rank, who, None

    def _silent_machine(self) -> tuple[int, str, str] | None:
        """A rank on another machine that stopped beating before the group failed (its machine, its network or its
        ``comfy-parallel join`` went away): the cause, whatever rank 0 then reported. None when there is none."""
        group = self._group
        remote = group.remote_ranks()
        if not remote:
            return None
        # Rank 0 relays the remote heartbeats, so they mean something only while it ran: measure them at its own last
        # heartbeat (or when it left the group), never after it died.
        run_dir = group.run_dir
        moments = [time.time()]
        for path in (run_dir.rank_heartbeat(0), run_dir.rank_traceback(0)):
            try:
                moments.append(os.path.getmtime(path))
            except OSError:
                pass
        ages = {r: age for r, age in run_dir.heartbeat_ages(min(moments)).items() if r in remote}
        silent = [r for r, age in ages.items() if age > REMOTE_SILENT_S]
        if not silent:
            return None
        rank = max(silent, key=ages.get)
        return (
            rank,
            group.describe(rank),
            f"stopped answering: its heartbeat stopped {ages[rank]:.0f} s before the group failed (its machine, the "
            f"network, or `comfy-parallel join` there went away)",
        )

    def _die(
        self, reason: str, rank: int | None = None, tb: str = "", who: str | None = None, now: bool = False
    ) -> BackendDied:
        """Tear the group down and build the error that says which process failed and why. ``now``: the group is
        stuck (kill it at once rather than wait for its own account)."""
        group = self._group
        if self._aborted:
            reason, who, rank = self._aborted, "the backend", None
        if now:
            launcher.kill(group)
        launcher.wait_exit(group, 0.0 if now else DEATH_REPORT_S)  # let torchrun write its account of the failure
        silent = self._silent_machine() if who is None else None
        if silent is not None:
            rank, who, reason = silent
        elif who is None:
            found, who, cause = self._died()
            reason = cause or reason
            rank = found if rank is None else rank
            if rank is not None and found != rank:
                who = f"rank {rank} (pid {self._pids.get(rank)})"
        tb = tb or (group.traceback_of(rank) if rank is not None else "")
        tail = group.log_tail(rank)
        self._teardown(grace=0.0 if now else 5.0)
        detail = f"\n{tb.strip().splitlines()[-1]}" if tb.strip() else ""
        return BackendDied(
            f"the parallel backend failed: {who} {reason}; it was shut down and the next run starts a "
            f"fresh one.{detail}",
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
        timeout: float | None = None,
    ) -> CallResult:
        """Run the op ``args`` names on the backend (starting it if needed) and return its result.

        ``on_progress(step, total, text)`` is called for each progress event; if it raises, the op is cancelled on
        every rank and the exception re-raised once the ranks have stopped. ``should_cancel`` is polled while
        waiting. The watchdog's deadlines bound every wait; ``timeout`` bounds the whole call too. Raises OpFailed,
        Cancelled, BackendDied or DeadlineExceeded.
        """
        global _last_error
        with self._lock:
            try:
                result = self._call(args, tensors, on_progress, should_cancel, timeout)
            except (BackendDied, BackendStartError, DeadlineExceeded, OpFailed) as e:
                _last_error = {
                    "op": args.op,
                    "type": type(e).__name__,
                    "message": str(e),
                    "rank": getattr(e, "rank", None),
                    "time": time.time(),
                }
                raise
            # The panel shows the error as past once work has succeeded after it (its own status polls do not count).
            if _last_error is not None and "succeeded_since" not in _last_error and not isinstance(args, StatusArgs):
                _last_error = {**_last_error, "succeeded_since": time.time()}
            return result

    def _call(
        self,
        args: OpArgs,
        tensors: dict[str, torch.Tensor] | None,
        on_progress: ProgressFn | None,
        should_cancel: Callable[[], bool] | None,
        timeout: float | None,
    ) -> CallResult:
        if self._group is None:
            self._start()
        call_id = f"c{next(self._ids)}"
        self._follow_memory_cgroups()
        descs = self._arena.write(tensors or {})
        self._watchdog = Watchdog(self._group, self.deadlines)
        self._current_call = call_id
        try:
            self._channel.send(Call(id=call_id, op=args.op, args=to_json(args), tensors=descs))
            deadline = None if timeout is None else time.monotonic() + timeout
            return self._wait(args, call_id, on_progress, should_cancel, deadline)
        except (OSError, ChannelClosed) as e:
            raise self._die(f"closed the control connection ({e})") from None
        finally:
            self._current_call, self._watchdog = None, None

    def cancel(self) -> None:
        """Ask every rank to stop the running call at its next step boundary (any thread may call this)."""
        call_id, channel, watchdog = self._current_call, self._channel, self._watchdog
        if call_id is not None and channel is not None:
            if watchdog is not None:
                watchdog.cancelled()
            try:
                channel.send(Cancel(id=call_id))
            except OSError:
                pass

    def _check_health(self, call_id: str, pending: BaseException | None, deadline: float | None) -> None:
        """Raise when the group ended, hangs, or the call ran past its own deadline."""
        if self._look() is not None:
            raise self._die("exited")
        hang = self._watchdog.check()
        if hang is not None:
            error = self._die(hang.reason, rank=hang.rank, who=hang.who, now=True)
            if hang.cancelled or isinstance(pending, Cancelled):
                raise Cancelled(f"cancelled, but {error}", steps_by_rank=[]) from None
            raise error
        if deadline is not None and time.monotonic() > deadline:
            raise DeadlineExceeded(
                f"op {call_id} ran past its deadline; the backend was shut down. "
                f"{self._die('was still running at the deadline', now=True)}"
            )

    def _wait(
        self,
        args: OpArgs,
        call_id: str,
        on_progress: ProgressFn | None,
        should_cancel: Callable[[], bool] | None,
        deadline: float | None,
    ) -> CallResult:
        pending_exc: BaseException | None = None
        next_health_check = 0.0
        while True:
            try:
                msg = self._channel.recv(POLL_S)
            except BadFrame as e:
                log.warning("ignored a control frame from rank 0: %s", e)
                continue
            if pending_exc is None and should_cancel is not None and should_cancel():
                pending_exc = Cancelled("cancelled by the user", steps_by_rank=[])
                self.cancel()
            # On schedule whatever the traffic: a stopped agent does not stop the ranks' progress events.
            if time.monotonic() >= next_health_check:
                next_health_check = time.monotonic() + HEALTH_S
                self._check_health(call_id, pending_exc, deadline)
            if msg is None:
                continue
            if getattr(msg, "id", None) not in (call_id, None):
                continue  # a late event of an earlier, abandoned call
            if isinstance(msg, Progress):
                self._watchdog.progress(msg.step, msg.text)
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
                raise Cancelled(
                    f"cancelled at step {msg.steps_by_rank[0]}",
                    steps_by_rank=list(msg.steps_by_rank),
                    reached_at_step=msg.reached_at_step,
                )
            elif isinstance(msg, Error):
                if pending_exc is not None:
                    raise pending_exc
                if msg.widget is not None:  # a request the ranks found cannot work, before loading anything
                    raise InvalidInput(msg.widget, f"{msg.message} (rank {msg.rank})")
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

    def gpu_uuids(self) -> tuple[str, ...]:
        """UUIDs of the GPUs the ranks on this machine see (rank 0 sees every one of them); starts the backend if
        needed. Asked once per group: which GPUs a group sees never changes."""
        with self._lock:
            if self._gpus is None:
                self._gpus = self.status().ranks[0].gpus
            return self._gpus

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
        if self.spec.nnodes > 1:
            # What to run on the other machines, without the secret: this view goes to every client of ComfyUI's port
            # (GET /parallel_diffusers/status, the status broadcast); the host's own browser asks for the secret
            # (POST /parallel_diffusers/join, parallel_nodes/routes.py).
            view["join"] = machines.join_commands(self.spec.rdzv_endpoint, self.spec.nnodes)
            view["join_secret"] = machines.where_the_secret_is()
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
# The last failure of any backend, for the status panel: op, type, message, rank, time, and succeeded_since (when an op
# first succeeded after it).
_last_error: dict | None = None


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
