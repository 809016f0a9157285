"""How the transformer is split over the backend's ranks: one typed, validated plan.

A ``StrategyPlan`` is what LoadShardedTransformer's widgets mean once checked. It is built on the client, checked in
its constructor against the transformer it splits (``TransformerFacts``: class, heads, parallel plans) and the
backend's ranks, and travels to the ranks as it is (``serial``), where it is rebuilt and checked again. Every error
names the widget and the fix. The user's word (``Strategy``) says which axes the ranks are laid out on (``AXES``);
the plan's degrees size them. The ranks act on the degrees and the properties derived from them (``shards_weights``,
``splits_tokens``, ``mesh_shape``, ...), never on the word, which only names the plan in messages and status.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.util
import math
from typing import TYPE_CHECKING

from .errors import InvalidInput

if TYPE_CHECKING:
    from .families import TensorParallelPlan


class Strategy(str, enum.Enum):
    """LoadShardedTransformer's ``strategy`` widget."""

    DEVICE_MAP = "device_map"  # layers spread over the GPUs in one process (rank 0)
    CONTEXT_PARALLEL = "context_parallel"  # the token sequence split over the ranks (Ring / Ulysses / Unified)
    TENSOR_PARALLEL = "tensor_parallel"  # weight matrices split over the ranks (the model's _tp_plan)
    TP_CP = "tp_cp"  # TP inside groups of tp_degree ranks, CP across the groups, on one mesh
    DATA_PARALLEL = "data_parallel"  # a replica per rank, whole images each
    # True CFG's conditional and unconditional passes on two halves of the ranks (context parallel inside each half)
    CFG_PARALLEL = "cfg_parallel"


# The axes each strategy lays the backend's ranks out on, outermost first; a plan's degrees on the other axes are 1.
# "data" is a replica per rank (its ranks never talk inside a pass); the others form the device mesh of the ranks
# that run one image's passes together. A strategy's word names the layout, its degrees size it.
AXES: dict[Strategy, tuple[str, ...]] = {
    Strategy.DEVICE_MAP: (),  # no axis: one process, rank 0
    Strategy.CONTEXT_PARALLEL: ("ring", "ulysses"),
    Strategy.TENSOR_PARALLEL: ("tp",),
    # TP innermost: it all-reduces in every block, so its ranks should share the fastest links (one machine, NVLink)
    Strategy.TP_CP: ("ring", "ulysses", "tp"),
    Strategy.DATA_PARALLEL: ("data",),
    # CFG outermost: one exchange per step; the tokens' axes inside each half: collectives in every block
    Strategy.CFG_PARALLEL: ("cfg", "ring", "ulysses"),
}


def strategies_on(axis: str) -> list[str]:
    """The strategies that lay ranks out on ``axis``, in the widget's order: for tooltips and messages."""
    return [s.value for s, axes in AXES.items() if axis in axes]


ATTENTION_BACKENDS = ("auto", "native", "_native_flash", "_native_cudnn", "flash", "sage")


@dataclasses.dataclass(frozen=True)
class AttentionNeeds:
    """What one of diffusers' attention backends needs on this pack's devices (diffusers 0.42.1's registry).

    Args:
        ring: it returns the log-sum-exp Ring attention merges partial results with.
        cuda_only: it has no CPU kernel (``_native_flash`` has one on CPU ranks through the pack's shim).
        half_precision: on GPUs it takes bfloat16 or float16 only.
        min_capability: the oldest GPU it runs on (compute capability).
        package, install: the Python package it imports, and how to get it.
    """

    ring: bool
    cuda_only: bool = False
    half_precision: bool = False
    min_capability: tuple[int, int] | None = None
    package: str | None = None
    install: str = ""


ATTENTION_NEEDS = {
    "native": AttentionNeeds(ring=False),
    "_native_flash": AttentionNeeds(ring=True, half_precision=True, min_capability=(8, 0)),
    "_native_cudnn": AttentionNeeds(ring=True, cuda_only=True, half_precision=True, min_capability=(8, 0)),
    "flash": AttentionNeeds(ring=True, cuda_only=True, half_precision=True, min_capability=(8, 0), package="flash_attn",
                            install="pip install 'flash-attn>=2.6.3'"),
    "sage": AttentionNeeds(ring=True, cuda_only=True, half_precision=True, min_capability=(8, 0),
                           package="sageattention", install="pip install 'sageattention>=2.1.1'"),
}  # fmt: skip
HALF_PRECISION = ("bfloat16", "float16")


def ring_attention_backend(capability: tuple[int, int]) -> str:
    """What ``auto`` runs Ring attention with on a GPU of ``capability`` (the choice needs half precision and an
    Ampere or newer GPU, ``check_attention_on_gpu`` says so first): cuDNN's fused attention on Hopper and newer, where
    it is the fastest kernel torch has, torch's flash attention on Ampere and Ada."""
    return "_native_cudnn" if capability >= (9, 0) else "_native_flash"


def _chosen(plan: StrategyPlan) -> str | None:
    """The backend a plan asks for by name; None for ``auto`` or when it does not split the tokens."""
    return plan.attention_backend if plan.splits_tokens and plan.attention_backend != "auto" else None


def check_attention(plan: StrategyPlan, dtype: str, device: str) -> None:
    """What can be told without a GPU: the attention backend against the dtype, the backend's device and the
    packages this Python has (the ranks run the same one). InvalidInput naming the widget and the alternative."""
    if not plan.splits_tokens:
        return
    ring, name = plan.ring_degree > 1, _chosen(plan)
    if name is None:
        if ring and device == "cuda" and dtype not in HALF_PRECISION:
            raise InvalidInput(
                "dtype",
                f"Ring attention on GPUs needs bfloat16 or float16 (the attention kernels that return the "
                f"log-sum-exp it merges with take nothing else), not {dtype}; set dtype to auto or bfloat16, or use "
                "Ulysses (ring_degree 1)",
            )
        return
    needs = ATTENTION_NEEDS[name]
    if ring and not needs.ring:
        raise InvalidInput(
            "attention_backend",
            f"{name} cannot run Ring attention (it does not return the log-sum-exp Ring merges partial results "
            "with); choose auto, or use Ulysses (ring_degree 1)",
        )
    if needs.cuda_only and device != "cuda":
        raise InvalidInput(
            "attention_backend",
            f"{name} runs on CUDA GPUs only and this backend is on the {device}; choose auto"
            + (" (or _native_flash)" if ring else ""),
        )
    if needs.package and importlib.util.find_spec(needs.package) is None:
        raise InvalidInput(
            "attention_backend",
            f"{name} needs the {needs.package} package, which this Python does not have ({needs.install} into "
            "ComfyUI's Python); choose auto, or _native_cudnn / _native_flash, which come with torch",
        )
    if needs.half_precision and device == "cuda" and dtype not in HALF_PRECISION:
        raise InvalidInput(
            "dtype",
            f"attention_backend {name} takes bfloat16 or float16 on GPUs, not {dtype}; set dtype to auto or "
            "bfloat16, or choose attention_backend auto",
        )


def check_attention_on_gpu(plan: StrategyPlan, capability: tuple[int, int], gpu: str) -> None:
    """What only the rank's GPU can tell: its compute capability against the backend (``gpu`` names it)."""
    if not plan.splits_tokens or (plan.ring_degree == 1 and _chosen(plan) is None):
        return
    name = _chosen(plan) or ring_attention_backend(capability)
    needed = ATTENTION_NEEDS[name].min_capability
    if needed is not None and capability < needed:
        what = f"attention_backend {name}" if _chosen(plan) else "Ring attention"
        raise InvalidInput(
            "attention_backend" if _chosen(plan) else "ring_degree",
            f"{what} needs a GPU of compute capability {needed[0]}.{needed[1]} (Ampere) or newer; {gpu} is "
            f"{capability[0]}.{capability[1]}. Use Ulysses (ring_degree 1) with attention_backend auto",
        )


@dataclasses.dataclass(frozen=True)
class TransformerFacts:
    """What a plan is checked against, read from the transformer's config.json and its diffusers class.

    Args:
        class_name: the diffusers class (``FluxTransformer2DModel``, ...).
        heads: attention heads (``num_attention_heads``), or None when the config does not say.
        has_cp_plan: the class declares ``_cp_plan`` (context parallelism is possible).
        has_tp_plan: a tensor-parallel plan splits the class (``families.tp_plan``: diffusers' ``_tp_plan`` or the
            pack's).
        tp_widths: the widths that plan splits besides the heads, as (the user's word, its size in the config).
    """

    class_name: str
    heads: int | None
    has_cp_plan: bool
    has_tp_plan: bool
    tp_widths: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_config(cls, config: dict, tp_plan: TensorParallelPlan | None) -> TransformerFacts:
        """The facts of the transformer ``config`` describes; ``tp_plan`` is its class's (``families.tp_plan``, which
        the caller looks up: this shared module sits below the families, whose adapters carry plans)."""
        import diffusers  # lazily: its model classes are only looked up, not loaded

        name = config["_class_name"]
        model = getattr(diffusers, name, None)
        widths = {} if tp_plan is None else tp_plan.widths
        return cls(
            class_name=name,
            heads=config.get("num_attention_heads"),
            has_cp_plan=getattr(model, "_cp_plan", None) is not None,
            has_tp_plan=tp_plan is not None,
            tp_widths=tuple((word, config[key]) for key, word in widths.items() if config.get(key)),
        )


@functools.cache
def _models_with(attribute: str) -> str:
    import diffusers

    return ", ".join(
        sorted(
            n
            for n in dir(diffusers)
            if n.endswith("Transformer2DModel") and getattr(getattr(diffusers, n), attribute, None)
        )
    )


@dataclasses.dataclass(frozen=True)
class StrategyPlan:
    """A transformer's split over the backend's ranks: the user's word for it and the degrees it lays the ranks out
    with, checked against the model and the ranks. The ranks act on the degrees and the properties derived from them.

    Args:
        strategy: the user's word (LoadShardedTransformer's widget); its ``AXES`` are the degrees it may set.
        ranks: the backend's ranks (its world size). Under every strategy but ``device_map`` the degrees multiply to
            it: data × cfg × ring × ulysses × tp = ranks.
        transformer: the model the plan splits (heads, parallel plans).
        data_degree: replicas, each making its share of the batch's images.
        cfg_degree: groups of ranks true CFG's passes are split over (2: conditional, unconditional).
        ring_degree: context parallelism: ranks on the Ring axis (1: no ring).
        ulysses_degree: context parallelism: ranks on the Ulysses axis; both degrees > 1 is Unified attention.
            ring × ulysses is what the other degrees leave of the ranks (under ``cfg_parallel`` 1 × 1 is allowed:
            each half is one rank and nothing splits the tokens).
        tp_degree: tensor parallelism: ranks sharing each weight matrix.
        anything: Ulysses-anything / Ring-anything, for token counts that do not divide by the degree.
        attention_backend: diffusers' attention backend under context parallelism ("auto": the default for
            Ulysses, one that returns the log-sum-exp for Ring).

    Degrees a strategy does not use are 1 (``auto`` for the backend), so equal plans mean equal placements.
    """

    strategy: Strategy
    ranks: int
    transformer: TransformerFacts
    data_degree: int = 1
    cfg_degree: int = 1
    ring_degree: int = 1
    ulysses_degree: int = 1
    tp_degree: int = 1
    anything: bool = False
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise InvalidInput("ranks", f"{self.ranks} ranks cannot run anything; use 1 or more")
        axes, word = AXES[self.strategy], self.strategy.value
        stray = [f"{axis}_degree {self.degrees[axis]}" for axis in ("data", "cfg") if axis not in axes
                 and self.degrees[axis] != 1]  # fmt: skip
        if stray:  # only a plan built by hand or read from the wire: the widgets cannot set these degrees
            raise InvalidInput("strategy", f"{word} does not use {' and '.join(stray)}; those degrees stay 1")
        # TP first: the tokens' degrees are counted within what tp_degree leaves.
        if "tp" in axes:
            self._check_tensor_parallel()
        elif self.tp_degree != 1:
            raise InvalidInput(
                "tp_degree",
                f"{word} does not split the weights; leave tp_degree at 0, "
                f"or choose {' or '.join(strategies_on('tp'))}",
            )
        if "cfg" in axes:
            self._check_cfg_parallel()
        if "ring" in axes and (self.cp_degree > 1 or "cfg" not in axes):
            self._check_context_parallel()
        elif (self.ring_degree, self.ulysses_degree, self.anything, self.attention_backend) != (1, 1, False, "auto"):
            raise InvalidInput(
                "strategy",
                f"{word} does not split the tokens, so ring_degree, "
                "ulysses_degree, anything and attention_backend keep their defaults",
            )
        if self.spmd and math.prod(self.degrees.values()) != self.ranks:
            laid = " × ".join(f"{axis} {degree}" for axis, degree in self.degrees.items() if degree > 1) or "1"
            raise InvalidInput(
                "strategy",
                f"{word} lays out {laid} = {math.prod(self.degrees.values())} ranks, but the backend has "
                f"{self.ranks}; build the plan from the widgets (StrategyPlan.from_widgets)",
            )

    # -- checks -----------------------------------------------------------------------------------------------
    def _check_tensor_parallel(self) -> None:
        facts, tp, with_tokens = self.transformer, self.tp_degree, "ring" in AXES[self.strategy]
        if not facts.has_tp_plan:
            raise InvalidInput(
                "strategy",
                f"{facts.class_name} has no tensor-parallel plan (diffusers' _tp_plan, or one the pack writes); "
                "use context_parallel or data_parallel. diffusers' models with one: "
                f"{_models_with('_tp_plan')}",
            )
        if not with_tokens and tp != self.ranks:
            raise InvalidInput(
                "tp_degree",
                f"tp_degree {tp} must equal the backend's {self.ranks} ranks "
                "(0 uses them all; tp_cp combines TP with context parallelism)",
            )
        if with_tokens and (tp < 2 or self.ranks % tp or self.ranks // tp < 2):
            raise InvalidInput(
                "tp_degree",
                f"{self.strategy.value} needs tp_degree ≥ 2 dividing the backend's {self.ranks} ranks "
                f"and leaving ≥ 2 for context parallelism (e.g. tp_degree 2 on 4 ranks); "
                f"got {tp}. With fewer ranks use tensor_parallel or context_parallel",
            )
        if facts.heads and facts.heads % tp:
            raise InvalidInput(
                "tp_degree",
                f"{facts.heads} attention heads do not split over tp_degree {tp}; use a "
                f"divisor of {facts.heads} (and as many ranks)",
            )
        for word, width in facts.tp_widths:
            if width % tp:
                raise InvalidInput(
                    "tp_degree",
                    f"the {word} {width} does not split over tp_degree {tp}; use a divisor of {width} "
                    "(and as many ranks)",
                )

    def _check_cfg_parallel(self) -> None:
        if self.cfg_degree != 2:
            raise InvalidInput(
                "strategy",
                f"true CFG has two passes (conditional, unconditional), so cfg_degree is 2, not {self.cfg_degree}",
            )
        if self.ranks < 2 or self.ranks % 2:
            raise InvalidInput(
                "strategy",
                f"{self.strategy.value} runs the conditional and the unconditional pass on two halves of the ranks, "
                f"so it needs an even number of ranks; the backend has {self.ranks}. Set ranks on the ParallelBackend "
                "node to 2, 4, ..., or use context_parallel",
            )
        ring, ulysses, half = self.ring_degree, self.ulysses_degree, self.ranks // 2
        if ring < 1 or ulysses < 1 or ring * ulysses != half:
            raise InvalidInput(
                "ulysses_degree",
                f"under {self.strategy.value} each half of the backend's {self.ranks} ranks runs one pass, split over "
                f"ring_degree × ulysses_degree ranks = {ring} × {ulysses} = {ring * ulysses}; make the product "
                f"{half} (ulysses_degree 0 fills the rest)",
            )

    def _check_context_parallel(self) -> None:
        facts = self.transformer
        if not facts.has_cp_plan:
            raise InvalidInput(
                "strategy",
                f"{facts.class_name} has no context-parallel plan (_cp_plan) in this "
                "diffusers; use tensor_parallel or data_parallel, or a model that has "
                f"one: {_models_with('_cp_plan')}",
            )
        ring, ulysses, tp = self.ring_degree, self.ulysses_degree, self.tp_degree
        if ring < 1:
            raise InvalidInput("ring_degree", f"{ring} is not a degree; use 1 (no ring) or more")
        if ulysses < 1:
            raise InvalidInput("ulysses_degree", f"{ulysses} is not a degree; use 0 (the rest) or more")
        # The other degrees were checked to divide the ranks; the tokens take what they leave.
        others = self.data_degree * self.cfg_degree * tp
        cp_ranks = self.ranks // others
        if ring * ulysses != cp_ranks:
            across = "the backend has" if others == 1 else f"tp_degree {tp} leaves"
            raise InvalidInput(
                "ulysses_degree",
                f"ring_degree × ulysses_degree = {ring} × {ulysses} = "
                f"{ring * ulysses}, but {across} {cp_ranks} ranks; make the product "
                f"{cp_ranks} (ulysses_degree 0 fills the rest)",
            )
        if ring * ulysses == 1:
            raise InvalidInput(
                "ulysses_degree",
                "context parallelism needs 2 or more ranks; raise ranks on the ParallelBackend node, or use device_map",
            )
        if self.anything and ring > 1 and ulysses > 1:
            raise InvalidInput(
                "anything",
                "Ulysses-anything and Ring-anything each work on one axis; set "
                "ring_degree or ulysses_degree to 1, or turn anything off",
            )
        if facts.heads and ulysses > 1:
            local = facts.heads // tp
            held = f"{facts.heads} attention heads" if tp == 1 else f"{local} attention heads per TP rank"
            if self.anything and local < ulysses:
                raise InvalidInput(
                    "ulysses_degree",
                    f"Ulysses-anything needs at least as many attention heads as "
                    f"ranks: {held} < ulysses_degree {ulysses}",
                )
            if not self.anything and local % ulysses:
                raise InvalidInput(
                    "ulysses_degree",
                    f"{held} do not split over ulysses_degree {ulysses}; use a divisor of {local}, or turn anything on",
                )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidInput(
                "attention_backend",
                f"unknown backend {self.attention_backend!r}; choose one of {', '.join(ATTENTION_BACKENDS)}",
            )

    # -- what the ranks act on --------------------------------------------------------------------------------
    @property
    def degrees(self) -> dict[str, int]:
        """Every axis's degree, outermost first (1 where the strategy does not use it)."""
        return {
            "data": self.data_degree,
            "cfg": self.cfg_degree,
            "ring": self.ring_degree,
            "ulysses": self.ulysses_degree,
            "tp": self.tp_degree,
        }

    @property
    def spmd(self) -> bool:
        """Every rank takes part (the plan has an axis); ``device_map`` runs on rank 0 alone."""
        return bool(AXES[self.strategy])

    @property
    def cp_degree(self) -> int:
        """Ranks one image's tokens are split over (1 when the tokens are not split)."""
        return self.ring_degree * self.ulysses_degree

    @property
    def shards_weights(self) -> bool:
        """Each rank holds a slice of the weight matrices (``tp_degree`` of them share each)."""
        return "tp" in AXES[self.strategy]

    @property
    def splits_tokens(self) -> bool:
        """Each rank runs a slice of one image's tokens (``cp_degree`` of them share each pass)."""
        return self.cp_degree > 1

    @property
    def splits_batch(self) -> bool:
        """Each rank makes its own share of the batch's images (``data_degree`` replicas)."""
        return "data" in AXES[self.strategy]

    @property
    def splits_cfg(self) -> bool:
        """True CFG's conditional and unconditional passes run on different ranks."""
        return self.cfg_degree > 1

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The device mesh's axes, outermost first: every axis but the replicas' (empty: no mesh)."""
        return tuple(axis for axis in AXES[self.strategy] if axis != "data")

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.degrees[axis] for axis in self.mesh_dim_names)

    def describe(self) -> str:
        """A short, stable name: the resident transformer's placement in status and model keys."""
        parts = [f"cfg{self.cfg_degree}"] if self.splits_cfg else []
        if self.shards_weights:
            parts.append(f"tp{self.tp_degree}")
        if self.splits_tokens:
            parts.append(
                f"cp:ring{self.ring_degree}xulysses{self.ulysses_degree}{'+anything' if self.anything else ''}"
                f":{self.attention_backend}"
            )
        return "x".join(parts) or self.strategy.value

    # -- from LoadShardedTransformer's widgets -----------------------------------------------------------------
    @classmethod
    def from_widgets(
        cls,
        transformer: TransformerFacts,
        ranks: int,
        *,
        strategy: str,
        ring_degree: int = 1,
        ulysses_degree: int = 0,
        anything: bool = False,
        attention_backend: str = "auto",
        tp_degree: int = 0,
    ) -> StrategyPlan:
        """The plan LoadShardedTransformer's widgets describe. ``ulysses_degree`` 0 means every rank the ring (and,
        under tp_cp, the TP degree) does not use; ``tp_degree`` 0 means every rank under tensor_parallel. Widgets the
        strategy does not use are ignored. Under cfg_parallel the degrees split each half of the ranks, and
        ``ulysses_degree`` 0 fills the half."""
        try:
            word = Strategy(strategy)
        except ValueError:
            raise InvalidInput(
                "strategy", f"unknown strategy {strategy!r}; choose one of {', '.join(s.value for s in Strategy)}"
            ) from None
        axes = AXES[word]
        data = ranks if "data" in axes else 1
        cfg = 2 if "cfg" in axes else 1
        tp = 1
        if "tp" in axes:
            # Alone, TP's 0 is every rank; beside the tokens' axes it stays 0, which the constructor refuses.
            tp = tp_degree or (ranks if "ring" not in axes else 0)
        if "ring" not in axes:
            return cls(word, ranks, transformer, data_degree=data, cfg_degree=cfg, tp_degree=tp)
        # A tp_degree that does not divide the ranks is refused by the constructor, before this count is used.
        cp_ranks = ranks // (cfg * tp) if tp >= 1 else ranks
        if ring_degree < 1:
            raise InvalidInput("ring_degree", f"{ring_degree} is not a degree; use 1 (no ring) or more")
        ulysses = ulysses_degree or max(1, cp_ranks // ring_degree)
        if cfg > 1 and ring_degree * ulysses == 1:
            # Each half is one rank: nothing splits the tokens, so anything and attention_backend go unused.
            return cls(word, ranks, transformer, cfg_degree=cfg)
        return cls(
            word,
            ranks,
            transformer,
            cfg_degree=cfg,
            ring_degree=ring_degree,
            ulysses_degree=ulysses,
            anything=bool(anything),
            attention_backend=attention_backend,
            tp_degree=tp,
        )
