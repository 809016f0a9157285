"""Errors the client raises. Each says what happened and, where there is one, what to do about it."""

from __future__ import annotations


class ParallelRuntimeError(RuntimeError):
    """Base class of every error the parallel backend reports."""


class BackendStartError(ParallelRuntimeError):
    """The backend did not come up; the message carries the launcher's and the ranks' log tails."""


class BackendDied(ParallelRuntimeError):
    """A rank died (or the group could not go on); the whole group was torn down.

    The next call starts a fresh backend. ``rank`` is the first rank seen to fail (None when unknown),
    ``log_tail`` the end of that rank's log, ``traceback`` its Python traceback when it left one.
    """

    def __init__(self, message: str, *, rank: int | None = None, log_tail: str = "", traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.log_tail = log_tail
        self.traceback = traceback


class OpFailed(ParallelRuntimeError):
    """An op raised on a rank (``rank``; None when rank 0 refused the call before any rank ran it), every rank got back
    in step, and the backend is still usable."""

    def __init__(self, message: str, *, rank: int | None, error_type: str, traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type
        self.traceback = traceback


class Cancelled(ParallelRuntimeError):
    """The op was cancelled; every rank stopped at the same step boundary (``steps_by_rank``), there or one step after
    the step rank 0 had reported when the cancel reached it (``reached_at_step``, None if it never did)."""

    def __init__(self, message: str, *, steps_by_rank: list[int | None], reached_at_step: int | None = None):
        super().__init__(message)
        self.steps_by_rank = steps_by_rank
        self.reached_at_step = reached_at_step


class DeadlineExceeded(ParallelRuntimeError):
    """A wait ran past its deadline; the backend was torn down so that nothing is left hanging."""


class Refused(ParallelRuntimeError):
    """The backend refused the connection (wrong token)."""


class InvalidInput(ValueError):
    """A widget value that cannot work, caught before anything loads. The message names the widget and the fix."""

    def __init__(self, widget: str, message: str):
        super().__init__(f"{widget}: {message}")
        self.widget = widget
