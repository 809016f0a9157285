"""The two places the nodes meet ComfyUI's runtime: its progress bar and its interrupt.

Both are optional, so the nodes also run as plain Python (the demo, the tests) where ComfyUI is absent.
"""
from __future__ import annotations

from typing import Callable, TypeVar

from parallel_runtime import Cancelled

T = TypeVar("T")

try:
    import comfy.model_management as _mm
    import comfy.utils as _utils
except ImportError:
    _mm = _utils = None


def progress_bar() -> Callable[[int, int, "str | None"], None] | None:
    """A progress callback driving ComfyUI's bar for the running node (None outside ComfyUI)."""
    if _utils is None:
        return None
    bars: dict[int, object] = {}

    def on_progress(step: int, total: int, text: str | None) -> None:
        if total not in bars:  # stages report on their own scales (load: 1, denoise: steps)
            bars[total] = _utils.ProgressBar(total)
        bars[total].update_absolute(step, total)
        _mm.throw_exception_if_processing_interrupted()

    return on_progress


def interrupted() -> bool:
    return _mm is not None and _mm.processing_interrupted()


def run(call: Callable[..., T], **kwargs) -> T:
    """``call(**kwargs, on_progress=..., should_cancel=...)``; a cancel becomes ComfyUI's interrupt.

    ComfyUI's InterruptProcessingException is a BaseException raised from the progress callback; the client
    cancels the op on every rank and re-raises it once they have stopped, so it reaches ComfyUI untouched.
    """
    try:
        return call(**kwargs, on_progress=progress_bar(), should_cancel=interrupted)
    except Cancelled:
        if _mm is not None:
            raise _mm.InterruptProcessingException() from None
        raise
    finally:
        _push_status()


def _push_status() -> None:
    """Refresh the backend status panel, when running inside ComfyUI's server."""
    try:
        from .routes import push_status
    except ImportError:
        return
    push_status()
