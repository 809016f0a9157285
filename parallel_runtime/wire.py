"""What crosses the process boundary: each op's arguments and result, as dataclasses the client and the ranks share.

An op is named by its arguments' type: ``backend.call(DenoiseArgs(...))`` sends the ``denoise`` op, the ranks rebuild
a ``DenoiseArgs`` from the message (``serial.from_json`` checks every field) and answer with a ``DenoiseResult``. A
field that is missing or of the wrong type is refused with an error reply before any rank acts on it. Tensors travel
beside the arguments, through the shared-memory arena (``arena``), never inside them.

Everything here is plain data: no torch, no diffusers. The ops are the subclasses of ``OpArgs``; each is served by the
function the ranks register for it (``worker/ops.py``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar

from .errors import InvalidInput
from .samplers import Sampler, Scheduler
from .strategy import StrategyPlan

# The dtype names of the wire: every dtype a tensor beside the arguments may have (images, latents, embeddings, masks;
# ``arena.TORCH_DTYPES`` maps them to torch's). Others are refused rather than guessed at.
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


class Dtype(str, enum.Enum):
    """A resolved weights dtype, one of ``TENSOR_DTYPES`` (the widgets' ``auto`` is resolved on the client)."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """A model the ranks load.

    Args:
        name: what the user picked (keys the resident models and shows in the status panel).
        path: the resolved folder (a diffusers ``save_pretrained`` directory).
        family: the family adapter's key (``families.REGISTRY``).
    """

    name: str
    path: str
    family: str


@dataclasses.dataclass(frozen=True)
class OpArgs:
    """Base of every op's arguments: ``op`` names the op, ``result`` is the type each rank answers with."""

    op: ClassVar[str]
    result: ClassVar[type]


# -- the generation stages ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Prompts:
    """What the text encoders encode: one row of embeddings per prompt.

    Args:
        prompts: the prompts.
        prompts_2: FLUX.1's second encoder (T5), one per prompt; None: the same prompts.
        negative_prompts: true CFG's negative prompts (Qwen-Image), one per prompt; None: not encoded.
        max_sequence_length: the longest prompt in text-encoder tokens.
    """

    prompts: tuple[str, ...]
    prompts_2: tuple[str, ...] | None = None
    negative_prompts: tuple[str, ...] | None = None
    max_sequence_length: int = 512


@dataclasses.dataclass(frozen=True)
class EncodeResult:
    shapes: dict[str, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class EncodeArgs(OpArgs):
    """Load the model's text encoders (``device_map="balanced"`` within ``max_memory``) and encode ``prompts``."""

    op: ClassVar[str] = "encode"
    result: ClassVar[type] = EncodeResult
    model: ModelRef
    dtype: Dtype
    prompts: Prompts
    max_memory: dict[str, str] | None = None


class Expert(str, enum.Enum):
    """Which of a model's two experts (Wan 2.2 A14B) a LoRA changes (ParallelLoraLoader's ``expert``), as ComfyUI's
    users load a LoRA per expert: both, the high-noise one (the first, ``transformer``: the early steps) or the
    low-noise one (the second, ``transformer_2``). A model with one transformer takes only BOTH."""

    BOTH = "both"
    HIGH_NOISE = "high_noise"
    LOW_NOISE = "low_noise"

    def changes(self, index: int) -> bool:
        """Whether the LoRA changes the model's transformer ``index`` (0: the first, the high-noise expert)."""
        return self is Expert.BOTH or index == (0 if self is Expert.HIGH_NOISE else 1)


@dataclasses.dataclass(frozen=True)
class LoraRef:
    """A LoRA the transformer carries (ParallelLoraLoader), checked on the client.

    Args:
        name: what the user picked (the ``lora_name`` widget): errors and the node's text name it.
        path: the resolved ``.safetensors`` file.
        strength: its multiplier; 0 leaves the transformer as it is, a negative one pushes the other way.
        sha256: the digest of the file's content when it was checked: what identifies it. Every rank reads the file
            through one opening and refuses it unless its digest is this one, so the ranks apply the file the client
            checked or none does; a file replaced on disk is read again while an unchanged one is never read twice.
        expert: which of two experts it changes (a model with one transformer: BOTH).
    """

    name: str
    path: str
    strength: float
    sha256: str
    expert: Expert = Expert.BOTH

    @property
    def file(self) -> tuple[str, str]:
        """What identifies the file's content: the ranks keep one reading per file, whatever its strength."""
        return (self.path, self.sha256)


class Weights(str, enum.Enum):
    """What a transformer's fp8 weights are held as on the ranks (LoadShardedTransformer's ``weights``).

    AS_STORED keeps the weights a folder stores in fp8 (a converted ComfyUI fp8 or scaled-fp8 file) in fp8, each
    layer's weight made in the run's dtype only while the layer runs (its scale applied then;
    ``worker/fp8_weights.py``): half the memory of bf16. AS_DTYPE makes the run's dtype of them when loading (scales
    applied), as the pack did before it kept fp8. Weights stored in bf16 / fp16 / fp32 load in the dtype either way."""

    AS_STORED = "as stored"
    AS_DTYPE = "as dtype"


# A scaled-fp8 weight's scale in a converted folder: "<layer>.weight" → "<layer>.weight_scale" (float32, one per
# tensor or one per output row), what comfy_files writes and the ranks' loader reads.
FP8_SCALE_SUFFIX = "_scale"
# safetensors' names of the fp8 dtypes a converted folder keeps (e4m3fn, e5m2), wherever the pack reads a header.
FLOAT8_DTYPES = ("F8_E4M3", "F8_E5M2")


class LoraMode(str, enum.Enum):
    """How the ranks apply a transformer's LoRAs (see ``worker/lora.py``).

    FUSED merges each LoRA's delta into the weights (into each rank's own slice under tensor parallelism), recomputed
    from a copy of the original weights, so any change of the LoRAs or strengths gives bit-identical weights back.
    PEFT loads them as diffusers' PEFT adapters, unfused. AUTO is the pack's choice, FUSED on every strategy (the
    measurements behind it are in bench/lora.py and the README); PEFT is there for the benchmark and for comparison.
    """

    AUTO = "auto"
    FUSED = "fused"
    PEFT = "peft"


class CacheMode(str, enum.Enum):
    """LoadShardedTransformer's ``cache`` widget: diffusers' step caches (``enable_cache``) that fit FLUX and
    Qwen-Image. What each costs and saves is measured by bench/speed.py (``--parts cache``)."""

    OFF = "off"
    # After the first block, skip the rest of a pass while its residual changes less than cache_threshold (relative).
    FIRST_BLOCK_CACHE = "first_block_cache"
    # Predict every block's output from a Taylor series of earlier steps, recomputing on a fixed schedule.
    TAYLORSEER = "taylorseer"


FIRST_BLOCK_CACHE_THRESHOLD = 0.05  # diffusers' FirstBlockCacheConfig default


@dataclasses.dataclass(frozen=True)
class StepCache:
    """How the transformer reuses work between denoising steps.

    Args:
        mode: the cache; ``off`` runs every block of every pass.
        threshold: ``first_block_cache``: the relative change of the first block's residual below which a pass
            reuses the previous one's remaining blocks (higher: more skipped, less faithful). Ignored by the others.
    """

    mode: CacheMode = CacheMode.OFF
    threshold: float = FIRST_BLOCK_CACHE_THRESHOLD

    def __post_init__(self) -> None:
        if self.mode is CacheMode.FIRST_BLOCK_CACHE and not 0 < self.threshold < 10:
            raise InvalidInput(
                "cache_threshold",
                f"{self.threshold} is not a first_block_cache threshold; use a small positive number "
                f"(diffusers' default {FIRST_BLOCK_CACHE_THRESHOLD}; 0.05–0.2 skips more the higher it is)",
            )


@dataclasses.dataclass(frozen=True)
class CacheReport:
    """What the step cache did on one rank during one denoise.

    Args:
        mode: the cache.
        passes: one per transformer pass this rank ran, in order (true CFG: conditional and unconditional passes
            alternate; under cfg_parallel a rank runs one of them): True when every block ran, False when the cache
            stood in (first_block_cache: for every block after the first; taylorseer: for every attention layer,
            predicted).
        blocks: what the cache stands in for, in a full pass: transformer blocks (first_block_cache) or attention
            layers (taylorseer).
    """

    mode: CacheMode
    passes: tuple[bool, ...]
    blocks: int

    @property
    def blocks_run(self) -> int:
        cached = 1 if self.mode is CacheMode.FIRST_BLOCK_CACHE else 0  # the first block decides, so it always runs
        return sum(self.blocks if full else cached for full in self.passes)

    def describe(self) -> str:
        full = sum(self.passes)
        unit = "blocks" if self.mode is CacheMode.FIRST_BLOCK_CACHE else "attention layers"
        return (
            f"{self.mode.value}: {full} of {len(self.passes)} transformer passes ran in full, "
            f"{len(self.passes) - full} from the cache; {self.blocks_run} of {self.blocks * len(self.passes)} "
            f"{unit} run"
        )


class CompileMode(str, enum.Enum):
    """LoadShardedTransformer's ``compile`` widget (``worker/compiled.py``)."""

    OFF = "off"
    # diffusers' compile_repeated_blocks: torch.compile of each transformer block class, once per resident transformer.
    REGIONAL = "regional"


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What torch.compile did on rank 0 during one denoise of a ``regional`` transformer.

    Args:
        backend: torch.compile's backend on the ranks (``inductor``, or ``COMPILE_BACKEND_ENV``'s).
        first: the blocks were wrapped for this run (the transformer was loaded, or loaded again, for it).
        graphs: the graphs dynamo compiled during the run; 0 when every pass reused compiled code (also after a
            reload: dynamo keeps the code per block class, and the weights are its inputs).
        reasons: why compiled code was not reused (dynamo's guard failures, e.g. a new image size), each once.
    """

    backend: str
    first: bool
    graphs: int
    reasons: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.graphs == 0:
            return f"compile regional ({self.backend}): no recompile, every pass ran compiled blocks"
        if self.first:
            return f"compile regional ({self.backend}): compiled the blocks ({self.graphs} graphs) in this run"
        why = "; ".join(self.reasons) if self.reasons else "dynamo gave no guard failure"
        return f"compile regional ({self.backend}): recompiled {self.graphs} graphs because {why}"


COMPILE_BACKEND_ENV = "COMFY_PARALLEL_COMPILE_BACKEND"  # torch.compile's backend on the ranks (default inductor)


@dataclasses.dataclass(frozen=True)
class TransformerSpec:
    """What LoadShardedTransformer chose: the model, how it is split, its dtype and its ``device_map`` budget, what
    its fp8 weights are held as; and the LoRAs ParallelLoraLoader nodes added, in the order they were chained, with how
    they are applied."""

    model: ModelRef
    dtype: Dtype
    plan: StrategyPlan
    max_memory: dict[str, str] | None = None
    loras: tuple[LoraRef, ...] = ()
    lora_mode: LoraMode = LoraMode.AUTO
    cache: StepCache = StepCache()
    compile: CompileMode = CompileMode.OFF
    weights: Weights = Weights.AS_STORED

    def __post_init__(self) -> None:
        if self.compile is not CompileMode.OFF and self.cache.mode is not CacheMode.OFF:
            # Measured: diffusers' cache hooks are installed for each run and their state is guarded in the compiled
            # blocks, so every run recompiled them (10 s of a 0.2 s run on the tiny FLUX.1), which costs more than
            # either saves.
            raise InvalidInput(
                "compile",
                f"regional compilation and the step cache ({self.cache.mode.value}) together recompile the blocks "
                "on every run; set compile to off to keep the cache, or cache to off to compile",
            )


@dataclasses.dataclass(frozen=True)
class Sampling:
    """ParallelSampler's widgets, checked. ``batch_size`` counts every image (prompts × images per prompt); image i
    uses seed + i (modulo 2^64). ``true_cfg_scale`` is None for families without true CFG.

    With a ``latent_image`` tensor beside the arguments (img2img; its size gave ``width`` and ``height``), ``denoise``
    is diffusers' img2img ``strength``: the last ``families.img2img_steps(steps, denoise)`` steps of a ``steps``-step
    schedule run, from the image noised to the first of them. A ``noise_mask`` tensor beside it (``[B, 1, H, W]``,
    1 = repaint) makes it inpainting. Without a latent, ``denoise`` is 1.

    ``sampler`` and ``scheduler`` pick the diffusers scheduler and its sigma schedule (``samplers``).

    ``frames``: a video family's clip length in frames (4k + 1 for Wan; 1 for an image). ``guidance_scale_2``: Wan
    2.2 A14B's CFG scale for its second (low-noise) expert; None gives it ``true_cfg_scale``, as the pipeline does."""

    seed: int
    steps: int
    guidance_scale: float
    width: int
    height: int
    batch_size: int = 1
    true_cfg_scale: float | None = None
    denoise: float = 1.0
    sampler: Sampler = Sampler.EULER
    scheduler: Scheduler = Scheduler.SIMPLE
    frames: int = 1
    guidance_scale_2: float | None = None


@dataclasses.dataclass(frozen=True)
class BatchSplit:
    """How data parallelism shared a batch's images over the ranks (``worker/speeds.py``).

    Args:
        images: each rank's count of consecutive images, rank by rank.
        speeds: each rank's speed the split followed, in image-steps per second (measured in its last data-parallel
            run) or relative (declared in ``RANK_SPEEDS_ENV``); empty for an even split.
        source: ``measured``, ``declared`` or ``even`` (no rank has measured a run yet, and none was declared).
    """

    images: tuple[int, ...]
    speeds: tuple[float, ...] = ()
    source: str = "even"

    def describe(self) -> str:
        counts = ", ".join(f"rank {r}: {n}" for r, n in enumerate(self.images))
        if self.source == "even":
            return f"data_parallel: images split evenly ({counts}); the next run follows the ranks' measured speeds"
        speeds = ", ".join(f"{s:.3g}" for s in self.speeds)
        unit = (
            "image-steps/s measured in the last run" if self.source == "measured" else f"declared in {RANK_SPEEDS_ENV}"
        )
        return f"data_parallel: images by speed ({counts}; speeds {speeds}, {unit})"


RANK_SPEEDS_ENV = "COMFY_PARALLEL_RANK_SPEEDS"  # relative speeds per rank ("1,0.5") for a first data-parallel run


@dataclasses.dataclass(frozen=True)
class DenoiseResult:
    shape: tuple[int, ...]
    cache: CacheReport | None = None  # rank 0's, when a step cache is on
    compile: CompileReport | None = None  # rank 0's, when compile is regional
    split: BatchSplit | None = None  # data parallelism's share of the images
    devices: tuple[str, ...] = ()  # each rank's device name, when a run over unequal ones waited for the slowest
    # A model's experts (their subfolders, in the order they ran) when they did not fit together and were held one at
    # a time, each loaded when the steps reached it.
    one_expert_at_a_time: tuple[str, ...] = ()

    def notes(self) -> list[str]:
        """What the sampler's node says about the run besides the image."""
        notes = [report.describe() for report in (self.cache, self.compile, self.split) if report is not None]
        if self.one_expert_at_a_time:
            notes.append(
                f"the experts did not fit together: held one at a time, swapped at the boundary "
                f"({' → '.join(self.one_expert_at_a_time)}), each loaded once per run"
            )
        if self.devices:
            notes.append(
                f"the ranks run on unequal devices ({', '.join(self.devices)}): every step waits for the slowest, "
                "which sets the pace (data_parallel gives each its own share instead)"
            )
        return notes


@dataclasses.dataclass(frozen=True)
class DenoiseArgs(OpArgs):
    """Load the transformer as ``transformer`` says (once; it stays resident) and run the denoising loop."""

    op: ClassVar[str] = "denoise"
    result: ClassVar[type] = DenoiseResult
    transformer: TransformerSpec
    sampling: Sampling


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    shape: tuple[int, ...]
    tiles_per_rank: tuple[int, ...] = ()  # decode_over_ranks: diffusers' tiles each rank decoded
    # Each decoding rank's peak memory during the decode above what it held before it (its VAE's weights not counted):
    # torch's allocated memory on a GPU, the rank's resident set on the CPU.
    peak_bytes_per_rank: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class DecodeArgs(OpArgs):
    """Decode LATENT samples with the model's VAE on one device ("cpu", "cuda:0", ...), or tiled over every rank's
    own device (``over_ranks``)."""

    op: ClassVar[str] = "decode"
    result: ClassVar[type] = DecodeResult
    model: ModelRef
    device: str
    dtype: Dtype
    over_ranks: bool = False  # diffusers' tiled decode, the tiles shared over the ranks (each on its own device)


@dataclasses.dataclass(frozen=True)
class VaeEncodeResult:
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class VaeEncodeArgs(OpArgs):
    """Encode IMAGE pixels (``[B, H, W, 3]`` in 0..1, sides multiples of the family's token size) to a LATENT with
    the model's VAE on one device ("cpu", "cuda:0", ...): the posterior's mode, in ComfyUI's convention."""

    op: ClassVar[str] = "vae_encode"
    result: ClassVar[type] = VaeEncodeResult
    model: ModelRef
    device: str
    dtype: Dtype


# -- housekeeping ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FreeResult:
    freed: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class FreeArgs(OpArgs):
    """Free resident models (these components, or all) on every rank."""

    op: ClassVar[str] = "free"
    result: ClassVar[type] = FreeResult
    components: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Memory:
    """A rank's device memory ("cuda": the GPU's; "cpu": the machine's, and the rank's own RSS). ``peak_bytes``: the
    most this rank held since its last stage op began (cuda: allocated by torch; cpu: its peak RSS), so a status
    after a stage says what that stage took."""

    kind: str
    total_bytes: int
    free_bytes: int
    allocated_bytes: int | None = None
    process_rss_bytes: int | None = None
    peak_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class ResidentModel:
    """A model component resident on a rank (one of a model's experts held alone is named by its subfolder), with the
    parallel degrees diffusers actually applied to it and its blocks that run compiled (``compiled_blocks``)."""

    model: str
    component: str
    placement: str
    dtype: str
    parameter_bytes: int
    parallelism: dict[str, int]
    load_seconds: float


@dataclasses.dataclass(frozen=True)
class RankStatus:
    rank: int
    local_rank: int
    world_size: int
    hostname: str
    pid: int
    device: str
    device_name: str
    memory: Memory
    resident: tuple[ResidentModel, ...]
    load_counts: dict[str, int]
    torch: str
    gpus: tuple[str, ...] = ()  # UUIDs of the GPUs this rank sees (every GPU of the backend on this machine)
    last_cache: CacheReport | None = None  # this rank's, from its last denoise (None: the step cache was off)
    last_passes: int | None = None  # transformer passes this rank ran in its last denoise


@dataclasses.dataclass(frozen=True)
class StatusArgs(OpArgs):
    """Every rank's device, memory and resident models."""

    op: ClassVar[str] = "status"
    result: ClassVar[type] = RankStatus


# -- diagnostics (comfy-parallel doctor, the runtime's tests) ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AllreduceResult:
    expected_factor: int


@dataclasses.dataclass(frozen=True)
class AllreduceArgs(OpArgs):
    """Each rank contributes tensor ``x`` × (rank + 1) to an all-reduce: the sum proves every rank took part once."""

    op: ClassVar[str] = "allreduce"
    result: ClassVar[type] = AllreduceResult


@dataclasses.dataclass(frozen=True)
class EchoResult:
    count: int


@dataclasses.dataclass(frozen=True)
class EchoArgs(OpArgs):
    """Rank 0 returns its input tensors: a shared-memory round trip."""

    op: ClassVar[str] = "echo"
    result: ClassVar[type] = EchoResult


@dataclasses.dataclass(frozen=True)
class StepsResult:
    completed: int


@dataclasses.dataclass(frozen=True)
class StepsArgs(OpArgs):
    """A stand-in for a denoising loop: ``steps`` steps of ``seconds_per_step`` with progress and cancel."""

    op: ClassVar[str] = "steps"
    result: ClassVar[type] = StepsResult
    steps: int = 10
    seconds_per_step: float = 0.05


@dataclasses.dataclass(frozen=True)
class PeerCopy:
    """One GPU pair's peer-to-peer check: its data came back intact (``ok``), in ``seconds``; ``error`` says what
    failed.

    Args:
        source, target: the pair (ranks for ``kind`` "collective", GPU indices of rank 0 for "copy").
        kind: "collective" (a send and a receive between two ranks: NCCL's peer-to-peer path on GPUs, gloo on CPU) or
            "copy" (rank 0 copies between two of its GPUs: the path device_map placement uses).
        peer_access: "copy" only: CUDA reports direct peer access between the two GPUs.
    """

    source: int
    target: int
    kind: str
    ok: bool
    seconds: float
    nbytes: int
    peer_access: bool | None = None
    error: str = ""


@dataclasses.dataclass(frozen=True)
class PeersResult:
    pairs: tuple[PeerCopy, ...]


@dataclasses.dataclass(frozen=True)
class PeersArgs(OpArgs):
    """Check every pair of ranks (a send and a receive of a known pattern) and, on rank 0, every pair of its GPUs (a
    copy): broken peer-to-peer gives wrong data or hangs, and ``doctor`` says to set ``NCCL_P2P_DISABLE=1``."""

    op: ClassVar[str] = "peers"
    result: ClassVar[type] = PeersResult
    nbytes: int = 8 << 20


class Fault(str, enum.Enum):
    """What an armed fault does at the next transformer load on its rank (tests only)."""

    LOAD_RAISES = "load_raises"  # the load fails with an OSError, as an unreadable file would
    LOAD_OUT_OF_MEMORY = "load_out_of_memory"  # the load fails with torch's OutOfMemoryError


@dataclasses.dataclass(frozen=True)
class ArmFaultResult:
    pass


@dataclasses.dataclass(frozen=True)
class ArmFaultArgs(OpArgs):
    """Make the next transformer load fail on one rank only (``fault`` says how), so that a test can drill a load
    that works on some ranks and fails on others. Served only by a backend started for tests."""

    op: ClassVar[str] = "arm_fault"
    result: ClassVar[type] = ArmFaultResult
    rank: int
    fault: Fault


class FailMode(str, enum.Enum):
    RAISE = "raise"  # every other rank finishes the op: the group stays usable
    RAISE_BEFORE_COLLECTIVE = "raise_before_collective"  # the others wait in a collective: the group is torn down
    EXIT = "exit"  # the process dies
    HANG = "hang"  # the rank sleeps for ever, still beating; the others wait for it in a collective
    HANG_SILENT = "hang_silent"  # the rank stops its heartbeat and sleeps for ever
    EXHAUST_MEMORY = "exhaust_memory"  # the rank allocates (and touches) memory until something stops it


@dataclasses.dataclass(frozen=True)
class FailResult:
    pass


@dataclasses.dataclass(frozen=True)
class FailArgs(OpArgs):
    """Fail on purpose on one rank, to drill error reporting. Served only by a backend started for tests."""

    op: ClassVar[str] = "fail"
    result: ClassVar[type] = FailResult
    rank: int = 0
    how: FailMode = FailMode.RAISE


@dataclasses.dataclass(frozen=True)
class OutputResult:
    nbytes: int


@dataclasses.dataclass(frozen=True)
class OutputArgs(OpArgs):
    """Rank 0 returns ``nbytes`` of zeros: the output side of the shared memory, for tests. Served only by a backend
    started for tests."""

    op: ClassVar[str] = "output"
    result: ClassVar[type] = OutputResult
    nbytes: int = 0


JSON = Any  # a JSON value as ``serial.to_json`` makes it
