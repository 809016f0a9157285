"""A LoRA file as diffusers reads it for a family's transformer: the one reading the client's checks and the ranks
share, so the LoRA that passed validation is the LoRA the ranks apply.

The family's diffusers pipeline converts the layouts LoRAs are published in (diffusers / PEFT, kohya ``lora_unet_…``,
BFL / ComfyUI ``diffusion_model.…``, xlabs for FLUX.1) to diffusers' module names (``FamilyAdapter.lora_state_dict``).
What is left is family-agnostic and happens here: the file must be safetensors with a sound header, its content the
one the caller expects (its sha256, read through one open descriptor, so a file replaced under its name is never read
half old, half new); its alphas finite, positive and at most ``MAX_ALPHA_PER_RANK`` times their rank, checked before
diffusers' converters see them (one of them loops forever on a negative alpha); the parts that
are not the transformer's (kohya ``lora_te*`` text-encoder weights) are set aside; every remaining key must be a
LoRA pair for a linear layer of this transformer (with, perhaps, PEFT's ``lora_B.bias``: a change of the layer's
bias), of its shape, with matching ranks and finite values; and the scale
PEFT gives each layer (alpha / rank, with diffusers' rules for network alphas and adapter metadata) is read from PEFT
itself, on a skeleton of the transformer built on the meta device (no weights, no memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .base import FamilyAdapter

log = logging.getLogger(__name__)

SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
# A LoRA's tensors per layer, after ``<prefix>.<module>.``.
_PAIR = ("lora_A.weight", "lora_B.weight")
_BIAS = "lora_B.bias"  # PEFT's lora_bias: a bias change beside the pair (Wan's step-distillation LoRAs' diff_b)
# Keys of a file that belong to a text encoder (kohya's lora_te / lora_te1 / lora_te2, ComfyUI's text_encoders.…, and
# diffusers' own text_encoder / text_encoder_2 prefixes after conversion).
_TEXT_ENCODER_PREFIXES = ("lora_te", "text_encoder")
# A layer's scale is alpha / rank; published LoRAs keep it near 1 (alpha = rank, or a few times it). Far beyond, the
# merged delta overflows the weights' dtype (a kohya alpha of 1e30 gives an all-NaN latent).
MAX_ALPHA_PER_RANK = 1000.0


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

    def bias(self, module: str) -> torch.Tensor | None:
        """The layer's bias change beside its pair (PEFT's ``lora_B.bias``, scaled as the pair is), or None."""
        return self.state_dict.get(f"transformer.{module}.lora_B.bias")


def _check_suffix(path: str) -> None:
    """A pickle's suffix refused, with the reason."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SAFETENSORS_SUFFIXES:
        raise LoraError(
            f"is a {suffix or 'suffix-less'} file; only .safetensors LoRAs are loaded, because {suffix or 'such'} "
            "files are Python pickles that can run code when they are read. Get the .safetensors release of the "
            "LoRA, or convert it (load it with torch.load where you trust it, save it with safetensors' save_file)"
        )


def check_file(path: str) -> list[str]:
    """The keys of a safetensors file whose header reads and covers the file; LoraError saying what is wrong otherwise.

    Only the header is read (``safe_open`` checks that the tensors' offsets cover the file exactly), so a file cut
    short by a failed download is caught here."""
    _check_suffix(path)
    return _keys(path)


def _keys(path: str) -> list[str]:
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


def sha256(path: str) -> str:
    """The file's content identity: the hex sha256 of its bytes (0.1–0.2 s per 100 MB)."""
    digest = hashlib.sha256()  # read in blocks, not hashlib.file_digest: the pack runs on Python 3.10 too
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _pinned(path: str, expected_sha256: str | None) -> Iterator[str]:
    """The file opened once, as a path that reads that very opening, its content checked against ``expected_sha256``
    when given. A file replaced under its name (a rename) is not seen through the opening; one rewritten in place while
    it is read changes its modification time, which is compared after; LoraError when either changes what was
    expected."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise LoraError(f"cannot be read ({e.strerror}); check the file") from None
    try:
        before = os.fstat(fd)
        if expected_sha256 is not None and sha256(f"/proc/self/fd/{fd}") != expected_sha256:
            raise LoraError(
                "changed since it was checked, or is another file on this machine than on ComfyUI's (its content "
                "differs); queue the prompt again, replace a LoRA only while no prompt that uses it is queued, and "
                "give every machine the same copy"
            )
        yield f"/proc/self/fd/{fd}"
        after = os.fstat(fd)
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise LoraError("was rewritten while it was read; queue the prompt again once the file is complete")
    finally:
        os.close(fd)


def _number(value: object) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _check_alpha(where: str, alpha: float | None, rank: int | None) -> None:
    if alpha is None or not math.isfinite(alpha):
        raise LoraError(f"has the alpha {where} = {alpha}, which is not a finite number; the file is damaged")
    if alpha <= 0:
        raise LoraError(
            f"has the alpha {where} = {alpha:g}; an alpha must be positive (a LoRA's scale is alpha / rank): the "
            "file is damaged — to apply a LoRA the other way, set the loader's strength negative instead"
        )
    bound = MAX_ALPHA_PER_RANK * (rank or 1)
    if alpha > bound:
        raise LoraError(
            f"has the alpha {where} = {alpha:g}, more than {MAX_ALPHA_PER_RANK:g} × its rank ({rank or 1}); such a "
            "scale overflows the weights (a black or NaN image): the file is damaged"
        )


def check_alphas(path: str) -> None:
    """The file's alphas (kohya / BFL ``<module>.alpha`` tensors, and ``lora_alpha`` / ``alpha_pattern`` in diffusers'
    adapter metadata) finite, positive and at most ``MAX_ALPHA_PER_RANK`` × their rank; LoraError naming the key
    otherwise. Reads the header and the alpha scalars only."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        for key in sorted(k for k in keys if k.endswith(".alpha")):
            if f.get_slice(key).get_shape() not in ([], [1]):
                raise LoraError(f"has the alpha {key} of shape {f.get_slice(key).get_shape()}; an alpha is one number")
            stem = key.removesuffix(".alpha")
            down = next((f"{stem}.{p}" for p in ("lora_down.weight", "lora_A.weight") if f"{stem}.{p}" in keys), None)
            rank = f.get_slice(down).get_shape()[0] if down is not None else None
            _check_alpha(key, _number(f.get_tensor(key).float().item()), rank)
        raw = (f.metadata() or {}).get("lora_adapter_metadata")
    if raw is None:
        return
    try:
        metadata = json.loads(raw)
    except (ValueError, RecursionError):
        raise LoraError("has adapter metadata (lora_adapter_metadata) that is not JSON; the file is damaged") from None
    if not isinstance(metadata, dict):
        raise LoraError("has adapter metadata (lora_adapter_metadata) that is not a JSON object; the file is damaged")
    # diffusers writes each component's fields with its prefix ("transformer.lora_alpha"); PEFT's own, without.
    adapters: dict[str, dict] = {}
    for key, value in metadata.items():
        prefix, _, field = key.rpartition(".")
        adapters.setdefault(prefix, {})[field] = value
    for prefix, fields in sorted(adapters.items()):
        name = f"{prefix}." if prefix else ""
        rank = fields.get("r") if isinstance(fields.get("r"), int) else None
        if "lora_alpha" in fields:
            _check_alpha(f"{name}lora_alpha (adapter metadata)", _number(fields["lora_alpha"]), rank)
        patterns = fields.get("alpha_pattern") or {}
        ranks = fields.get("rank_pattern") if isinstance(fields.get("rank_pattern"), dict) else {}
        if not isinstance(patterns, dict):
            raise LoraError(f"has an {name}alpha_pattern (adapter metadata) that is not a JSON object; it is damaged")
        for module, alpha in sorted(patterns.items()):
            module_rank = ranks.get(module) if isinstance(ranks.get(module), int) else rank
            _check_alpha(f"{name}alpha_pattern[{module!r}] (adapter metadata)", _number(alpha), module_rank)


def meta_transformer(family: FamilyAdapter, config: dict) -> torch.nn.Module:
    """The family's transformer built from its config on the meta device: every layer and shape, no weights."""
    cls = family.transformer_class()
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        return cls.from_config(config)


def read_lora(family: FamilyAdapter, path: str, config: dict, expected_sha256: str | None = None) -> LoraWeights:
    """Read and check a LoRA file for the transformer whose config.json is ``config``; LoraError saying what is wrong.

    Checked: a safetensors file with a sound header, whose content is ``expected_sha256`` when given (read through one
    opening, see ``_pinned``); sane alphas (``check_alphas``); at least one key for the transformer; every such key a
    LoRA pair (lora_A / lora_B) for a linear layer the transformer has, of that layer's shape, with equal ranks on both
    sides and finite values."""
    _check_suffix(path)
    with _pinned(path, expected_sha256) as opened:
        return _read(family, opened, config)


def _read(family: FamilyAdapter, path: str, config: dict) -> LoraWeights:
    raw_keys = _keys(path)
    check_alphas(path)
    text_encoder_keys = sum(key.startswith(_TEXT_ENCODER_PREFIXES) for key in raw_keys)
    notes = _Warnings()
    converter = logging.getLogger("diffusers.loaders.lora_conversion_utils")
    converter.addHandler(notes)
    try:
        state_dict, network_alphas, metadata = family.lora_state_dict(path)
    except LoraError:  # the family's own refusal, in its words
        raise
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
        if not dot or part not in (*_PAIR, _BIAS):
            what = "a DoRA magnitude" if "lora_magnitude_vector" in key else "not a LoRA pair (lora_A / lora_B)"
            raise LoraError(
                f"holds {key}, which is {what}; only LoRA pairs (and their biases) are applied (a Control LoRA, a "
                "DoRA or a fine-tuned layer is not a LoRA this loader can apply)"
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
        bias = tensors.get(_BIAS)
        if bias is not None and (layer.bias is None or tuple(bias.shape) != (layer.out_features,)):
            raise LoraError(
                f"has a bias change of shape {list(bias.shape)} for {module}, which "
                + ("has no bias" if layer.bias is None else f"has {layer.out_features} outputs")
                + "; it is a LoRA for another model"
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
