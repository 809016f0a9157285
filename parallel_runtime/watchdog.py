"""When a running call is hung: the client's watchdog over one call, so that no wait lasts forever.

Three signs, each with its own deadline (``Deadlines``), checked while the client waits for a reply:

- a process of the group (the torchrun agent, a rank) is *stopped* (SIGSTOP, a debugger) for longer than
  ``stopped_s``: that process is named;
- a rank's heartbeat (``rundir``: a file the rank renews every second from a thread of its own) is older than
  ``heartbeat_s``: the rank is frozen or gone, and is named. A rank that computes, loads weights or waits in a
  collective keeps beating, so a slow but healthy run never trips this;
- the op makes no progress: before its first denoising step (loading weights, the first step, or a whole op without
  steps) within ``load_s``; once it has made two steps, within max(``stall_floor_s``, ``stall_factor`` × the slowest
  step so far). Every process alive and beating but no step: a collective is stuck (on GPUs, NCCL).

After a cancel the ranks get max(``cancel_s``, 3 × the slowest step) to stop at a step boundary.
"""

from __future__ import annotations

import dataclasses
import os
import time

from .launcher import LaunchedGroup
from .processes import process_state

COLLECTIVE_MARGIN_S = 60.0


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(f"COMFY_PARALLEL_{name.upper()}")
    return float(value) if value else default


@dataclasses.dataclass(frozen=True)
class Deadlines:
    """How long the client waits for each sign of life before it calls the backend hung.

    Args:
        load_s: before an op's first denoising step: loading weights (minutes for real models), the first step, or a
            whole op that reports no steps (encode, decode, status).
        stall_floor_s, stall_factor: once a denoise has made two steps, a pause longer than
            max(stall_floor_s, stall_factor × its slowest step so far) is a hang.
        heartbeat_s: a rank whose heartbeat is older than this has stopped responding.
        stopped_s: a process of the group stopped (state T) this long has stopped responding.
        cancel_s: after a cancel, the ranks get max(cancel_s, 3 × the slowest step) to stop.

    ``from_env`` reads ``COMFY_PARALLEL_LOAD_S``, ``COMFY_PARALLEL_STALL_FLOOR_S``, ``COMFY_PARALLEL_HEARTBEAT_S``,
    ``COMFY_PARALLEL_STOPPED_S`` and ``COMFY_PARALLEL_CANCEL_S`` over these defaults.
    """

    load_s: float = 1800.0
    stall_floor_s: float = 60.0
    stall_factor: float = 20.0
    heartbeat_s: float = 30.0
    stopped_s: float = 5.0
    cancel_s: float = 15.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"{field.name} must be a positive number of seconds, got {getattr(self, field.name)}")

    @property
    def collective_s(self) -> float:
        """How long one collective of the ranks may wait before torch gives up on it (the process group's timeout).
        Longer than the watchdog's own deadlines, so the watchdog, which names what stopped, always acts first (the
        rank that loads weights slowest keeps the others waiting in the next collective for up to ``load_s``); short
        enough that ranks whose client is gone never sit in NCCL for hours."""
        return max(self.load_s, self.stall_floor_s) + COLLECTIVE_MARGIN_S

    @classmethod
    def from_env(cls) -> Deadlines:
        return cls(**{f.name: _seconds(f.name, f.default) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class Hang:
    """What the watchdog found: who stopped responding (None: no one in particular) and why."""

    rank: int | None
    who: str
    reason: str
    cancelled: bool = False


class Watchdog:
    """The deadlines of one call on ``group``."""

    def __init__(self, group: LaunchedGroup, deadlines: Deadlines, now: float | None = None):
        self.group = group
        self.deadlines = deadlines
        self.last_event = time.monotonic() if now is None else now
        self.steps_seen = 0
        self.last_step_at: float | None = None
        self.slowest_step = 0.0
        self.cancel_asked_at: float | None = None
        self._stopped_since: dict[int, float] = {}

    def progress(self, step: int, text: str | None, now: float | None = None) -> None:
        """A progress event arrived: ``step`` ≥ 1 without a stage label is a denoising step."""
        now = time.monotonic() if now is None else now
        if step >= 1 and text is None:
            if self.last_step_at is not None:
                self.slowest_step = max(self.slowest_step, now - self.last_step_at)
            self.last_step_at = now
            self.steps_seen += 1
        self.last_event = now

    def cancelled(self, now: float | None = None) -> None:
        if self.cancel_asked_at is None:
            self.cancel_asked_at = time.monotonic() if now is None else now

    def progress_deadline(self) -> float:
        """Seconds the op may go from its last event to the next."""
        if self.steps_seen < 2:
            return self.deadlines.load_s
        return max(self.deadlines.stall_floor_s, self.deadlines.stall_factor * self.slowest_step)

    def _processes(self) -> dict[int | None, int]:
        """Rank (None: the torchrun agent) → pid, for this machine's processes of the group."""
        return {None: self.group.proc.pid, **self.group.worker_pids()}

    def check(self, now: float | None = None) -> Hang | None:
        now = time.monotonic() if now is None else now
        for rank, pid in self._processes().items():
            who = f"rank {rank} (pid {pid})" if rank is not None else f"the torchrun agent (pid {pid})"
            if process_state(pid) == "T":
                since = self._stopped_since.setdefault(pid, now)
                if now - since > self.deadlines.stopped_s:
                    stopped = f"is stopped (SIGSTOP or a debugger) and has not run for {now - since:.0f} s"
                    return Hang(rank, who, stopped)
            else:
                self._stopped_since.pop(pid, None)
        for rank, age in sorted(self.group.run_dir.heartbeat_ages(time.time()).items()):
            if age > self.deadlines.heartbeat_s:
                return Hang(rank, self.group.describe(rank), f"stopped responding: no heartbeat for {age:.0f} s")
        if self.cancel_asked_at is not None:
            allowed = max(self.deadlines.cancel_s, 3 * self.slowest_step)
            if now - self.cancel_asked_at > allowed:
                return Hang(None, "the ranks", f"did not stop within {allowed:.0f} s of the cancel", cancelled=True)
        idle, allowed = now - self.last_event, self.progress_deadline()
        if idle > allowed:
            made = (
                f"after {self.steps_seen} steps (the slowest took {self.slowest_step:.1f} s)"
                if self.steps_seen >= 2
                else "before its first steps"
            )
            return Hang(
                None,
                "the ranks",
                f"made no progress for {idle:.0f} s {made}, although every process is "
                "alive: a collective is probably stuck (on GPUs: NCCL)",
            )
        return None
