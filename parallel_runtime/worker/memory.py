"""Will it fit? What a denoise or a decode needs on this rank, estimated from the model's config, the size and the
strategy before any weights load, against what the rank's device has free.

The estimates are coarse on purpose: they exist to refuse what cannot work (a 16384² image, a decode of a huge latent)
with an error naming the widget and the fix, instead of a rank killed for memory half-way through. Their arithmetic,
and how it was measured, is ``parallel_runtime/estimates.py`` (the strategy advisor uses the same).

Ranks of one machine on CPU share its memory, so there each rank counts what all of them need together.

``COMFY_PARALLEL_MEMORY_CAP_GB`` declares a smaller memory per rank to the ``auto`` memory policy (``room``) and to the
experts' check (``one_expert_at_a_time``), so a test or a benchmark can make "the encoders and the transformer do not
fit together", or "the two experts do not", happen on a large machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Iterator

import torch

from ..estimates import HEADROOM, activation_bytes, decode_bytes, hidden_size, weights_share
from ..families import FamilyAdapter, tp_sharded_share
from ..families.base import image_context_tokens, image_tokens
from ..gguf_files import gguf_weights
from ..strategy import StrategyPlan
from ..wire import FLOAT8_DTYPES, FP8_SCALE_SUFFIX, Sampling
from .diagnostics import memory_of
from .ops import WidgetError

CAP_ENV = "COMFY_PARALLEL_MEMORY_CAP_GB"


def _tensors_in(folder: str) -> Iterator[tuple[str, str, int]]:
    """(key, safetensors dtype, elements) of each tensor in a folder's safetensors files, from their headers."""
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            for key, t in header.items():
                if key != "__metadata__":
                    yield key, t["dtype"], math.prod(t["shape"])


def parameters_in(folder: str) -> int:
    """Parameters stored in a folder's safetensors files, read from their headers (nothing is loaded)."""
    return sum(n for _, _, n in _tensors_in(folder))


def weight_bytes_in(folder: str, dtype: torch.dtype, fp8_as_stored: bool) -> int:
    """Bytes a whole replica of the folder's weights takes on a rank: in ``dtype``, but the fp8 ones in fp8 (their
    float32 scales beside) when they are held as stored (``worker/fp8_weights.py``); a GGUF file's packed bytes (each
    rank holds the file's tensors as stored, ``gguf_files``)."""
    packed = gguf_weights(folder)
    if packed is not None:
        return os.path.getsize(packed)
    if not fp8_as_stored:
        return sum(n for key, _, n in _tensors_in(folder) if not key.endswith(FP8_SCALE_SUFFIX)) * dtype.itemsize
    sizes = dict.fromkeys(FLOAT8_DTYPES, 1)
    return sum(
        n * (4 if key.endswith(FP8_SCALE_SUFFIX) else sizes.get(kind, dtype.itemsize))
        for key, kind, n in _tensors_in(folder)
    )


def _components_bytes(model_dir: str, names: list[str] | tuple[str, ...], dtype: torch.dtype) -> int:
    """Bytes of the named components' weights in ``dtype``; a component the folder lacks counts nothing."""
    folders = (os.path.join(model_dir, name) for name in names)
    return sum(parameters_in(f) for f in folders if os.path.isdir(f)) * dtype.itemsize


def text_encoder_bytes(model_dir: str, dtype: torch.dtype) -> int:
    """Bytes of the text encoders' weights in ``dtype`` (every ``text_encoder*`` folder of the model)."""
    names = [n for n in sorted(os.listdir(model_dir)) if n.startswith("text_encoder")]
    return _components_bytes(model_dir, names, dtype)


def denoise_component_bytes(family: FamilyAdapter, model_dir: str, dtype: torch.dtype, references: bool) -> int:
    """Bytes of what the denoise loads beside the transformer (``FamilyAdapter.denoise_components``: the VAE that
    encodes the reference images or the start image, Wan 2.1 I2V's CLIP image encoder) in ``dtype``, the
    transformer's, in which the family loads them. They load on every run, resident transformer or not."""
    return _components_bytes(model_dir, family.denoise_components(references), dtype)


def context_tokens(family: FamilyAdapter, model_dir: str) -> int:
    """Tokens the folder's image encoder puts beside the text in the cross-attention's context
    (``families.base.image_context_tokens``: Wan 2.1 I2V's 257 CLIP tokens)."""
    path = os.path.join(model_dir, "image_encoder", "config.json")
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        return image_context_tokens(family, json.load(f))


def room(device: torch.device, local_ranks: int, held: int) -> int:
    """Bytes this rank may still fill before the ``auto`` policy frees a model: its share of the device's free memory
    (the ``local_ranks`` ranks of a CPU machine share it), and with ``CAP_ENV`` set no more than that cap less
    ``held``, what this rank's resident models hold."""
    free, sharing = _free(device, local_ranks)
    mine = int(free * HEADROOM / sharing)
    cap = _cap()
    return mine if cap is None else min(mine, cap - held)


def _cap() -> int | None:
    """``CAP_ENV``'s bytes, None when it is not set."""
    cap = os.environ.get(CAP_ENV)
    if not cap:
        return None
    try:
        return int(float(cap) * 2**30)
    except ValueError:
        raise ValueError(f"{CAP_ENV} must be a number of GiB, got {cap!r}") from None


def cap_without_room_for_encoders(
    family: FamilyAdapter, model_dir: str, plan: StrategyPlan, sampling: Sampling, text_tokens: int, dtype: torch.dtype
) -> str:
    """A ``CAP_ENV`` value (GiB) under which a rank holds the transformer and its step's activations but not the text
    encoders beside them as well: what a test or a benchmark declares to see ``auto`` behave as ``staged``."""
    transformer = weight_bytes_in(os.path.join(model_dir, "transformer"), dtype, fp8_as_stored=False)
    activations = step_activations(family, model_dir, plan, sampling, text_tokens, dtype)
    cap = transformer + activations + text_encoder_bytes(model_dir, dtype) // 2
    return f"{cap / 2**30:.12f}"


def cap_for_one_expert(
    family: FamilyAdapter,
    model_dir: str,
    plan: StrategyPlan,
    sampling: Sampling,
    text_tokens: int,
    dtype: torch.dtype,
    beside: int,
) -> str:
    """A ``CAP_ENV`` value (GiB) under which a rank holds one of the model's experts and its step's activations beside
    ``beside`` bytes of other resident models, but not every expert: what a test or a benchmark declares to see the
    experts held one at a time (``one_expert_at_a_time``), with a fifth of another expert's room to spare."""
    experts = _expert_bytes(family, model_dir, plan, dtype, fp8_as_stored=False)
    activations = step_activations(family, model_dir, plan, sampling, text_tokens, dtype)
    return f"{(beside + activations + max(experts) + min(experts) / 5) / 2**30:.12f}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


# What every GPU keeps free of a device_map placement's weights when max_memory is left empty: the CUDA context's
# growth, the allocator's fragmentation, NCCL's buffers.
GPU_MARGIN = 1 << 30


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What a stage was estimated to need on this rank, before anything loaded: for the out-of-memory message."""

    activations: int
    weights: int = 0  # what the stage loads: the transformer's (when not resident) and ``components``
    components: int = 0  # of ``weights``, what the denoise loads beside the transformer (``denoise_component_bytes``)

    def __str__(self) -> str:
        if not self.weights:
            return f"{_gib(self.activations)} of activations"
        total = _gib(self.activations + self.weights)
        return f"{total} ({_gib(self.weights)} of weights, {_gib(self.activations)} of activations)"


def _free(device: torch.device, local_ranks: int) -> tuple[int, int]:
    """(bytes this rank may count on, how many ranks share them)."""
    memory = memory_of(device)
    return memory.free_bytes, local_ranks if device.type == "cpu" else 1


def _room(plan: StrategyPlan, device: torch.device, local_ranks: int) -> tuple[int, int]:
    """(bytes this rank's weights and a step may take, how many ranks share them). device_map on GPUs spreads the
    weights over every GPU the rank sees and what does not fit them over the host (``default_budget``), so all of
    that is its room, not the first GPU's alone: a model larger than one GPU is what device_map is for."""
    if plan.spmd or device.type != "cuda":
        return _free(device, local_ranks if plan.spmd else 1)
    gpus = sum(torch.cuda.mem_get_info(index)[0] for index in range(torch.cuda.device_count()))
    return gpus + memory_of(torch.device("cpu")).free_bytes, 1


def step_activations(
    family: FamilyAdapter,
    model_dir: str,
    plan: StrategyPlan,
    sampling: Sampling,
    text_tokens: int,
    dtype: torch.dtype,
    reference_tokens: int = 0,
) -> int:
    """Bytes of activations one denoising step holds on a rank at its peak (``estimates.activation_bytes``), over
    the image's tokens, the text's (with an image encoder's beside it, ``context_tokens``) and the reference
    images' (``families.base.reference_tokens``)."""
    with open(os.path.join(model_dir, "transformer", "config.json")) as f:
        config = json.load(f)
    text_tokens += context_tokens(family, model_dir)
    tokens = image_tokens(family, sampling.width, sampling.height, sampling.frames) + text_tokens + reference_tokens
    images = math.ceil(sampling.batch_size / plan.ranks) if plan.splits_batch else sampling.batch_size
    return activation_bytes(plan, hidden_size(config), tokens, images, dtype.itemsize)


def _sharded_share(plan: StrategyPlan, folder: str) -> float:
    """The share of the transformer in ``folder`` that ``plan`` splits (read only under tensor parallelism)."""
    if not plan.shards_weights:
        return 0.0
    with open(os.path.join(folder, "config.json")) as f:
        return tp_sharded_share(json.load(f))


def check_denoise(
    family: FamilyAdapter,
    model_dir: str,
    plan: StrategyPlan,
    sampling: Sampling,
    text_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    local_ranks: int,
    loads_weights: bool,
    freed_by_load: int,
    fp8_as_stored: bool = False,
    reference_tokens: int = 0,
    references: bool = False,
    one_expert: bool = False,
) -> Estimate:
    """What the denoise needs on this rank; WidgetError (``width``) when it cannot fit this rank's device. Weights
    stored in fp8 count 1 byte each when the rank holds them so (``fp8_as_stored``). ``reference_tokens``: the
    reference images' tokens in the sequence; ``references``: the run has reference images (or a start image), which
    decides what the family loads beside the transformer (``denoise_component_bytes``, counted on every run).
    ``one_expert``: a model's experts are held one at a time (``one_expert_at_a_time``)."""
    activations = step_activations(family, model_dir, plan, sampling, text_tokens, dtype, reference_tokens)
    images = math.ceil(sampling.batch_size / plan.ranks) if plan.splits_batch else sampling.batch_size
    weights = 0
    if loads_weights:
        # Every expert of a model with several (Wan 2.2 A14B) stays resident, the step switching between them, unless
        # they are held one at a time.
        experts = _expert_bytes(family, model_dir, plan, dtype, fp8_as_stored)
        weights = max(experts) if one_expert else sum(experts)
    components = denoise_component_bytes(family, model_dir, dtype, references)
    weights += components
    free, sharing = _room(plan, device, local_ranks)
    need, have = (activations + weights) * sharing, (free + freed_by_load * sharing) * HEADROOM
    if need > have or activations > _free(device, 1)[0] * HEADROOM:  # a step runs on one device at a time
        split = f" (its tokens split over {plan.cp_degree} ranks)" if plan.splits_tokens else ""
        plus = f", plus {_gib(weights)} of weights" if weights else ""
        if components:
            loaded = " and ".join(family.denoise_components(references))
            plus += f" ({_gib(components)} of them the {loaded} the denoise loads beside the transformer)"
        where = f"the {sharing} ranks on this machine's memory have" if sharing > 1 else f"{device} has"
        if not plan.spmd and device.type == "cuda":
            where = "the GPUs and the host's memory (device_map spreads the weights over them) have"
        clip = f" × {sampling.frames} frames" if sampling.frames > 1 else ""
        size = f"{sampling.width}×{sampling.height}{clip} × {images} image(s)"
        raise WidgetError(
            "width",
            f"{size} needs about {_gib(activations)} of activations per rank for {family.name} "
            f"under {plan.strategy.value}{split}{plus}; {where} {_gib(free)} free. Use a smaller "
            "width and height, length or batch_size, context_parallel over more ranks (it splits the "
            "activations), "
            + ("tensor_parallel or device_map (they split the transformer's weights), " if weights else "")
            + "or free memory",
        )
    return Estimate(activations, int(weights), components)


def _expert_bytes(
    family: FamilyAdapter, model_dir: str, plan: StrategyPlan, dtype: torch.dtype, fp8_as_stored: bool
) -> list[float]:
    """Bytes of each of the model's transformers (its experts: Wan 2.2 A14B's two) on a rank of ``plan``."""
    folders = [os.path.join(model_dir, subfolder) for subfolder in family.transformer_subfolders(model_dir)]
    return [
        weight_bytes_in(folder, dtype, fp8_as_stored) * weights_share(plan, _sharded_share(plan, folder))
        for folder in folders
    ]


def one_expert_at_a_time(
    family: FamilyAdapter,
    model_dir: str,
    plan: StrategyPlan,
    dtype: torch.dtype,
    device: torch.device,
    *,
    policy: str,
    activations: int,
    local_ranks: int,
    held: int,
    freed_by_load: int,
    fp8_as_stored: bool = False,
) -> bool:
    """Whether this rank holds the model's experts (Wan 2.2 A14B's two) one at a time: they do not fit it together
    beside the step's activations, but the largest does (counting what loading frees first, ``freed_by_load``, and
    with ``CAP_ENV`` set no more than that cap less ``held``, what this rank's resident models hold). The ``staged``
    and ``auto`` policies then load the next expert when the steps reach it, freeing the one before; ``resident``,
    which keeps what it loads, is refused (WidgetError ``memory_policy``) with that fix."""
    experts = _expert_bytes(family, model_dir, plan, dtype, fp8_as_stored)
    if len(experts) < 2:
        return False
    free, sharing = _room(plan, device, local_ranks)
    have = (free / sharing + freed_by_load) * HEADROOM
    cap = _cap()
    if cap is not None:
        have = min(have, cap - held + freed_by_load)
    if activations + sum(experts) <= have or activations + max(experts) > have:
        return False  # they fit together, or one does not fit either (check_denoise says so)
    if policy == "resident":
        raise WidgetError(
            "memory_policy",
            f"{family.name}'s {len(experts)} experts need {_gib(sum(experts))} together beside "
            f"{_gib(activations)} of activations per rank, and the rank has room for {_gib(have)}: one fits, not "
            "both; set memory_policy to staged or auto (they hold one expert at a time, loading the low-noise one "
            "when the steps reach it), use tensor_parallel or more ranks, or free memory",
        )
    return True


def default_budget(
    free_by_gpu: list[int], reserve_first: int, activations: int, host_free: int
) -> dict[int | str, int]:
    """``max_memory`` for a ``device_map`` placement the user left unbounded: each GPU's free memory less
    ``GPU_MARGIN`` and the activations of the blocks it will run, and the first GPU (where the inputs, the
    embeddings and, after the denoise, the VAE live) less ``reserve_first`` too. accelerate would otherwise fill the
    first GPU with weights to the brim and the first step or the decode would run out of memory there. What does not
    fit the GPUs goes to the host (``host_free``), as accelerate's own default would put it."""
    budget: dict[int | str, int] = {}
    for index, free in enumerate(free_by_gpu):
        keep = GPU_MARGIN + activations + (reserve_first if index == 0 else 0)
        budget[index] = max(0, free - keep)
    budget["cpu"] = host_free
    return budget


def describe_budget(budget: dict[int | str, int]) -> str:
    """What a ``default_budget`` gives each GPU, and which one limits the split: the GPU with the least room holds the
    fewest layers (on unequal or unequally busy GPUs, the smaller or busier one)."""
    gpus = {k: v for k, v in budget.items() if isinstance(k, int)}
    if not gpus:
        return ""
    shares = ", ".join(f"GPU {k} {_gib(v)}" for k, v in gpus.items())
    least = min(gpus, key=lambda k: gpus[k])
    return (
        f"device_map budget from each GPU's free memory: {shares}; GPU {least} has the least room and limits the split"
    )


def decode_need(
    family: FamilyAdapter, vae_config: dict, images: int, width: int, height: int, dtype: torch.dtype
) -> int:
    """Bytes a VAE decode of ``images`` of ``width`` × ``height`` holds at its peak (its first-level feature maps,
    ``estimates.VAE_COPIES`` of them)."""
    return decode_bytes(
        family.decoder_channels(vae_config), images, width, height, dtype.itemsize, family.decode_copies
    )


def samples_size(family: FamilyAdapter, samples: torch.Tensor) -> tuple[int, int, int]:
    """(images, width, height) of LATENT samples."""
    down = family.latent.downscale
    return samples.shape[0], samples.shape[-1] * down, samples.shape[-2] * down


def decode_is_short(need: int, device: torch.device) -> bool:
    """The device has too little free memory for a decode that needs ``need`` bytes."""
    return need > memory_of(device).free_bytes * HEADROOM


def check_decode(
    family: FamilyAdapter, vae_config: dict, samples: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> Estimate:
    """What decoding these latents needs; WidgetError (``samples``) when it cannot fit the device."""
    count, width, height = samples_size(family, samples)
    need = decode_need(family, vae_config, count, width, height, dtype)
    free, _ = _free(device, 1)
    if need > free * HEADROOM:
        frames = samples.shape[2] if samples.ndim == 5 else 1
        clip = f" × {family.latent.temporal_downscale * (frames - 1) + 1} frames" if frames > 1 else ""
        images = f"{count} image(s) of {width}×{height}{clip}"
        raise WidgetError(
            "samples",
            f"decoding {images} needs about {_gib(need)} on {device}, which has {_gib(free)} "
            "free; turn on decode_over_ranks (the VAE's tiles shared over the ranks: a GPU holds one tile's decode at "
            "a time), decode a smaller latent (or fewer images at once), or use ComfyUI's VAEDecodeTiled",
        )
    return Estimate(need)


def check_encode(
    family: FamilyAdapter, vae_config: dict, pixels: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> None:
    """WidgetError (``pixels``) when encoding these images cannot fit the device: the encoder's first level holds
    about as many full-resolution feature maps as the decoder's last (``estimates.VAE_COPIES``)."""
    images, height, width = pixels.shape[0], pixels.shape[1], pixels.shape[2]
    need = decode_bytes(family.decoder_channels(vae_config), images, width, height, dtype.itemsize)
    free, _ = _free(device, 1)
    if need > free * HEADROOM:
        raise WidgetError(
            "pixels",
            f"encoding {images} image(s) of {width}×{height} needs about {_gib(need)} on {device}, which has "
            f"{_gib(free)} free; encode smaller or fewer images at once, or use ComfyUI's VAEEncodeTiled",
        )
