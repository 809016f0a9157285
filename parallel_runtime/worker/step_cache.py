"""Step caching (LoadShardedTransformer's ``cache``): diffusers' ``enable_cache`` for one denoise, with every rank
that works on the same pass taking the same decision, and a record of what was skipped.

The cache is switched on for the run and off after it (``disable_cache``), so its state never outlives a run and a
new mode or threshold loads nothing. TaylorSeer decides from the step count alone, so every rank decides alike.
FirstBlockCache decides from the first block's residual, which under context parallelism is each rank's own slice
of the tokens (diffusers' ``FBCHeadBlockHook._should_compute_remaining_blocks`` means over it): ranks would disagree,
and a rank that skipped the remaining blocks would leave the others waiting in their collectives. Here the measure
is reduced over the ranks that share the pass: the sums of |residual - previous| and |previous| (float32), whose
ratio is the one-process mean ratio, so all of them skip together, as one process would.

A model with two experts (Wan 2.2 A14B) gets a cache on each, each with its own state: the first pass after the switch
is the second expert's first, computed in full (the first expert's residuals and Taylor factors say nothing of the
other's), as diffusers' ``enable_cache`` on each of ``WanPipeline``'s transformers does in one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig
from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks.context_parallel import _CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE
from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK
from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

from ..strategy import StrategyPlan
from ..wire import CacheMode, CacheReport, StepCache

_CP_INPUT_HOOK = _CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE.format("")  # the prefix of every split hook's name


def agreement_group(plan: StrategyPlan, transformer: torch.nn.Module) -> dist.ProcessGroup | None:
    """The ranks that run each pass together (their collectives interleave), or None when each rank runs its own:
    those the tokens and the weights are split over (every rank, unless true CFG's passes are split too: then the
    ranks of one half, where each half has its own pass, as one process keeps a state per pass); none when each rank
    makes whole images of its own or rank 0 runs alone."""
    together = plan.cp_degree * plan.tp_degree
    if together == 1:
        return None
    if together == plan.ranks:
        return dist.group.WORLD
    # Fewer than every rank: only true CFG's halves lie outside a pass today, and inside a half only the tokens split.
    return transformer._parallel_config.context_parallel_config._flattened_mesh.get_group()


@contextlib.contextmanager
def count_passes(transformers: Sequence[torch.nn.Module], count: list[int] | None = None) -> Iterator[list[int]]:
    """Counts the passes that run on this rank inside the ``with`` block (``[count]``), of every transformer (a
    model's experts): calls of the first transformer block, which every pass runs, cached or not, and which a pass
    another rank runs (true CFG's passes split) never reaches. ``count``: one to go on with (an expert loaded
    mid-run)."""
    count = count if count is not None else [0]

    def counted(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        count[0] += 1

    handles = [_blocks(t)[0].register_forward_pre_hook(counted, with_kwargs=True) for t in transformers]
    try:
        yield count
    finally:
        for handle in handles:
            handle.remove()


class _Record:
    def __init__(self, mode: CacheMode, blocks: int) -> None:
        self.mode, self.blocks, self.passes = mode, blocks, []

    def report(self) -> CacheReport:
        return CacheReport(mode=self.mode, passes=tuple(self.passes), blocks=self.blocks)


@contextlib.contextmanager
def step_cache(
    transformers: Sequence[torch.nn.Module],
    cache: StepCache,
    group: dist.ProcessGroup | None,
    taylorseer_layers: tuple[str, ...] | None = None,
    record: _Record | None = None,
) -> Iterator[_Record | None]:
    """``cache`` on each of ``transformers`` (a model's experts, each its own state) for the ``with`` block (None,
    and nothing changed, when it is off); the record fills in as the passes run, in their order. ``taylorseer_layers``:
    the family's (``FamilyAdapter.taylorseer_layers``). ``record``: one to go on filling (an expert loaded mid-run,
    after the one before it)."""
    if cache.mode is CacheMode.OFF:
        yield None
        return
    enabled = []
    try:
        record = record if record is not None else _Record(cache.mode, len(_blocks(transformers[0])))
        for transformer in transformers:
            if cache.mode is CacheMode.FIRST_BLOCK_CACHE:
                with _splits_outside(transformer):
                    transformer.enable_cache(FirstBlockCacheConfig(threshold=cache.threshold))
            else:
                # Factors in the model's dtype: diffusers' default bfloat16 would round a float32 model's predictions.
                config = TaylorSeerCacheConfig(
                    taylor_factors_dtype=transformer.dtype,
                    cache_identifiers=list(taylorseer_layers) if taylorseer_layers is not None else None,
                )
                transformer.enable_cache(config)
            enabled.append(transformer)
            _instrument(transformer, cache, group, record)
        yield record
    finally:
        for transformer in enabled:
            transformer.disable_cache()


def _blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks, as diffusers' caches find them."""
    return [
        block
        for name, children in transformer.named_children()
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(children, torch.nn.ModuleList)
        for block in children
    ]


@contextlib.contextmanager
def _splits_outside(transformer: torch.nn.Module) -> Iterator[None]:
    """Hooks registered inside the block keep context parallelism's split hooks outermost on the blocks.

    Where the model's ``_cp_plan`` splits the sequence at a block's input rather than at the model's (Qwen-Image:
    ``transformer_blocks.0``), a cache hook registered after the split would wrap it and see the whole sequence going
    in but this rank's slice coming out. So the split hooks come off the blocks first and go back on after (their
    order kept): the cache sees this rank's slice both ways. (Taking a hook out from under one that replaces the
    forward, as FirstBlockCache's do, would unhook that one in diffusers' ``remove_hook``; the split hooks only wrap
    it, so they can come off and, later, the cache's hooks from under them.)"""
    taken = []
    for block in _blocks(transformer):
        registry = getattr(block, "_diffusers_hook", None)
        if registry is None:
            continue
        splits = [(name, registry.hooks[name]) for name in registry._hook_order if name.startswith(_CP_INPUT_HOOK)]
        for name, _ in reversed(splits):
            registry.remove_hook(name, recurse=False)
        taken.append((registry, splits))
    try:
        yield
    finally:
        for registry, splits in taken:
            for name, hook in splits:
                registry.register_hook(hook, name)


def _hooks(transformer: torch.nn.Module, name: str) -> list:
    found = []
    for module in transformer.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook(name) if registry is not None else None
        if hook is not None:
            found.append(hook)
    return found


def _instrument(
    transformer: torch.nn.Module, cache: StepCache, group: dist.ProcessGroup | None, record: _Record
) -> None:
    if cache.mode is CacheMode.TAYLORSEER:
        hooks = _hooks(transformer, _TAYLORSEER_CACHE_HOOK)
        record.blocks = len(hooks)
        # Every hooked layer counts the same steps, so the first one's decision is the pass's.
        first = hooks[0]
        measure = first._measure_should_compute

        def recorded() -> tuple[bool, object]:
            should_compute, state = measure()
            record.passes.append(should_compute)
            return should_compute, state

        first._measure_should_compute = recorded
        return
    (head,) = _hooks(transformer, _FBC_LEADER_BLOCK_HOOK)

    def agreed(residual: torch.Tensor) -> bool:
        previous = head.state_manager.get_state().head_block_residual
        if previous is None:  # the pass's first step: nothing to compare with, on any rank
            full = True
        else:
            sums = torch.stack([(residual - previous).abs().float().sum(), previous.abs().float().sum()])
            if group is not None:
                dist.all_reduce(sums, group=group)
            full = (sums[0] / sums[1]).item() > head.threshold
        record.passes.append(full)
        return full

    head._should_compute_remaining_blocks = agreed
