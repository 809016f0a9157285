"""How the transformer is split over the backend's ranks: one typed, validated plan.

A ``StrategyPlan`` is what LoadShardedTransformer's widgets mean once checked. It is built on the client, checked in
its constructor against the transformer it splits (``TransformerFacts``: class, heads, parallel plans) and the
backend's ranks, and travels to the ranks as it is (``serial``), where it is rebuilt and checked again. Every error
names the widget and the fix. The ranks act on its fields and properties, never on strings.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.util

from .errors import InvalidInput


class Strategy(str, enum.Enum):
    """LoadShardedTransformer's ``strategy`` widget."""

    DEVICE_MAP = "device_map"  # layers spread over the GPUs in one process (rank 0)
    CONTEXT_PARALLEL = "context_parallel"  # the token sequence split over the ranks (Ring / Ulysses / Unified)
    TENSOR_PARALLEL = "tensor_parallel"  # weight matrices split over the ranks (the model's _tp_plan)
    TP_CP = "tp_cp"  # TP inside groups of tp_degree ranks, CP across the groups, on one mesh
    DATA_PARALLEL = "data_parallel"  # a replica per rank, whole images each
    # True CFG's conditional and unconditional passes on two halves of the ranks (context parallel inside each half)
    CFG_PARALLEL = "cfg_parallel"


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
        has_tp_plan: the class declares ``_tp_plan`` (tensor parallelism is possible).
    """

    class_name: str
    heads: int | None
    has_cp_plan: bool
    has_tp_plan: bool

    @classmethod
    def from_config(cls, config: dict) -> TransformerFacts:
        import diffusers  # lazily: its model classes are only looked up, not loaded

        name = config["_class_name"]
        model = getattr(diffusers, name, None)
        return cls(
            class_name=name,
            heads=config.get("num_attention_heads"),
            has_cp_plan=getattr(model, "_cp_plan", None) is not None,
            has_tp_plan=getattr(model, "_tp_plan", None) is not None,
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
    """A transformer's split over the backend's ranks, checked against the model and the ranks.

    Args:
        kind: the strategy.
        ranks: the backend's ranks (its world size); every degree below fits it.
        transformer: the model the plan splits (heads, parallel plans).
        ring_degree: context parallelism: ranks on the Ring axis (1: no ring).
        ulysses_degree: context parallelism: ranks on the Ulysses axis; both degrees > 1 is Unified attention.
            Under ``tp_cp`` ring × ulysses × tp = ranks, under ``cfg_parallel`` ring × ulysses = ranks / 2 (each half
            of the ranks splits its pass's tokens; 1 × 1: no context parallelism), otherwise ring × ulysses = ranks.
        anything: Ulysses-anything / Ring-anything, for token counts that do not divide by the degree.
        attention_backend: diffusers' attention backend under context parallelism ("auto": the default for
            Ulysses, one that returns the log-sum-exp for Ring).
        tp_degree: tensor parallelism: ranks sharing each weight matrix (all of them under ``tensor_parallel``).

    Degrees a strategy does not use are 1 (``auto`` for the backend), so equal plans mean equal placements.
    """

    kind: Strategy
    ranks: int
    transformer: TransformerFacts
    ring_degree: int = 1
    ulysses_degree: int = 1
    anything: bool = False
    attention_backend: str = "auto"
    tp_degree: int = 1

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise InvalidInput("ranks", f"{self.ranks} ranks cannot run anything; use 1 or more")
        # TP first: under tp_cp the context-parallel degrees are counted within what tp_degree leaves.
        if self.kind in (Strategy.TENSOR_PARALLEL, Strategy.TP_CP):
            self._check_tensor_parallel()
        elif self.tp_degree != 1:
            raise InvalidInput(
                "tp_degree",
                f"{self.kind.value} does not split the weights; leave tp_degree at 0, "
                "or choose tensor_parallel or tp_cp",
            )
        if self.kind is Strategy.CFG_PARALLEL:
            self._check_cfg_parallel()
        if self.kind in (Strategy.CONTEXT_PARALLEL, Strategy.TP_CP) or (
            self.kind is Strategy.CFG_PARALLEL and self.cp_degree > 1
        ):
            self._check_context_parallel()
        elif (self.ring_degree, self.ulysses_degree, self.anything, self.attention_backend) != (1, 1, False, "auto"):
            raise InvalidInput(
                "strategy",
                f"{self.kind.value} does not split the tokens, so ring_degree, "
                "ulysses_degree, anything and attention_backend keep their defaults",
            )

    # -- checks -----------------------------------------------------------------------------------------------
    def _check_tensor_parallel(self) -> None:
        facts, tp = self.transformer, self.tp_degree
        if not facts.has_tp_plan:
            raise InvalidInput(
                "strategy",
                f"{facts.class_name} has no tensor-parallel plan (_tp_plan) in this "
                "diffusers; use context_parallel or data_parallel. Models with one: "
                f"{_models_with('_tp_plan')}",
            )
        if self.kind is Strategy.TENSOR_PARALLEL and tp != self.ranks:
            raise InvalidInput(
                "tp_degree",
                f"tp_degree {tp} must equal the backend's {self.ranks} ranks "
                "(0 uses them all; tp_cp combines TP with context parallelism)",
            )
        if self.kind is Strategy.TP_CP and (tp < 2 or self.ranks % tp or self.ranks // tp < 2):
            raise InvalidInput(
                "tp_degree",
                f"tp_cp needs tp_degree ≥ 2 dividing the backend's {self.ranks} ranks "
                f"and leaving ≥ 2 for context parallelism (e.g. tp_degree 2 on 4 ranks); "
                f"got {tp}. With fewer ranks use tensor_parallel or context_parallel",
            )
        if facts.heads and facts.heads % tp:
            raise InvalidInput(
                "tp_degree",
                f"{facts.heads} attention heads do not split over tp_degree {tp}; use a "
                f"divisor of {facts.heads} (and as many ranks)",
            )

    def _check_cfg_parallel(self) -> None:
        if self.ranks < 2 or self.ranks % 2:
            raise InvalidInput(
                "strategy",
                f"cfg_parallel runs the conditional and the unconditional pass on two halves of the ranks, so it "
                f"needs an even number of ranks; the backend has {self.ranks}. Set ranks on the ParallelBackend "
                "node to 2, 4, ..., or use context_parallel",
            )
        ring, ulysses = self.ring_degree, self.ulysses_degree
        if ring < 1 or ulysses < 1 or ring * ulysses != self.ranks // 2:
            raise InvalidInput(
                "ulysses_degree",
                f"under cfg_parallel each half of the backend's {self.ranks} ranks runs one pass, split over "
                f"ring_degree × ulysses_degree ranks = {ring} × {ulysses} = {ring * ulysses}; make the product "
                f"{self.ranks // 2} (ulysses_degree 0 fills the rest)",
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
        cp_ranks = {Strategy.TP_CP: self.ranks // tp, Strategy.CFG_PARALLEL: self.ranks // 2}.get(self.kind, self.ranks)
        if ring * ulysses != cp_ranks:
            across = "the backend has" if self.kind is Strategy.CONTEXT_PARALLEL else f"tp_degree {tp} leaves"
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
    def spmd(self) -> bool:
        """Every rank takes part (CP, TP, DP); ``device_map`` runs on rank 0 alone."""
        return self.kind is not Strategy.DEVICE_MAP

    @property
    def cp_degree(self) -> int:
        """Ranks one image's tokens are split over (1 when the tokens are not split)."""
        return self.ring_degree * self.ulysses_degree

    @property
    def cfg_degree(self) -> int:
        """Groups of ranks true CFG's passes are split over (2 under ``cfg_parallel``: conditional, unconditional)."""
        return 2 if self.kind is Strategy.CFG_PARALLEL else 1

    @property
    def splits_tokens(self) -> bool:
        return self.kind in (Strategy.CONTEXT_PARALLEL, Strategy.TP_CP) or (
            self.kind is Strategy.CFG_PARALLEL and self.cp_degree > 1
        )

    @property
    def splits_batch(self) -> bool:
        return self.kind is Strategy.DATA_PARALLEL

    def describe(self) -> str:
        """A short, stable name: the resident transformer's placement in status and model keys."""
        cp = (
            f"cp:ring{self.ring_degree}xulysses{self.ulysses_degree}{'+anything' if self.anything else ''}"
            f":{self.attention_backend}"
        )
        return {
            Strategy.CONTEXT_PARALLEL: cp,
            Strategy.TENSOR_PARALLEL: f"tp{self.tp_degree}",
            Strategy.TP_CP: f"tp{self.tp_degree}x{cp}",
            Strategy.CFG_PARALLEL: f"cfg2x{cp}" if self.cp_degree > 1 else "cfg2",
        }.get(self.kind, self.kind.value)

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
            kind = Strategy(strategy)
        except ValueError:
            raise InvalidInput(
                "strategy", f"unknown strategy {strategy!r}; choose one of {', '.join(s.value for s in Strategy)}"
            ) from None
        if kind is Strategy.TENSOR_PARALLEL:
            return cls(kind, ranks, transformer, tp_degree=tp_degree or ranks)
        if kind not in (Strategy.CONTEXT_PARALLEL, Strategy.TP_CP, Strategy.CFG_PARALLEL):
            return cls(kind, ranks, transformer)
        # Under tp_cp a tp_degree that does not divide the ranks is refused by the constructor, before this count.
        cp_ranks = ranks // tp_degree if kind is Strategy.TP_CP and tp_degree >= 1 else ranks
        if kind is Strategy.CFG_PARALLEL:
            cp_ranks = ranks // 2
        if ring_degree < 1:
            raise InvalidInput("ring_degree", f"{ring_degree} is not a degree; use 1 (no ring) or more")
        ulysses = ulysses_degree or max(1, cp_ranks // ring_degree)
        if kind is Strategy.CFG_PARALLEL and ring_degree * ulysses == 1:
            # Each half is one rank: nothing splits the tokens, so anything and attention_backend go unused.
            return cls(kind, ranks, transformer)
        return cls(
            kind,
            ranks,
            transformer,
            ring_degree=ring_degree,
            ulysses_degree=ulysses,
            anything=bool(anything),
            attention_backend=attention_backend,
            tp_degree=tp_degree if kind is Strategy.TP_CP else 1,
        )
