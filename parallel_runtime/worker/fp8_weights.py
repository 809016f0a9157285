"""fp8 weights held as fp8 on a rank, computed in the run's dtype: one hook per layer whose weight the folder stores
in fp8.

A converted ComfyUI file keeps its fp8 matrices as they are, and a scaled-fp8 file's scales beside them
(``<layer>.weight_scale``, float32: one per tensor, or one per output row; ``comfy_files``). Before a layer runs, its
hook makes the weight it computes with — the fp8 tensor cast to float32, times its scale, plus the LoRAs merged into
it (``worker/lora.py``), cast to the run's dtype — and drops it again after: at most one layer's weight in the run's
dtype exists at a time, beside the fp8 ones the rank keeps. This is diffusers' layerwise casting
(``hooks/layerwise_casting.py``: cast the weight up before the forward, back after) with two differences: the scale
is applied in the cast (layerwise casting has none), and only the weights the file stores in fp8 are held in fp8 —
layerwise casting would store every weight and bias of a layer it hooks in fp8, rounding the bf16 biases, norms and
the layers a mixed file keeps in bf16 on purpose, which the pack never does silently. A plain-fp8 weight gives
exactly the values the old bf16 copy had (fp8 values are exact in bf16 and float32); a scaled one what the old
conversion computed (weight × scale in float32, then the dtype).

Under tensor parallelism the held weight is this rank's fp8 slice (a DTensor) with its slice of the scales
(``worker/tp_slices.py``): the computed weight is made from the local slice and placed as the held one is.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ..wire import FLOAT8_DTYPES, FP8_SCALE_SUFFIX
from .ops import OpError

FLOAT8_NAMES = dict(zip(FLOAT8_DTYPES, (torch.float8_e4m3fn, torch.float8_e5m2), strict=True))  # by safetensors' names
# The layers whose forward reads ``self.weight`` as a whole (what the hook swaps): others get their weight cast at load.
HELD_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def per_row(scale: torch.Tensor, weight_ndim: int) -> torch.Tensor:
    """A scale shaped to multiply its weight: a scalar stays one, one per output row becomes a column."""
    if scale.numel() == 1:
        return scale.reshape(())
    return scale.reshape(-1, *([1] * (weight_ndim - 1)))


def dequantized(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``stored`` (fp8) as the run computes with it: cast to float32, times ``scale``, in ``dtype``."""
    if scale is None:
        return stored.to(dtype)
    return (stored.to(torch.float32) * per_row(scale, stored.ndim).to(stored.device)).to(dtype)


@dataclasses.dataclass
class LoraFactors:
    """One LoRA's part of a held layer: ``factor`` × ``b`` @ ``a`` (this rank's slices, float32)."""

    factor: float
    b: torch.Tensor
    a: torch.Tensor


def _hook_class() -> type:
    """The hook class (diffusers imported when a rank first holds fp8, not when this module is)."""
    from diffusers.hooks.hooks import ModelHook

    class Fp8WeightHook(ModelHook):
        """Swap a layer's held fp8 weight for its computed one around the forward (see the module docstring)."""

        _is_stateful = False

        def __init__(self, scale: torch.Tensor | None, compute_dtype: torch.dtype):
            super().__init__()
            self.scale = scale
            self.compute_dtype = compute_dtype
            self.loras: list[LoraFactors] = []
            self.held: torch.nn.Parameter | None = None  # the fp8 weight, while the layer runs

        def compute_weight(self, held: torch.Tensor) -> torch.Tensor:
            from torch.distributed.tensor import DTensor

            local = held.to_local() if isinstance(held, DTensor) else held
            if self.loras:
                weight = dequantized(local, self.scale, torch.float32)
                for lora in self.loras:
                    weight += lora.factor * (lora.b.to(weight.device) @ lora.a.to(weight.device))
                weight = weight.to(self.compute_dtype)
            else:
                weight = dequantized(local, self.scale, self.compute_dtype)
            if isinstance(held, DTensor):
                return DTensor.from_local(weight, held.device_mesh, held.placements, run_check=False)
            return weight

        def pre_forward(self, module: torch.nn.Module, *args: object, **kwargs: object) -> tuple:
            if self.held is not None:  # the last forward raised before post_forward: its weight is the held one
                module._parameters["weight"] = self.held
            self.held = module._parameters["weight"]
            module._parameters["weight"] = torch.nn.Parameter(self.compute_weight(self.held.data), requires_grad=False)
            return args, kwargs

        def post_forward(self, module: torch.nn.Module, output: object) -> object:
            module._parameters["weight"], self.held = self.held, None
            return output

    return Fp8WeightHook


def hold(module: torch.nn.Module, scale: torch.Tensor | None, compute_dtype: torch.dtype) -> None:
    """Hook ``module`` (its weight already fp8) to compute in ``compute_dtype`` with ``scale``."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.layerwise_casting import _LAYERWISE_CASTING_HOOK

    # Under layerwise casting's name: ModelMixin.dtype then says the compute dtype, which the pipelines make their
    # latents in (the first parameter's dtype, fp8, otherwise).
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(_hook_class()(scale, compute_dtype), _LAYERWISE_CASTING_HOOK)


def held_hook(module: torch.nn.Module) -> object | None:
    """``module``'s fp8 hook, or None when its weight is not held in fp8."""
    from diffusers.hooks.layerwise_casting import _LAYERWISE_CASTING_HOOK

    registry = getattr(module, "_diffusers_hook", None)
    hook = registry.get_hook(_LAYERWISE_CASTING_HOOK) if registry is not None else None
    return hook if hook is not None and hasattr(hook, "loras") else None


def can_hold(model: torch.nn.Module, key: str, keep_in_fp32: list[str]) -> bool:
    """Whether the weight ``key`` (stored in fp8) stays fp8 on the rank: a layer the hook can swap the weight of,
    not one the model class keeps in float32."""
    module_name, _, name = key.rpartition(".")
    if name != "weight" or any(part in key.split(".") for part in keep_in_fp32):
        return False
    try:
        return isinstance(model.get_submodule(module_name), HELD_LAYERS)
    except AttributeError:
        return False


def folder_dtypes(files: list[str]) -> dict[str, str]:
    """Each tensor's safetensors dtype ("BF16", "F8_E4M3", ...) in a model's weight files
    (``tp_slices.weight_files``)."""
    from safetensors import safe_open

    dtypes = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            dtypes.update({key: f.get_slice(key).get_dtype() for key in f.keys()})
    return dtypes


def stored_fp8(files: list[str]) -> bool:
    """Whether a model's weight files hold fp8 tensors (then its weights load through the pack's loader)."""
    return any(d in FLOAT8_NAMES for d in folder_dtypes(files).values())


def read_scales(files: list[str]) -> dict[str, torch.Tensor]:
    """The weight key → its scale (float32), for every scaled weight in a model's weight files."""
    from safetensors import safe_open

    scales = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key.endswith(".weight" + FP8_SCALE_SUFFIX):
                    scales[key.removesuffix(FP8_SCALE_SUFFIX)] = f.get_tensor(key).to(torch.float32)
    return scales


def loaded_names(model: torch.nn.Module, keys: list[str]) -> dict[str, str | None]:
    """Each file key's name in ``model`` as ``from_pretrained`` loaded it: the same for diffusers; transformers renames
    some published layouts as it loads them (Qwen2.5-VL's ``model.layers.…`` are its ``model.language_model.layers.…``,
    by the class's conversion mapping in transformers 5, its ``_checkpoint_conversion_mapping`` before). A key
    transformers merges into another tensor (a converter's) maps to None; one the model has no place for to itself."""
    names = set(model.state_dict())
    renamed: dict[str, str | None] = {key: key for key in keys}
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return renamed
    if not isinstance(model, PreTrainedModel):
        return renamed
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4: the class's regular expressions
        import re

        mapping = getattr(model, "_checkpoint_conversion_mapping", None) or {}

        def rename(key: str) -> str | None:
            for pattern, replacement in mapping.items():
                key, n = re.subn(pattern, replacement, key)
                if n:
                    break
            return key

    else:
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        prefix, meta = model.base_model_prefix, dict.fromkeys(names, True)

        def rename(key: str) -> str | None:
            name, merged = rename_source_key(key, renamings, converters, prefix, meta)
            return None if merged is not None else name

    for key in keys:
        if key in names:
            continue
        name = rename(key)
        renamed[key] = name if name is None or name in names else key
    return renamed


def hold_loaded(
    model: torch.nn.Module,
    files: list[str],
    dtype: torch.dtype,
    as_stored: bool,
    offloaded_fix: str,
    layers: tuple[type, ...] = HELD_LAYERS,
) -> None:
    """A model ``from_pretrained`` loaded from ``files`` in ``dtype`` (its fp8 weights cast up exactly, their scales
    ignored, as diffusers and transformers do): its fp8 weights of ``layers`` back to fp8 and hooked (``as_stored``),
    the others multiplied by their scales in place (a layer its class keeps in float32 among them, ``can_hold``). For
    device_map's placed models (the transformer, the text encoders); the other strategies load the transformer
    through ``tp_slices``, which never makes the copy in ``dtype``. ``offloaded_fix``: what the error for a scaled
    weight accelerate offloaded tells the user to do."""
    dtypes, scales = folder_dtypes(files), read_scales(files)
    # transformers' T5 casts its input to ``wo``'s weight dtype (the class keeps ``wo`` in float32): a module a class
    # keeps in float32 may read its weight's dtype, so it is never held in fp8.
    keep_in_fp32 = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    fp8 = [key for key, kind in dtypes.items() if kind in FLOAT8_NAMES]
    with torch.no_grad():
        for key, loaded in loaded_names(model, fp8).items():
            if loaded is None:
                if key in scales:  # merged into another tensor, which cannot be scaled: refused, never run unscaled
                    raise OpError(
                        f"{key} of {os.path.dirname(files[0])} is a scaled fp8 weight that the model's loader merges "
                        "into another tensor, which the pack cannot scale; use the model's bf16 or plain fp8 file"
                    )
                continue  # a plain fp8 one was cast up exactly
            module_name, _, name = loaded.rpartition(".")
            try:
                module = model.get_submodule(module_name)
                tensor = getattr(module, name)
            except AttributeError:
                continue  # a tensor the model has no place for (from_pretrained ignored it too)
            if tensor.device.type == "meta":
                if key in scales:
                    raise OpError(
                        f"{module_name} is offloaded (device_map put its weights on the CPU or disk), and its scaled "
                        f"fp8 weight cannot be scaled there; {offloaded_fix}"
                    )
                continue
            scale = scales.get(key)
            stored = FLOAT8_NAMES[dtypes[key]]
            if as_stored and isinstance(module, layers) and can_hold(model, loaded, keep_in_fp32):
                module._parameters[name] = torch.nn.Parameter(tensor.to(stored), requires_grad=False)
                hold(module, None if scale is None else scale.to(tensor.device), dtype)
            elif scale is not None:
                tensor.copy_(dequantized(tensor.to(stored), scale, tensor.dtype))
