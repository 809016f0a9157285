"""Regional compilation (LoadShardedTransformer's ``compile``): diffusers' ``compile_repeated_blocks`` on each rank's
transformer, once per resident transformer, and what dynamo compiled again in each run and why.

Only the repeated blocks are compiled (``torch.compile`` of each block module, which compiles its ``_call_impl`` and
so whatever hooks wrap it), so the pack's and diffusers' hooks around them keep working: context parallelism splits
and gathers the sequence outside the blocks (its ``_cp_plan`` hooks) and its attention's collectives are traced
inside them; tensor parallelism's DTensor weights are traced as DTensors. Parameters are inputs of the compiled graphs
(dynamo's ``inline_inbuilt_nn_modules``), so a LoRA merged into the weights in place (``worker/lora.py``, fused) is
what the next pass computes with: no stale compiled weights, and no recompile for a strength change.

A recompile is read from dynamo itself: the graphs it compiled during the run (``counters["stats"]["unique_graphs"]``)
and the guard failures that made it (``guard_failures``), so the node says e.g. that a new size recompiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import torch

from ..strategy import StrategyPlan
from ..wire import COMPILE_BACKEND_ENV, CompileMode, CompileReport

_COMPILED = "_parallel_diffusers_compiled"  # set on a transformer whose blocks are compiled: lives and dies with it
DEFAULT_BACKEND = "inductor"
MAX_REASONS = 4  # the node's text names this many distinct guard failures


def backend() -> str:
    """torch.compile's backend on this rank: inductor (which needs a C++ compiler on CPU ranks), or the one
    ``COMPILE_BACKEND_ENV`` names (``aot_eager``: the same graphs without inductor's code generation, what the
    tests use to keep compile time small)."""
    return os.environ.get(COMPILE_BACKEND_ENV) or DEFAULT_BACKEND


def placement(mode: CompileMode) -> str:
    """What ``mode`` adds to the transformer's resident-model key: compiling is undone only by loading again."""
    return "" if mode is CompileMode.OFF else f",compile={mode.value}"


def compile_blocks(transformer: torch.nn.Module, mode: CompileMode, plan: StrategyPlan) -> bool:
    """Compile ``transformer``'s repeated blocks when ``mode`` asks for it and they are not compiled yet; True when
    this call compiled them. Lazy: torch.compile compiles at the first pass.

    A new image size recompiles; dynamo then makes the sizes dynamic, except under tensor parallelism: DTensor
    weights with a dynamic sequence length fail in torch 2.14's fake-tensor pass ("unhashable type: non-nested
    SymInt"), so TP compiles one static graph per size instead (up to dynamo's ``recompile_limit`` sizes, after which
    dynamo runs further sizes eagerly)."""
    if mode is CompileMode.OFF or getattr(transformer, _COMPILED, False):
        return False
    transformer.compile_repeated_blocks(backend=backend(), dynamic=False if plan.shards_weights else None)
    setattr(transformer, _COMPILED, True)
    return True


@dataclasses.dataclass
class _Record:
    first: bool
    graphs: int = 0
    reasons: tuple[str, ...] = ()

    def report(self) -> CompileReport:
        return CompileReport(backend(), self.first, self.graphs, self.reasons)


@contextlib.contextmanager
def watch(mode: CompileMode, first: bool) -> Iterator[_Record | None]:
    """What dynamo compiled while the block runs (None when ``mode`` is off): dynamo's counters are the process's, and
    on a rank only the transformer's blocks are compiled, so what changes during a denoise is theirs."""
    if mode is CompileMode.OFF:
        yield None
        return
    from torch._dynamo.utils import counters, guard_failures

    graphs = counters["stats"]["unique_graphs"]
    seen = {code: len(failures) for code, failures in guard_failures.items()}
    record = _Record(first)
    yield record
    record.graphs = counters["stats"]["unique_graphs"] - graphs
    reasons: list[str] = []
    for code, failures in list(guard_failures.items()):
        # The first new failure of each compiled frame is what missed its cached code; later ones are the guards of
        # the graph dynamo then made general (dynamic sizes), which say nothing to a user.
        new = failures[seen.get(code, 0) :]
        # "0/1: tensor 'hidden_states' size mismatch at index 1. expected 16, actual 32": drop the frame's ids
        text = str(new[0]).split(": ", 1)[-1] if new else None
        if text is not None and text not in reasons:
            reasons.append(text)
    record.reasons = tuple(reasons[:MAX_REASONS])
