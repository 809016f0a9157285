"""A LoRA file as diffusers reads it for a family's transformer: the one reading the client's checks and the ranks
share, so the LoRA that passed validation is the LoRA the ranks apply.

The family's diffusers pipeline converts the layouts LoRAs are published in (diffusers / PEFT, kohya ``lora_unet_…``,
BFL / ComfyUI ``diffusion_model.…``, xlabs for FLUX.1) to diffusers' module names (``FamilyAdapter.lora_state_dict``).
What is left is family-agnostic and happens here: the file must be safetensors with a sound header; the parts that
are not the transformer's (kohya ``lora_te*`` text-encoder weights) are set aside; every remaining key must be a
LoRA pair for a linear layer of this transformer, of its shape, with matching ranks and finite values; and the scale
PEFT gives each layer (alpha / rank, with diffusers' rules for network alphas and adapter metadata) is read from PEFT
itself, on a skeleton of the transformer built on the meta device (no weights, no memory).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .base import FamilyAdapter

log = logging.getLogger(__name__)

SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
# A LoRA's tensors per layer, after ``<prefix>.<module>.``.
_PAIR = ("lora_A.weight", "lora_B.weight")
# Keys of a file that belong to a text encoder (kohya's lora_te / lora_te1 / lora_te2, ComfyUI's text_encoders.…, and
# diffusers' own text_encoder / text_encoder_2 prefixes after conversion).
_TEXT_ENCODER_PREFIXES = ("lora_te", "text_encoder")


class LoraError(ValueError):
    """What is wrong with a LoRA file, in words for the user; the caller names the widget (``lora_name``)."""


@dataclasses.dataclass(frozen=True)
class LoraWeights:
    """A LoRA file read for one transformer.

    Args:
        state_dict: the transformer's part in diffusers' layout, ``transformer.<module>.lora_A.weight`` and so on, as
            ``load_lora_adapter(prefix="transformer")`` takes it.
        network_alphas: the alphas diffusers read beside the weights (kohya-style files), or None.
        metadata: diffusers' adapter metadata from the file's header (``lora_adapter_metadata``), or None.
        scales: each layer's scale as PEFT computes it (alpha / rank): the delta of ``module`` at strength s is
            ``s * scales[module] * B @ A``.
        text_encoder_keys: how many keys of the file are for text encoders; they are not applied.
        notes: what diffusers' converter said it left out (its warnings), for the user.
    """

    state_dict: dict[str, torch.Tensor] = dataclasses.field(repr=False)
    network_alphas: dict[str, torch.Tensor] | None = dataclasses.field(repr=False)
    metadata: dict | None
    scales: dict[str, float]
    text_encoder_keys: int = 0
    notes: tuple[str, ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(sorted(self.scales))

    def factors(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)`` of one layer, as stored in the file (its dtype, on the CPU)."""
        key = f"transformer.{module}."
        return self.state_dict[key + "lora_A.weight"], self.state_dict[key + "lora_B.weight"]


def check_file(path: str) -> list[str]:
    """The keys of a safetensors file whose header reads and covers the file; LoraError saying what is wrong otherwise.

    Only the header is read (``safe_open`` checks that the tensors' offsets cover the file exactly), so a file cut
    short by a failed download is caught here."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SAFETENSORS_SUFFIXES:
        raise LoraError(
            f"is a {suffix or 'suffix-less'} file; only .safetensors LoRAs are loaded, because {suffix or 'such'} "
            "files are Python pickles that can run code when they are read. Get the .safetensors release of the "
            "LoRA, or convert it (load it with torch.load where you trust it, save it with safetensors' save_file)"
        )
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            keys = list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraError(
            f"is not a readable safetensors file ({e}); it may be cut short or damaged: download it again"
        ) from None
    if not keys:
        raise LoraError("holds no tensors; it is not a LoRA")
    return keys


def meta_transformer(family: FamilyAdapter, config: dict) -> torch.nn.Module:
    """The family's transformer built from its config on the meta device: every layer and shape, no weights."""
    cls = family.transformer_class()
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        return cls.from_config(config)


def read_lora(family: FamilyAdapter, path: str, config: dict) -> LoraWeights:
    """Read and check a LoRA file for the transformer whose config.json is ``config``; LoraError saying what is wrong.

    Checked: a safetensors file with a sound header; at least one key for the transformer; every such key a LoRA pair
    (lora_A / lora_B) for a linear layer the transformer has, of that layer's shape, with equal
    ranks on both sides and finite values."""
    raw_keys = check_file(path)
    text_encoder_keys = sum(key.startswith(_TEXT_ENCODER_PREFIXES) for key in raw_keys)
    notes = _Warnings()
    converter = logging.getLogger("diffusers.loaders.lora_conversion_utils")
    converter.addHandler(notes)
    try:
        state_dict, network_alphas, metadata = family.lora_state_dict(path)
    except Exception as e:  # diffusers' converters fail in many ways on a file of another model
        message = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise LoraError(
            f"diffusers cannot read it as a {family.name} LoRA ({message}); it is probably a LoRA for another model"
        ) from None
    finally:
        converter.removeHandler(notes)
    skeleton = meta_transformer(family, config)
    layers = dict(skeleton.named_modules())
    transformer, others = {}, []
    for key, value in state_dict.items():
        if key.startswith("transformer."):
            transformer[key] = value
        elif key.split(".lora_")[0] in layers:
            # diffusers 0.42.1 converts some kohya FLUX.1 layers (img_in, txt_in, time_in, vector_in, guidance_in,
            # final_layer) without the "transformer." prefix, and its load_lora_weights then drops them unnoticed.
            transformer["transformer." + key] = value
        else:
            others.append(key)
    if not transformer:
        if text_encoder_keys or any(key.startswith(_TEXT_ENCODER_PREFIXES) for key in others):
            raise LoraError(f"holds only text-encoder weights, nothing for the {family.name} transformer")
        shown = ", ".join(raw_keys[:2])
        raise LoraError(
            f"has no key that diffusers maps to a layer of this {family.name} transformer (its keys look like "
            f"{shown}): it is a LoRA for another model, or in a layout diffusers cannot read for {family.name}"
        )
    _check_pairs(family, transformer, layers)
    if network_alphas:
        network_alphas = {k: v for k, v in network_alphas.items() if k.startswith("transformer.")} or None
    scales = _scales(family, config, transformer, network_alphas, metadata)
    return LoraWeights(transformer, network_alphas, metadata, scales, text_encoder_keys, tuple(notes.messages))


class _Warnings(logging.Handler):
    """diffusers' converters log what they leave out ("Unsupported keys ...") rather than raise: keep it."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message if len(message) <= 300 else message[:300] + "…")


def _check_pairs(family: FamilyAdapter, state_dict: dict[str, torch.Tensor], layers: dict[str, Any]) -> None:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        module, dot, part = key.removeprefix("transformer.").partition(".lora_")
        part = "lora_" + part
        if not dot or part not in _PAIR:
            if "lora_magnitude_vector" in key:
                what = "a DoRA magnitude"
            elif part == "lora_B.bias":
                what = "a bias on lora_B (PEFT's lora_bias)"
            else:
                what = "not a LoRA pair (lora_A / lora_B)"
            raise LoraError(
                f"holds {key}, which is {what}; only plain LoRA pairs are applied (a Control LoRA, a DoRA, a LoRA "
                "with biases or a fine-tuned layer is not a LoRA this loader can apply)"
            )
        parts.setdefault(module, {})[part] = value
    for module, tensors in sorted(parts.items()):
        layer = layers.get(module)
        if layer is None:
            raise LoraError(
                f"changes {module}, a layer this {family.name} transformer does not have; it is a LoRA for another "
                "model"
            )
        if not isinstance(layer, torch.nn.Linear):
            raise LoraError(f"changes {module}, a {type(layer).__name__}; only linear layers take a LoRA here")
        missing = [p for p in _PAIR if p not in tensors]
        if missing:
            raise LoraError(f"has no {missing[0]} for {module}: the pair is incomplete, the file is damaged")
        a, b = tensors["lora_A.weight"], tensors["lora_B.weight"]
        if a.ndim != 2 or b.ndim != 2:
            raise LoraError(f"has {a.ndim}-D / {b.ndim}-D factors for {module}; a linear layer's LoRA is 2-D")
        if a.shape[0] != b.shape[1]:
            raise LoraError(
                f"has a rank mismatch in {module}: lora_A has rank {a.shape[0]} but lora_B rank {b.shape[1]}; the "
                "file is damaged or not a LoRA"
            )
        if (b.shape[0], a.shape[1]) != (layer.out_features, layer.in_features):
            raise LoraError(
                f"is for another model: {module} is {layer.out_features}×{layer.in_features} in this transformer but "
                f"{b.shape[0]}×{a.shape[1]} in the LoRA"
            )
        for part, tensor in tensors.items():
            if not torch.isfinite(tensor).all():
                raise LoraError(f"holds NaN or infinite values in {module}.{part}; the file is damaged")


def _scales(
    family: FamilyAdapter,
    config: dict,
    state_dict: dict[str, torch.Tensor],
    network_alphas: dict[str, torch.Tensor] | None,
    metadata: dict | None,
) -> dict[str, float]:
    """Each layer's scale, from the adapter PEFT builds for this state dict (diffusers' ``load_lora_adapter``, the
    very call the pipelines make) on a meta skeleton: the ranks' fused deltas use the scale PEFT would."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # a ComfyUI whose Python got the pack without its dependencies
        raise LoraError(
            "cannot be read without the peft package, through which diffusers reads LoRAs: pip install 'peft>=0.17'"
        ) from None

    skeleton = meta_transformer(family, config)
    name = "scales"
    with warnings.catch_warnings():
        # PEFT warns about layers its target names match beyond the state dict's; they get no weights and no delta.
        warnings.simplefilter("ignore")
        skeleton.load_lora_adapter(
            dict(state_dict),
            network_alphas=dict(network_alphas) if network_alphas else None,
            metadata=metadata,
            prefix="transformer",
            adapter_name=name,
            low_cpu_mem_usage=True,
        )
    wanted = {key.removeprefix("transformer.").partition(".lora_")[0] for key in state_dict}
    scales = {
        module: float(layer.scaling[name])
        for module, layer in skeleton.named_modules()
        if isinstance(layer, BaseTunerLayer) and module in wanted
    }
    missing = sorted(wanted - set(scales))
    if missing:
        raise LoraError(f"changes {missing[0]}, but diffusers placed no LoRA there; it is not a LoRA for this model")
    return scales
