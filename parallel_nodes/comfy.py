"""Where the nodes meet ComfyUI's runtime: its progress bar and node text, its Cancel, its errors, its own models on a
device the backend computes on (``make_room``), the schema defaults of inputs a prompt leaves out, and its validation
of a queued prompt (``validate_inputs``).

ComfyUI's runtime modules (``comfy.model_management``, ``comfy.utils``, ``server``) are used only once ComfyUI itself
has loaded them (``sys.modules``): the pack never imports them, so the nodes also run outside a ComfyUI server (their
tests), where importing ``comfy.model_management`` would try to initialise a GPU.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from comfy_api.latest import io

import parallel_runtime
from parallel_runtime import BackendDied, BackendSpec, Cancelled, InvalidInput, OpFailed, get_backend
from parallel_runtime.client import last_error

T = TypeVar("T")

# The pack's nodes by node id, for reading the prompt being queued. The package fills it once it has imported them:
# this module cannot import them, since they import it.
NODES_BY_ID: dict[str, type[io.ComfyNode]] = {}
# The event that pushes the status panel a fresh status after every node run (web/parallel_diffusers.js listens).
STATUS_EVENT = "parallel_diffusers.status"
log = logging.getLogger("parallel_nodes")


def _loaded(module: str) -> Any:
    return sys.modules.get(module)


def _server() -> Any:
    server = _loaded("server")
    return getattr(getattr(server, "PromptServer", None), "instance", None)


def snapshot() -> dict:
    """The backend's status as the panel and ``GET /parallel_diffusers/status`` show it."""
    backend = parallel_runtime.current_backend()
    if backend is None:
        return {"running": False, "busy": False, "spec": None, "last_error": last_error()}
    return backend.snapshot()


def push_status() -> None:
    """Send the panel a fresh status (from the node's thread; send_sync is thread-safe)."""
    _server().send_sync(STATUS_EVENT, snapshot())


def unique_id(node: type[io.ComfyNode]) -> str | None:
    """The node's id in the running prompt (ComfyUI's hidden input), or None outside ComfyUI's execution."""
    hidden = getattr(node, "hidden", None)
    return getattr(hidden, "unique_id", None) if hidden is not None else None


def with_defaults(node: type[io.ComfyNode], given: dict[str, Any]) -> dict[str, Any]:
    """The node's inputs with the schema's defaults for those the prompt leaves out (an API prompt may omit optional
    widgets): the schema is the one place a default is written."""
    schema = node.define_schema()
    return {**{i.id: getattr(i, "default", None) for i in schema.inputs}, **given}


def execution_inputs(node: type[io.ComfyNode], given: dict[str, Any]) -> dict[str, Any]:
    """What a node's execute works with: its inputs with the schema's defaults (``with_defaults``), each number in
    its range (``check_ranges``: a value linked from another node is not checked by ComfyUI)."""
    values = with_defaults(node, given)
    check_ranges(node, values)
    return values


def check_ranges(node: type[io.ComfyNode], values: dict[str, Any]) -> None:
    """At execution, each number within its input's min..max. ComfyUI checks a widget's own value when the prompt is
    queued, but not a value linked into it from another node (a primitive, a seed generator): that is refused here,
    by the widget's name, as ComfyUI would refuse it typed in."""
    for spec in node.define_schema().inputs:
        value = values.get(spec.id)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        low, high = getattr(spec, "min", None), getattr(spec, "max", None)
        if (low is not None and value < low) or (high is not None and value > high):
            raise InvalidInput(spec.id, f"{value} is outside {low}..{high}; link or set a value in that range")


class _Progress:
    """One op's progress events on its node: ComfyUI's bar, the stage as text on the node, and the user's Cancel.

    The backend labels its stages ("loading transformer", "decoding", ...); the denoising loop's steps come
    unlabelled and fill the bar.
    """

    def __init__(self, node_id: str | None, utils: Any, mm: Any):
        self.node_id = node_id
        self.utils, self.mm = utils, mm
        self.bars: dict[int, Any] = {}
        self.text: str | None = None
        self.step = 0
        self.shown: tuple[int, int] | None = None  # the bar's last (step, total)
        self.cancel_asked_at: int | None = None

    def __call__(self, step: int, total: int, text: str | None) -> None:
        self.step = step
        self._show(text or ("denoising" if step else None))
        if total not in self.bars:  # stages report on their own scales (load: 1, denoise: steps)
            self.bars[total] = self.utils.ProgressBar(total)
        try:
            if self.shown != (step, total):  # a stage's closing label ("denoised") moves no bar
                self.bars[total].update_absolute(step, total)  # ComfyUI's hook raises on Cancel
                self.shown = (step, total)
            self.mm.throw_exception_if_processing_interrupted()
        except self.mm.InterruptProcessingException:
            # Raised as Cancelled, the client answers with the step every rank stopped at; run() turns it back into
            # ComfyUI's interrupt.
            self.cancel_asked_at = step
            raise Cancelled("cancelled by the user", steps_by_rank=[]) from None

    def _show(self, text: str | None) -> None:
        server = _server()
        if not text or text == self.text or self.node_id is None or server is None:
            return
        self.text = text
        if hasattr(server, "send_progress_text"):  # ComfyUI 0.3.75 and later
            server.send_progress_text(text, self.node_id, server.client_id)


def _shared_devices(mm: Any, spec: BackendSpec, device: str | None) -> list[Any]:
    """ComfyUI's GPUs that a backend op runs on (by UUID: the backend numbers its GPUs its own way). ``device``: the
    one device the op uses ("cuda:1", "cpu"), or None for all of the backend's. None on the CPU: ComfyUI's models
    there are its host copies, which unloading would not free."""
    import torch

    kind = torch.device(device).type if device else spec.device
    if kind != "cuda" or spec.device != "cuda":
        return []
    devices = mm.get_all_torch_devices() if hasattr(mm, "get_all_torch_devices") else [mm.get_torch_device()]
    gpus = get_backend(spec).gpu_uuids()
    if device is not None and torch.device(device).index is not None:
        gpus = gpus[torch.device(device).index : torch.device(device).index + 1]
    return [d for d in devices if d.type == "cuda" and str(torch.cuda.get_device_properties(d).uuid) in gpus]


def make_room(node: type[io.ComfyNode], spec: BackendSpec, device: str | None = None) -> None:
    """Before a backend op: free ComfyUI's own loaded models on the devices the op computes on, the way ComfyUI's
    nodes make room (``free_memory`` everything there, then ``soft_empty_cache``), so that a model ComfyUI holds and
    the backend's rank 0 do not run a shared GPU out of memory. Off when the ParallelBackend's ``free_comfyui_vram``
    is. Outside a ComfyUI server (ComfyUI's model management not loaded) there is nothing to free."""
    mm = _loaded("comfy.model_management")
    if mm is None or not spec.free_comfyui_vram:
        return
    for shared in _shared_devices(mm, spec, device):
        held = [m for m in mm.current_loaded_models if m.device == shared]
        if not held:
            continue
        size = sum(m.model_loaded_memory() for m in held)
        mm.free_memory(1e30, shared)
        mm.soft_empty_cache()
        left = sum(1 for m in mm.current_loaded_models if m.device == shared)
        show_text(
            node,
            f"freed {len(held) - left} of ComfyUI's models on {shared} ({size / 2**30:.2f} GiB) for the parallel "
            "backend (free_comfyui_vram on ParallelBackend)",
        )


def show_text(node: type[io.ComfyNode], text: str) -> None:
    """``text`` on the node in the browser (ComfyUI's progress text), and in the log; nothing more outside a server's
    execution (validation runs nodes that load nothing, without an id)."""
    log.info("parallel_diffusers: %s", text)
    server, node_id = _server(), unique_id(node)
    if server is not None and node_id is not None and hasattr(server, "send_progress_text"):  # ComfyUI 0.3.75 on
        server.send_progress_text(text, node_id, server.client_id)


def run(node: type[io.ComfyNode], call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call(*args, **kwargs, on_progress=..., should_cancel=...)`` for ``node``: progress on its bar and text, a
    cancel becomes ComfyUI's interrupt, a rank's failure an error that carries that rank's traceback.

    ComfyUI's InterruptProcessingException (a BaseException, raised by its progress hook) travels through the client
    as Cancelled: the client cancels the op on every rank, waits until they have stopped and says at which step;
    here it becomes InterruptProcessingException again, so ComfyUI always gets its interrupt, never swallowed.
    """
    mm, utils = _loaded("comfy.model_management"), _loaded("comfy.utils")
    progress = _Progress(unique_id(node), utils, mm) if mm is not None and utils is not None else None
    interrupted = (lambda: mm.processing_interrupted()) if mm is not None else (lambda: False)
    try:
        return call(*args, **kwargs, on_progress=progress, should_cancel=interrupted)
    except Cancelled as e:
        if progress is not None:  # where the Cancel landed, for the log (and the tests)
            log.info(
                "parallel_diffusers: cancel asked at step %d, reached the ranks at step %s; "
                "the ranks stopped at steps %s",
                progress.cancel_asked_at or progress.step,
                e.reached_at_step,
                e.steps_by_rank,
            )
        if mm is not None:
            raise mm.InterruptProcessingException() from None
        raise
    except (OpFailed, BackendDied) as e:
        # ComfyUI shows the message and its own (client-side) traceback: the rank's account goes into the message.
        details = (e.traceback or getattr(e, "log_tail", "")).rstrip()
        if details:
            e.args = (f"{e}\n\n--- rank {e.rank if e.rank is not None else '?'} ---\n{details}",)
        raise
    finally:
        if _server() is not None:
            push_status()


# -- validate_inputs --------------------------------------------------------------------------------------------
# ComfyUI (0.3.75 and 0.26) hands validate_inputs the node's constant inputs only: linked inputs arrive as None and the
# hidden prompt as {}. Checks that span nodes (the ranks of the ParallelBackend that feeds LoadShardedTransformer; the
# strategy that feeds ParallelSampler) read the prompt being queued instead: an on_prompt handler keeps it for the
# request, which validates it next in the same asyncio task. Declaring a widget as an argument of validate_inputs
# would switch off ComfyUI's own min/max/list checks of that widget, so the nodes declare only ``input_types`` (which
# makes ComfyUI call them, and hands them the types linked into them) and read their widgets from the prompt as well.
# ``input_types`` also switches off ComfyUI's check that a link's type fits its input: ``validate`` makes it.
_queued: contextvars.ContextVar[dict | None] = contextvars.ContextVar("parallel_diffusers_queued", default=None)


def keep_queued_prompt(json_data: dict) -> dict:
    """ComfyUI's on_prompt handler: remember the prompt being queued for the validation that follows."""
    _queued.set(json_data)
    return json_data


class Unknown(Exception):
    """A value only execution will know (a link from a node that has to run first): the check that needs it is
    skipped at validation and made at execution."""


def is_link(value: object) -> bool:
    """Whether a prompt's input value is a link ``[node id, output slot]``."""
    return isinstance(value, list) and len(value) == 2


# ComfyUI checks a V3 combo's value against its options since the change that also put DynamicCombo into comfy_api's io
# (0.7, December 2025). Older ones (0.3.75, CI's host) do not, so there validate() makes that check itself.
COMFY_CHECKS_COMBOS = hasattr(io, "DynamicCombo")


def _comfy_refuses(options: tuple, value: object) -> bool:
    """ComfyUI's own checks (value in the list, min/max) refuse it and say so: no second message from us."""
    kind, extra = options[0], (options[1] if len(options) > 1 else None) or {}
    if kind == io.Combo.io_type:
        return value not in extra.get("options", [])
    try:
        return value < extra.get("min", value) or value > extra.get("max", value)
    except TypeError:
        return True


class QueuedNode:
    """One of the pack's nodes in the prompt being queued, with its values as execution will see them."""

    def __init__(self, prompt: dict, node_id: str):
        node = prompt.get(node_id)
        self.cls = NODES_BY_ID.get(node.get("class_type")) if isinstance(node, dict) else None
        if self.cls is None:
            raise Unknown(node_id)  # not one of ours: only execution knows what it makes
        self.prompt, self.node_id = prompt, node_id
        self.inputs = with_defaults(self.cls, node.get("inputs") or {})
        types = self.cls.INPUT_TYPES()
        self.options = {**types.get("required", {}), **types.get("optional", {})}
        self.given = set(node.get("inputs") or {})

    def check_combos(self) -> None:
        """On a ComfyUI that does not check V3 combos: every combo value the prompt gives is one of its options."""
        for name in self.given:
            kind, extra = self.options[name][0], (self.options[name][1:] or [{}])[0] or {}
            value, choices = self.inputs[name], extra.get("options", [])
            if kind == io.Combo.io_type and not is_link(value) and value not in choices:
                shown = ", ".join(map(repr, choices[:8])) + (", ..." if len(choices) > 8 else "")
                raise InvalidInput(
                    name, f"{value!r} is not one of the choices ({shown or 'none'}); pick one from the list"
                )

    def widgets(self, *names: str) -> dict:
        """The named widgets' values; Unknown when one is linked or refused by ComfyUI's own checks."""
        values = {name: self.inputs.get(name) for name in names}
        for name, value in values.items():
            if is_link(value) or (name in self.given and _comfy_refuses(self.options[name], value)):
                raise Unknown(name)
        return values

    def linked(self, name: str) -> bool:
        """Whether an input is a link (its value comes from another node)."""
        return is_link(self.inputs.get(name))

    def source(self, name: str) -> QueuedNode:
        """The node linked to an input, to read its widgets (Unknown when the input is not a link to one of ours)."""
        value = self.inputs.get(name)
        if not is_link(value):
            raise Unknown(name)
        return QueuedNode(self.prompt, str(value[0]))

    def input(self, name: str) -> object:
        """What arrives on an input: computed when it comes from a node that loads nothing (LOADS_NOTHING)."""
        value = self.inputs.get(name)
        if not is_link(value):
            return value
        source = self.source(name)
        if not getattr(source.cls, "LOADS_NOTHING", False):
            raise Unknown(name)
        try:
            return source.run()[value[1]]
        except InvalidInput:
            raise Unknown(name) from None  # that node's own validation reports it

    def run(self) -> tuple:
        """The node's execute on the prompt's values: only for nodes that load nothing."""
        if not getattr(self.cls, "LOADS_NOTHING", False):
            raise TypeError(f"{self.cls.__name__} does work when it runs; validation must not run it")
        values = {name: self.input(name) if is_link(value) else value for name, value in self.inputs.items()}
        self.widgets(*(name for name, value in self.inputs.items() if not is_link(value)))
        return self.cls.execute(**values).args


def _link_type_error(node: type[io.ComfyNode], input_types: dict[str, str]) -> str | None:
    """ComfyUI's own link-type check, which declaring ``input_types`` turns off."""
    from comfy_execution.validation import validate_node_input  # ComfyUI's, present since 0.3.4x

    expected = {i.id: i.get_io_type() for i in node.define_schema().inputs}
    for name, received in (input_types or {}).items():
        if name in expected and not validate_node_input(received, expected[name]):
            wanted = expected[name]
            return f"{name}: a {received} is linked in, but this input takes a {wanted}; link a {wanted}"
    return None


def validate(
    node: type[io.ComfyNode], input_types: dict[str, str] | None, check: Callable[[QueuedNode], object]
) -> bool | str:
    """What a node's validate_inputs returns: True, or the text of the InvalidInput that ``check(node)`` raised (it
    names the widget and the fix; ComfyUI answers the POST /prompt with a 400 naming the node).

    A check that needs a value only execution knows is skipped here; the node makes every check again when it runs.
    """
    wrong_link = _link_type_error(node, input_types or {})
    if wrong_link:
        return wrong_link
    json_data = _queued.get()
    prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
    node_id = unique_id(node)
    if not isinstance(prompt, dict) or node_id is None or str(node_id) not in prompt:
        return True
    try:
        queued = QueuedNode(prompt, str(node_id))
        if not COMFY_CHECKS_COMBOS:
            queued.check_combos()
        check(queued)
    except Unknown:
        return True
    except InvalidInput as e:
        return str(e)
    return True
