"""LoadShardedTransformer's step: choose how the transformer is split, checked against the model and the backend.
Nothing loads here: the backend loads the transformer when the sampler first needs it."""

from __future__ import annotations

import dataclasses
import json
import os

from .. import families, model_folders
from ..comfy_files import _gib
from ..errors import InvalidInput
from ..estimates import weights_share
from ..gguf_files import gguf_weights, tensor_parallel_share
from ..headers import read_header
from ..spec import BackendSpec
from ..strategy import StrategyPlan, TransformerFacts, check_attention
from ..wire import (
    FIRST_BLOCK_CACHE_THRESHOLD,
    FLOAT8_DTYPES,
    FP8_SCALE_SUFFIX,
    CacheMode,
    CompileMode,
    ModelRef,
    StepCache,
    TransformerSpec,
    Weights,
)
from .widgets import check_finite, parse_max_memory, resolve_dtype

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class TransformerHandle:
    """A validated transformer choice and the backend it runs on; ``config`` is the transformer's config.json, kept
    for the sampler's checks. The backend loads it on first use, so text encoders and transformer are never forced to
    be resident at the same time."""

    backend: BackendSpec
    spec: TransformerSpec
    config: dict = dataclasses.field(compare=False)
    held: str = dataclasses.field(default="", compare=False)  # what the weights are held as, for the node's text

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
    compile: str = CompileMode.OFF.value,
    weights: str = Weights.AS_STORED.value,
) -> TransformerHandle:
    """The transformer handle LoadShardedTransformer's widgets describe, checked against the model's config and the
    backend's ranks (``StrategyPlan.from_widgets`` says what 0 means for a degree), the step cache and compilation.
    Loads nothing."""
    step_cache = _step_cache(cache, cache_threshold)
    compiled = _compile(compile)
    try:
        held_as = Weights(weights)
    except ValueError:
        raise InvalidInput(
            "weights", f"unknown choice {weights!r}; choose one of {', '.join(w.value for w in Weights)}"
        ) from None
    ref = model_folders.resolve(model)
    budget = parse_max_memory(max_memory)
    config = model_folders.transformer_config(ref)
    plan = StrategyPlan.from_widgets(
        TransformerFacts.from_config(config, families.tp_plan(config["_class_name"])),
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
    _check_experts(ref)
    resolved = resolve_dtype(dtype, spec)
    check_attention(plan, resolved.value, spec.device)
    return TransformerHandle(
        backend=spec,
        spec=TransformerSpec(
            model=ref,
            dtype=resolved,
            plan=plan,
            max_memory=budget,
            cache=step_cache,
            compile=compiled,
            weights=held_as,
        ),
        config=config,
        held=describe_weights(
            ref.path, families.family(ref.family).transformer_subfolders(ref.path), resolved.value, held_as, plan
        ),
    )


def _describe_gguf(folders: list[str], dtype: str, plan: StrategyPlan) -> str:
    """What a rank holds of GGUF transformers: the files packed; under tensor parallelism its slices, packed where
    they are whole blocks of the file's type, else dequantized to ``dtype`` at load (``gguf_files.slices_packed``),
    which the text counts apart: that is the memory the rule costs."""
    how = f"each layer dequantized to {dtype} while it runs"
    if not plan.shards_weights:
        size = sum(os.path.getsize(gguf_weights(folder)) for folder in folders)
        where = "a rank" if plan.spmd else "the GPUs, spread by their packed bytes (device_map)"
        return f"weights: {_gib(size)} packed as GGUF on {where}, {how}"
    packed = dequantized = count = 0
    for folder in folders:
        with open(os.path.join(folder, "config.json")) as f:
            tp_plan = families.tp_plan(json.load(f)["_class_name"])
        share = tensor_parallel_share(folder, tp_plan, plan.tp_degree, _ITEMSIZE[dtype])
        packed, dequantized = packed + share.packed_bytes, dequantized + share.dequantized_bytes
        count += share.dequantized_weights
    text = f"weights: {_gib(packed)} packed as GGUF on a rank (its tensor-parallel slices), {how}"
    if count:
        text += (
            f"; plus {_gib(dequantized)} in {dtype}: {count} rowwise slices that are not whole blocks of the file's "
            f"type at tp_degree {plan.tp_degree}, dequantized at load (a smaller tp_degree, or a Q8_0 file, keeps "
            "more of them packed)"
        )
    return text


def describe_weights(
    model_dir: str, subfolders: tuple[str, ...], dtype: str, weights: Weights, plan: StrategyPlan
) -> str:
    """What a rank holds of the transformers' weights in ``model_dir``'s ``subfolders`` (every expert; from the
    safetensors headers): the fp8 ones as ``weights`` says (their float32 scales beside), the rest in ``dtype``; a
    rank's share under tensor parallelism; a GGUF file packed, as stored (``_describe_gguf``)."""
    folders = [os.path.join(model_dir, subfolder) for subfolder in subfolders]
    if any(gguf_weights(folder) is not None for folder in folders):
        return _describe_gguf(folders, dtype, plan)
    fp8 = other = 0
    for folder in folders:
        for file in sorted(os.listdir(folder)):
            if not file.endswith(".safetensors"):
                continue
            try:
                header, _ = read_header(os.path.join(folder, file))
            except (OSError, ValueError):
                return ""  # the weights' own check (model_folders) says what is wrong with them
            for key, (kind, shape) in header.items():
                n = 1
                for d in shape:
                    n *= d
                if kind in FLOAT8_DTYPES:
                    fp8 += n
                elif not key.endswith(FP8_SCALE_SUFFIX):
                    other += n
    sharded = 0.0
    if plan.shards_weights:
        with open(os.path.join(folders[0], "config.json")) as f:
            sharded = families.tp_sharded_share(json.load(f))
    itemsize, share = _ITEMSIZE[dtype], weights_share(plan, sharded)
    where = "a rank" if share == 1 else "a rank (its tensor-parallel share)"
    if not fp8:
        return f"weights: {_gib(int(other * itemsize * share))} in {dtype} on {where}"
    held = "fp8" if weights is Weights.AS_STORED else dtype
    total = (fp8 * (1 if weights is Weights.AS_STORED else itemsize) + other * itemsize) * share
    return (
        f"weights: {_gib(int(total))} on {where}: {fp8 / (fp8 + other):.0%} of them stored in fp8, held as {held} "
        f"(weights: {weights.value}), computed in {dtype}"
    )


def _check_experts(ref: ModelRef) -> None:
    """A model with several experts (Wan 2.2 A14B) has each one's folder."""
    family = families.family(ref.family)
    subfolders = family.transformer_subfolders(ref.path)
    for subfolder in subfolders[1:]:
        if not os.path.isfile(os.path.join(ref.path, subfolder, "config.json")):
            raise InvalidInput(
                "model",
                f"{ref.name} is {family.name} with two experts (model_index.json names {subfolder} or a "
                f"boundary_ratio), but {subfolder}/ holds no model; copy the low-noise expert's folder there (from the "
                "same Wan 2.2 download), or pick a Wan 2.1 model",
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


def _compile(compile: str) -> CompileMode:
    try:
        mode = CompileMode(compile)
    except ValueError:
        raise InvalidInput(
            "compile", f"unknown compile {compile!r}; choose one of {', '.join(m.value for m in CompileMode)}"
        ) from None
    return mode
