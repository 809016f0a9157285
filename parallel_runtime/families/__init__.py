"""The model families the pack runs, one folder each (``families/<key>/``, named by the family's key), listed once here.

A family's folder holds its ``FamilyAdapter`` (base.py), the layout of its ComfyUI files (a ``FilesLayout``, files.py)
and its tiny builders; what families share stays beside them here (base.py, files.py, lora.py, tiny.py). The client
and the ranks read this same registry: the client validates widgets against a family's declarations, the ranks run its
stages. Adding a family is its folder, its line here and its tests (docs/ARCHITECTURE.md has the recipe).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence

from .base import (
    ENCODER_IMAGES,
    IMAGE_INPUTS,
    FamilyAdapter,
    LatentLayout,
    Placement,
    TensorParallelPlan,
    img2img_steps,
)
from .files import FilesLayout
from .flux import Flux1, Flux1Files
from .flux2 import Flux2, Flux2Files
from .flux2_klein import Flux2Klein, Flux2KleinFiles
from .flux_kontext import FluxKontext
from .qwenimage import QwenImage, QwenImageFiles
from .qwenimage_edit import QwenImageEdit
from .wan import Wan
from .wan.files import WanFiles
from .wan.tp_plan import WAN_TP_PLAN
from .wan_i2v import WanI2V
from .wan_ti2v import WanTI2V

REGISTRY: tuple[FamilyAdapter, ...] = (
    Flux1(),
    FluxKontext(),
    Flux2(),
    Flux2Klein(),
    QwenImage(),
    QwenImageEdit(),
    Wan(),
    WanI2V(),
    WanTI2V(),
)

# The families whose ComfyUI files convert (``comfy_files``), one ``FilesLayout`` each (files.py), tried in order.
FILES_LAYOUTS: tuple[FilesLayout, ...] = (
    Flux1Files(),
    Flux2Files(),
    Flux2KleinFiles(),
    QwenImageFiles(),
    WanFiles(),
)

# The tensor-parallel plans the pack writes (``families/<key>/tp_plan.py``), by the transformer class they split: for
# classes whose diffusers ships no ``_tp_plan``.
TP_PLANS: dict[str, TensorParallelPlan] = {"WanTransformer3DModel": WAN_TP_PLAN}


def tp_plan(class_name: str) -> TensorParallelPlan | None:
    """How tensor parallelism splits the diffusers transformer class ``class_name``: the pack's plan for it, else the
    class's own ``_tp_plan``, else None (it cannot be split).

    Looked up by the class's name, not through a family: the strategy's checks (from a config's ``_class_name``), the
    slice-by-slice load (from the class) and the LoRAs fused under TP (from the model) all know the class, and not
    every one knows the family; a family with several transformer classes plans each. Imports diffusers only for a
    class the pack has no plan for."""
    if class_name in TP_PLANS:
        return TP_PLANS[class_name]
    import diffusers

    layers = getattr(getattr(diffusers, class_name, None), "_tp_plan", None)
    return TensorParallelPlan(layers=layers) if layers is not None else None


def tp_sharded_share(config: dict) -> float:
    """The share of a transformer's parameters that its tensor-parallel plan splits over the ranks (every rank holds
    the rest whole), from its ``config`` (config.json, whose ``_class_name`` names the class): counted on the meta
    device, nothing loaded. 0 for a class no plan splits. A rank at ``tp_degree`` d holds 1 − share + share / d.

    Each model has its own: FLUX.1 0.72 (its norms and AdaLN tables stay whole: over a quarter), FLUX.2-dev and Wan 2.1
    14B about 0.97 (FLUX.2's single blocks' fused projections split too). One figure for all would refuse runs that
    fit: FLUX.1's would put FLUX.2-dev at tp 4 at 28 GiB a rank, where it holds 16."""
    return _sharded_share(json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=16)
def _sharded_share(config_json: str) -> float:
    import diffusers
    import torch

    config = json.loads(config_json)
    plan = tp_plan(config["_class_name"])
    if plan is None:
        return 0.0
    with torch.device("meta"):
        model = getattr(diffusers, config["_class_name"]).from_config(config)
    sizes = [(name, p.numel()) for name, p in model.named_parameters()]
    return sum(n for name, n in sizes if plan.splits(name)) / sum(n for _, n in sizes)


def family(key: str) -> FamilyAdapter:
    """The family whose ``key`` this is (the wire names families by key)."""
    for adapter in REGISTRY:
        if adapter.key == key:
            return adapter
    raise ValueError(f"unknown model family {key!r}; known: {', '.join(a.key for a in REGISTRY)}")


def for_pipeline(class_name: str | None, index: dict | None = None) -> FamilyAdapter | None:
    """The family of a diffusers pipeline class (``model_index.json``'s ``_class_name``), or None. Of the families
    of one class, the one whose ``index_flag`` the folder's ``index`` (``model_index.json``'s contents) sets, else
    the one without a flag (Wan 2.2 TI2V-5B's folders are ``WanPipeline``s with ``expand_timesteps``)."""
    same_class = [adapter for adapter in REGISTRY if adapter.pipeline == class_name]
    flagged = (adapter for adapter in same_class if adapter.index_flag and (index or {}).get(adapter.index_flag))
    return next(flagged, next((adapter for adapter in same_class if adapter.index_flag is None), None))


def join_words(words: Sequence[str], last: str = "and") -> str:
    """Words as a sentence lists them: "A", "A and B", "A, B and C"."""
    return words[-1] if len(words) < 2 else f"{', '.join(words[:-1])} {last} {words[-1]}"


def names(which: Callable[[FamilyAdapter], bool] = lambda adapter: True, last: str = "and") -> str:
    """The names of the registry's families that ``which`` selects, for tooltips and messages ("FLUX.1 and FLUX.2"),
    so that none of them names the families itself."""
    return join_words([adapter.name for adapter in REGISTRY if which(adapter)], last) or "none"


def supported() -> str:
    """The families for an error message: "FLUX.1 (FluxPipeline), ..."."""
    return ", ".join(f"{adapter.name} ({adapter.pipeline})" for adapter in REGISTRY)


__all__ = [
    "ENCODER_IMAGES",
    "FILES_LAYOUTS",
    "IMAGE_INPUTS",
    "REGISTRY",
    "TP_PLANS",
    "FamilyAdapter",
    "FilesLayout",
    "LatentLayout",
    "Placement",
    "TensorParallelPlan",
    "family",
    "for_pipeline",
    "img2img_steps",
    "join_words",
    "names",
    "supported",
    "tp_plan",
]
