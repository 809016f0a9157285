"""LoadShardedTransformer's step: choose how the transformer is split, checked against the model and the backend.
Nothing loads here: the backend loads the transformer when the sampler first needs it."""

from __future__ import annotations

import dataclasses
import os

from .. import families, model_folders
from ..errors import InvalidInput
from ..gguf_files import TENSOR_PARALLEL_REFUSAL, gguf_weights
from ..spec import BackendSpec
from ..strategy import StrategyPlan, TransformerFacts, check_attention
from ..wire import FIRST_BLOCK_CACHE_THRESHOLD, CacheMode, StepCache, TransformerSpec
from .widgets import check_finite, parse_max_memory, resolve_dtype


@dataclasses.dataclass(frozen=True)
class TransformerHandle:
    """A validated transformer choice and the backend it runs on; ``config`` is the transformer's config.json, kept
    for the sampler's checks. The backend loads it on first use, so text encoders and transformer are never forced to
    be resident at the same time."""

    backend: BackendSpec
    spec: TransformerSpec
    config: dict = dataclasses.field(compare=False)

    @property
    def family(self) -> families.FamilyAdapter:
        return families.family(self.spec.model.family)

    @property
    def plan(self) -> StrategyPlan:
        return self.spec.plan


def plan_transformer(
    spec: BackendSpec,
    *,
    model: str,
    strategy: str = "device_map",
    max_memory: str = "",
    dtype: str = "auto",
    ring_degree: int = 1,
    ulysses_degree: int = 0,
    anything: bool = False,
    attention_backend: str = "auto",
    tp_degree: int = 0,
    cache: str = "off",
    cache_threshold: float = FIRST_BLOCK_CACHE_THRESHOLD,
) -> TransformerHandle:
    """The transformer handle LoadShardedTransformer's widgets describe, checked against the model's config and the
    backend's ranks (``StrategyPlan.from_widgets`` says what 0 means for a degree), and the step cache. Loads
    nothing."""
    step_cache = _step_cache(cache, cache_threshold)
    ref = model_folders.resolve(model)
    budget = parse_max_memory(max_memory)
    config = model_folders.transformer_config(ref)
    plan = StrategyPlan.from_widgets(
        TransformerFacts.from_config(config),
        spec.world_size,
        strategy=strategy,
        ring_degree=ring_degree,
        ulysses_degree=ulysses_degree,
        anything=anything,
        attention_backend=attention_backend,
        tp_degree=tp_degree,
    )
    if plan.splits_cfg and not families.family(ref.family).true_cfg:
        raise InvalidInput(
            "strategy",
            f"{families.family(ref.family).name} has no true CFG (one transformer pass per step), so cfg_parallel "
            "has nothing to split; use context_parallel to make one image faster, or data_parallel for more images",
        )
    if plan.shards_weights and gguf_weights(os.path.join(ref.path, "transformer")) is not None:
        raise InvalidInput("strategy", f"{model!r} is {TENSOR_PARALLEL_REFUSAL.removeprefix('a ')}")
    resolved = resolve_dtype(dtype, spec)
    check_attention(plan, resolved.value, spec.device)
    return TransformerHandle(
        backend=spec,
        spec=TransformerSpec(model=ref, dtype=resolved, plan=plan, max_memory=budget, cache=step_cache),
        config=config,
    )


def _step_cache(cache: str, threshold: float) -> StepCache:
    try:
        mode = CacheMode(cache)
    except ValueError:
        raise InvalidInput(
            "cache", f"unknown cache {cache!r}; choose one of {', '.join(m.value for m in CacheMode)}"
        ) from None
    check_finite("cache_threshold", threshold)
    return StepCache(mode, float(threshold)) if mode is CacheMode.FIRST_BLOCK_CACHE else StepCache(mode)
