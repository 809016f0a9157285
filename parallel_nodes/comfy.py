"""Where the nodes meet ComfyUI's runtime: its progress bar and node text, its Cancel, its errors, and its
validation of a queued prompt (VALIDATE_INPUTS).

All of it is optional, so the nodes also run as plain Python (the demo, the tests) where ComfyUI is absent.
"""
from __future__ import annotations

import contextvars
import inspect
import logging
from collections.abc import Callable
from typing import TypeVar

from parallel_runtime import BackendDied, Cancelled, InvalidInput, OpFailed

T = TypeVar("T")
log = logging.getLogger("parallel_nodes")

try:
    import comfy.model_management as _mm
    import comfy.utils as _utils
except ImportError:
    _mm = _utils = None
try:
    from server import PromptServer
except ImportError:
    PromptServer = None


# The hidden input every node of the pack declares: ComfyUI passes the node's id, which its progress text and its
# VALIDATE_INPUTS need.
HIDDEN = {"unique_id": "UNIQUE_ID"}


def _server():
    return getattr(PromptServer, "instance", None)


class _Progress:
    """One op's progress events on its node: ComfyUI's bar, the stage as text on the node, and the user's Cancel.

    The backend labels its stages ("loading transformer", "decoding", ...); the denoising loop's steps come
    unlabelled and fill the bar.
    """

    def __init__(self, unique_id: str | None):
        self.unique_id = unique_id
        self.bars: dict[int, object] = {}
        self.text: str | None = None
        self.step = 0
        self.shown: tuple[int, int] | None = None  # the bar's last (step, total)
        self.cancel_asked_at: int | None = None

    def __call__(self, step: int, total: int, text: str | None) -> None:
        self.step = step
        self._show(text or ("denoising" if step else None))
        if total not in self.bars:  # stages report on their own scales (load: 1, denoise: steps)
            self.bars[total] = _utils.ProgressBar(total)
        try:
            if self.shown != (step, total):  # a stage's closing label ("denoised") moves no bar
                self.bars[total].update_absolute(step, total)  # ComfyUI's hook raises on Cancel
                self.shown = (step, total)
            _mm.throw_exception_if_processing_interrupted()
        except _mm.InterruptProcessingException:
            # Raised as Cancelled, the client answers with the step every rank stopped at; run() turns it back into
            # ComfyUI's interrupt.
            self.cancel_asked_at = step
            raise Cancelled("cancelled by the user", steps_by_rank=[]) from None

    def _show(self, text: str | None) -> None:
        server = _server()
        if not text or text == self.text or self.unique_id is None or server is None:
            return
        self.text = text
        if hasattr(server, "send_progress_text"):  # ComfyUI 0.3.75 and later
            server.send_progress_text(text, self.unique_id, server.client_id)


def interrupted() -> bool:
    return _mm is not None and _mm.processing_interrupted()


def run(call: Callable[..., T], *, unique_id: str | None = None, **kwargs) -> T:
    """``call(**kwargs, on_progress=..., should_cancel=...)`` for the node ``unique_id``; a cancel becomes
    ComfyUI's interrupt, a rank's failure an error that carries that rank's traceback.

    ComfyUI's InterruptProcessingException (a BaseException, raised by its progress hook) travels through the client
    as Cancelled: the client cancels the op on every rank, waits until they have stopped and says at which step;
    here it becomes InterruptProcessingException again, so ComfyUI always gets its interrupt, never swallowed.
    """
    progress = _Progress(unique_id) if _utils is not None else None
    try:
        return call(**kwargs, on_progress=progress, should_cancel=interrupted)
    except Cancelled as e:
        if progress is not None:  # where the Cancel landed, for the log (and the tests)
            log.info("parallel_diffusers: cancel asked at step %d; the ranks stopped at steps %s",
                     progress.cancel_asked_at or progress.step, e.steps_by_rank)
        if _mm is not None:
            raise _mm.InterruptProcessingException() from None
        raise
    except (OpFailed, BackendDied) as e:
        # ComfyUI shows the message and its own (client-side) traceback: the rank's account goes into the message.
        details = (e.traceback or getattr(e, "log_tail", "")).rstrip()
        if details:
            e.args = (f"{e}\n\n--- rank {e.rank if e.rank is not None else '?'} ---\n{details}",)
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


# -- VALIDATE_INPUTS ----------------------------------------------------------------------------------------------
# ComfyUI (0.3.75 and 0.26) hands VALIDATE_INPUTS the node's constant widget values only: linked inputs arrive as
# None and the hidden PROMPT as {}. Checks that span nodes (the ranks of the ParallelBackend that feeds
# LoadShardedTransformer; the strategy that feeds ParallelSampler) read the prompt being queued instead: an
# on_prompt handler keeps it for the request, which validates it next in the same asyncio task. Declaring a widget
# as an argument of VALIDATE_INPUTS would switch off ComfyUI's own min/max/list checks of that widget, so the nodes
# declare only the hidden unique_id and read their widgets from the prompt as well.
_queued: contextvars.ContextVar[dict | None] = contextvars.ContextVar("parallel_diffusers_queued", default=None)


def _keep_queued_prompt(json_data: dict) -> dict:
    _queued.set(json_data)
    return json_data


if _server() is not None:
    _server().add_on_prompt_handler(_keep_queued_prompt)


class Unknown(Exception):
    """A value only execution will know (a link from a node that has to run first): the check that needs it is
    skipped at validation and made at execution."""


def _is_link(value: object) -> bool:
    return isinstance(value, list) and len(value) == 2


def _comfy_refuses(options: tuple, value: object) -> bool:
    """ComfyUI's own checks (value in the list, min/max) refuse it and say so: no second message from us."""
    kind, extra = options[0], (options[1] if len(options) > 1 else None) or {}
    if isinstance(kind, list):
        return value not in kind
    try:
        return value < extra.get("min", value) or value > extra.get("max", value)
    except TypeError:
        return True


class QueuedNode:
    """One of the pack's nodes in the prompt being queued, with its values as execution will see them."""

    def __init__(self, prompt: dict, node_id: str):
        from . import NODE_CLASS_MAPPINGS  # here: the package imports this module first

        node = prompt.get(node_id)
        self.cls = NODE_CLASS_MAPPINGS.get(node.get("class_type")) if isinstance(node, dict) else None
        if self.cls is None:
            raise Unknown(node_id)  # not one of ours: only execution knows what it makes
        self.prompt, self.node_id, self.inputs = prompt, node_id, node.get("inputs") or {}
        types = self.cls.INPUT_TYPES()
        self.options = {**types.get("required", {}), **types.get("optional", {})}

    def _value(self, name: str) -> object:
        """The prompt's value of an input, or the node function's default when it is left out."""
        if name in self.inputs:
            return self.inputs[name]
        default = inspect.signature(getattr(self.cls, self.cls.FUNCTION)).parameters[name].default
        if default is inspect.Parameter.empty:
            raise Unknown(name)  # a required input is missing: ComfyUI says so
        return default

    def widgets(self, *names: str) -> dict:
        """The named widgets' values; Unknown when one is linked or refused by ComfyUI's own checks."""
        values = {name: self._value(name) for name in names}
        for name, value in values.items():
            if _is_link(value) or (name in self.inputs and _comfy_refuses(self.options[name], value)):
                raise Unknown(name)
        return values

    def source(self, name: str) -> QueuedNode:
        """The node linked to an input, to read its widgets (Unknown when the input is not a link to one of ours)."""
        value = self._value(name)
        if not _is_link(value):
            raise Unknown(name)
        return QueuedNode(self.prompt, str(value[0]))

    def input(self, name: str) -> object:
        """What arrives on an input: computed when it comes from a node that loads nothing (LOADS_NOTHING)."""
        value = self._value(name)
        if not _is_link(value):
            return value
        source = self.source(name)
        if not getattr(source.cls, "LOADS_NOTHING", False):
            raise Unknown(name)
        try:
            return source.run()[value[1]]
        except InvalidInput:
            raise Unknown(name) from None  # that node's own validation reports it

    def run(self) -> tuple:
        """The node's function on the prompt's values: only for nodes that load nothing."""
        if not getattr(self.cls, "LOADS_NOTHING", False):
            raise TypeError(f"{self.cls.__name__} does work when it runs; validation must not run it")
        present = [name for name in self.options if name in self.inputs]
        kwargs = {name: self.input(name) for name in present if _is_link(self.inputs[name])}
        kwargs.update(self.widgets(*(name for name in present if name not in kwargs)))
        return getattr(self.cls(), self.cls.FUNCTION)(**kwargs)


def validate(unique_id: str, check: Callable[[QueuedNode], object]) -> bool | str:
    """What a node's VALIDATE_INPUTS returns: True, or the text of the InvalidInput that ``check(node)`` raised
    (it names the widget and the fix; ComfyUI answers the POST /prompt with a 400 naming the node).

    A check that needs a value only execution knows is skipped here; the node makes every check again when it runs.
    """
    json_data = _queued.get()
    prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
    if not isinstance(prompt, dict) or str(unique_id) not in prompt:
        return True
    try:
        check(QueuedNode(prompt, str(unique_id)))
    except Unknown:
        return True
    except InvalidInput as e:
        return str(e)
    return True
