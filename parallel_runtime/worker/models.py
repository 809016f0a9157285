"""Models resident on a rank between queue runs, keyed by (model, component, placement, dtype).

One slot per component kind: a new key for the same kind (another model, dtype or placement) replaces the
old one, so a spec change reloads only the component that changed. Under the ``staged`` memory policy the
text encoders and the transformer never share the devices: loading one frees the other first (the staged
recipe of diffusers' guide: encode, flush, load transformer, denoise, flush, decode). The VAE is small and
stays; when a decode would not fit beside the transformer, ``free_before_decode`` lets the transformer go first.
Under ``auto`` everything stays while the rank's memory allows; a stage that would not fit frees the least recently
used models first (``to_free``), so a machine that holds encoders and transformer together never reloads them and one
that cannot behaves as ``staged``. Every op touches its component on every rank, so the order is the same on all.
``load_counts`` is what tests and the status panel use to see that a warm run loads nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..wire import ResidentModel
from . import cfg_parallel
from .diagnostics import flush

log = logging.getLogger(__name__)

# Under "staged", loading the key's component first frees these.
STAGED_EVICTS = {"text_encoders": ("transformer",), "transformer": ("text_encoders",), "vae": ()}
# Under "staged", a decode short of memory first frees these.
STAGED_DECODE_FREES = ("transformer", "text_encoders")


@dataclasses.dataclass(frozen=True)
class ModelKey:
    model: str
    component: str
    placement: str  # a short, stable description: "cpu", "cuda:0", "device_map=auto", "tp=2", ...
    dtype: str
    # One of a model's experts held alone (its subfolder: Wan 2.2 A14B's "transformer" or "transformer_2") when they
    # do not fit together; "" for the transformer, or every expert together.
    expert: str = ""

    def __str__(self) -> str:
        return f"{self.expert or self.component}:{self.model}"


def _modules(obj: Any) -> list[torch.nn.Module]:
    """A resident object's models: itself, or a pipeline's (or a model's experts') components."""
    if isinstance(obj, torch.nn.Module):
        return [obj]
    return [
        getattr(obj, name)
        for name in getattr(obj, "components", {})
        if isinstance(getattr(obj, name, None), torch.nn.Module)
    ]


def _parameter_bytes(obj: Any) -> int:
    """Bytes of parameters this rank holds (a tensor-parallel DTensor counts only its local shard)."""
    params = (p.to_local() if isinstance(p, DTensor) else p for m in _modules(obj) for p in m.parameters())
    return sum(p.numel() * p.element_size() for p in params)


def _parallelism(obj: Any) -> dict[str, int]:
    """The degrees diffusers actually applied to a model (read back from it, not from the request), and its blocks
    that run compiled (every expert's: ``compiled_blocks``): what the status panel shows and what tests check a
    strategy against."""
    modules = _modules(obj)
    # A model's experts are split alike (``stages.Experts``): the first one's degrees are every one's.
    first = modules[0] if modules and not isinstance(obj, torch.nn.Module) else obj
    config = getattr(first, "_parallel_config", None)
    applied = {"cfg_degree": cfg_parallel.cfg_degree(first)} if cfg_parallel.cfg_degree(first) > 1 else {}
    blocks = (block for model in modules for block in model.modules())
    compiled = sum(getattr(block, "_compiled_call_impl", None) is not None for block in blocks)
    if compiled:
        applied["compiled_blocks"] = compiled
    if config is None:
        return applied
    if config.tensor_parallel_config is not None:
        applied["tp_degree"] = config.tensor_parallel_config._tp_degree
    if config.context_parallel_config is not None:
        applied["ring_degree"] = config.context_parallel_config.ring_degree
        applied["ulysses_degree"] = config.context_parallel_config.ulysses_degree
    return applied


# What every torch module keeps in its __dict__ (its children, its hooks' dicts): what ``empty`` leaves.
_MODULE_BOOKKEEPING = frozenset(torch.nn.Module().__dict__)


def empty(module: torch.nn.Module) -> None:
    """Drop what ``module`` holds, in place: its parameters and buffers, and every attribute it gained beyond a torch
    module's bookkeeping, which is where the rest lives (diffusers' hooks: fp8 scales, step caches' states; fused
    LoRAs' kept originals; accelerate's offloaded weights; the forward wrappers that close over them). For a model
    that must go while a frame still holds the object (a pipeline's loop keeps the expert it ran last until its next
    step): its memory returns at once, and the object, which nothing runs again, goes with the frame."""
    for part in list(module.modules()):
        for tensors in (part._parameters, part._buffers):
            for name in tensors:
                tensors[name] = None
        for name in [name for name in part.__dict__ if name not in _MODULE_BOOKKEEPING]:
            del part.__dict__[name]


class ResidentModels:
    def __init__(self, device: torch.device, policy: str):
        self.device = device
        self.policy = policy  # the backend's memory policy: "staged", "resident" or "auto"
        self._slots: dict[str, tuple[ModelKey, Any, float]] = {}  # component -> (key, object, load seconds)
        self._loads: collections.Counter[str] = collections.Counter()
        self._clock = itertools.count()
        self._used: dict[str, int] = {}  # component -> when an op last used it (the same on every rank)

    def get(self, key: ModelKey, load: Callable[[], Any]) -> Any:
        """The resident object for ``key``, loading it (and freeing what it replaces) when needed."""
        if self.make_room(key):
            t0 = time.monotonic()
            self._slots[key.component] = (key, load(), time.monotonic() - t0)
            self._loads[str(key)] += 1
            log.info("loaded %s (%s, %s) in %.2f s", key, key.placement, key.dtype, time.monotonic() - t0)
        return self._slots[key.component][1]

    def resident(self, key: ModelKey) -> bool:
        slot = self._slots.get(key.component)
        return slot is not None and slot[0] == key

    def freed_by_loading(self, key: ModelKey) -> int:
        """Bytes of parameters that loading ``key`` may free first (what it replaces; under staged what must not
        share the devices with it; under auto every other model, least recently used first): memory the load may
        count on."""
        if self.policy == "auto":
            others = sum(_parameter_bytes(obj) for c, (_, obj, _) in self._slots.items() if c != key.component)
            return others + self.replaced_bytes(key)
        if self.resident(key):
            return 0
        components = (key.component, *STAGED_EVICTS[key.component]) if self.policy == "staged" else (key.component,)
        return sum(_parameter_bytes(self._slots[c][1]) for c in components if c in self._slots)

    def replaced_bytes(self, key: ModelKey) -> int:
        """Bytes of parameters of the model that loading ``key`` replaces (another key of its component)."""
        slot = self._slots.get(key.component)
        return _parameter_bytes(slot[1]) if slot is not None and slot[0] != key else 0

    def make_room(self, key: ModelKey) -> bool:
        """Free what loading ``key`` replaces or (under ``staged``) must not share the devices with; False when
        ``key`` is already resident. Ranks that take no part in a rank-0 stage call this alone, so every rank's
        slots change together and an SPMD transformer is never resident on some ranks only."""
        self._used[key.component] = next(self._clock)
        slot = self._slots.get(key.component)
        if slot is not None and slot[0] == key:
            return False
        self.free(key.component)
        if self.policy == "staged":
            self.free(*STAGED_EVICTS[key.component])
        return True

    def held_bytes(self) -> int:
        """Bytes of parameters this rank's resident models hold."""
        return sum(_parameter_bytes(obj) for _, obj, _ in self._slots.values())

    def to_free(self, key: ModelKey, short: int) -> list[str]:
        """The resident components other than ``key``'s whose parameters make ``short`` more bytes free on this rank:
        the least recently used first, then back any of those the others cover without it (a small VAE used long
        ago stays when the text encoders alone make room). All of them when even that is not enough: the stage's own
        check then says what does not fit."""
        sizes = {c: _parameter_bytes(obj) for c, (_, obj, _) in self._slots.items() if c != key.component}
        chosen: list[str] = []
        for component in sorted(sizes, key=lambda c: self._used.get(c, -1)):
            if short <= 0:
                break
            chosen.append(component)
            short -= sizes[component]
        for component in list(chosen):
            if short + sizes[component] <= 0:
                chosen.remove(component)
                short += sizes[component]
        return chosen

    def free(self, *components: str) -> list[str]:
        """Drop the given components and return their device memory to the allocator."""
        dropped = [self._slots.pop(c) for c in components if c in self._slots]
        names = [str(key) for key, _, _ in dropped]
        for name in names:
            log.info("freed %s", name)
        if dropped:
            del dropped  # the last references: the collector can now return the memory
            flush(self.device, everything=True)
        return names

    def free_before_decode(self) -> list[str]:
        """Make room for a decode that would not fit: under ``staged``, free the transformer and the text encoders
        (the next prompt loads them again); ``resident`` keeps everything and lets the decode's check refuse; ``auto``
        frees the least recently used models before the decode instead (stages.py)."""
        return self.free(*STAGED_DECODE_FREES) if self.policy == "staged" else []

    def names(self) -> list[str]:
        """The resident models as the node text names them ("transformer:flux1-dev")."""
        return [str(key) for key, _, _ in self._slots.values()]

    def free_all(self) -> list[str]:
        return self.free(*tuple(self._slots))

    def describe(self) -> tuple[ResidentModel, ...]:
        return tuple(
            ResidentModel(
                model=key.model,
                component=key.expert or key.component,
                placement=key.placement,
                dtype=key.dtype,
                parameter_bytes=_parameter_bytes(obj),
                parallelism=_parallelism(obj),
                load_seconds=round(seconds, 3),
            )
            for key, obj, seconds in self._slots.values()
        )

    def load_counts(self) -> dict[str, int]:
        return dict(self._loads)
