"""GGUF transformers (ComfyUI-GGUF's ``.gguf`` files): what the pack reads from one, where a converted folder keeps
it, and how a rank loads it.

A GGUF transformer stays the file it is. The converted folder's ``transformer/`` holds the config the family's layout
derived from the file's shapes and a symbolic link to the file (``GGUF_WEIGHTS``), nothing rewritten: diffusers cannot
save GGUF-packed weights (its GGUF quantizer is not serializable), and a key layout is a matter of names, which the
family's layout already maps (its moves, kept beside the link). A rank loads it with ``from_single_file`` and
``GGUFQuantizationConfig``: the weights stay packed on the rank (Q8_0 about 1.06 bytes a parameter, Q4_K 0.56) and each
linear layer dequantizes its weight to the compute dtype when it runs. Under every strategy that keeps a replica per
rank (device_map, context parallel, data parallel, cfg_parallel) each rank holds the packed weights; tensor parallelism
is refused (see ``TENSOR_PARALLEL_REFUSAL``).

The header is read by the ``gguf`` package's reader (a memory map: the tensor data is not read): a file cut short, a
tensor type the package does not know, or one diffusers cannot compute are refused here, before anything loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .families.files import Move, apply_moves, group_moves

if TYPE_CHECKING:
    import torch

GGUF_SUFFIX = ".gguf"
GGUF_WEIGHTS = "diffusion_pytorch_model.gguf"  # the converted transformer folder's link to the file
GGUF_MOVES = "gguf_moves.json"  # beside it: how its tensors become the model's (the family layout's moves)
# Types torch holds as they are (diffusers leaves them unpacked); every other type is a packed GGUFParameter.
_PLAIN = ("F32", "F16")
TENSOR_PARALLEL_REFUSAL = (
    "a GGUF transformer cannot be sharded by tensor parallelism (its weights are packed in blocks of 32 or 256 values "
    "that diffusers' sharding cannot slice); use context_parallel (each rank holds the packed weights, the tokens are "
    "split), data_parallel or cfg_parallel, or the model's bf16 / fp8 file for tensor_parallel"
)


@dataclasses.dataclass(frozen=True)
class GgufHeader:
    """What a GGUF file's header says.

    Args:
        architecture: ``general.architecture`` (ComfyUI-GGUF writes the family: "flux", "qwen_image"), or None.
        types: each tensor's GGML type name ("Q8_0", "Q4_K", "F32"), by key.
        shapes: each tensor's shape, in torch's order (GGUF stores it innermost first).
        packed_bytes: the tensors' bytes as stored.
    """

    architecture: str | None
    types: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    packed_bytes: int


def computable_types() -> set[str]:
    """The GGML types diffusers' GGUF path computes: the plain ones and those it has a dequantizer for."""
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    return {*_PLAIN, *(t.name for t in SUPPORTED_GGUF_QUANT_TYPES)}


def read_gguf(path: str) -> GgufHeader:
    """``path``'s header; ValueError saying what is wrong with the file (not GGUF, cut short, a tensor type the gguf
    package does not know, a shape stored elsewhere)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except ValueError as e:
        text = str(e)
        if "GGMLQuantizationType" in text:
            raise ValueError(f"it holds a tensor type the gguf package does not know ({text})") from None
        if "reshape" in text or "buffer" in text or "offset" in text or "size" in text:
            raise ValueError(f"it is cut short ({text})") from None
        raise ValueError(f"it is not a readable GGUF file ({text})") from None
    except (OSError, IndexError, KeyError) as e:
        raise ValueError(f"it is not a readable GGUF file ({type(e).__name__}: {e})") from None
    field = reader.get_field("general.architecture")
    architecture = str(bytes(field.parts[field.data[-1]]), "utf-8") if field is not None and field.data else None
    types, shapes, packed = {}, {}, 0
    for tensor in reader.tensors:
        if reader.get_field(f"comfy.gguf.orig_shape.{tensor.name}") is not None:
            # ComfyUI-GGUF's reshaped tensors (5-D convolutions): no family here has them, and diffusers reads the
            # stored shape, so such a file is not one of them.
            raise ValueError(f"its tensor {tensor.name} is stored reshaped (a video model's), not as the family has it")
        types[tensor.name] = tensor.tensor_type.name
        shapes[tensor.name] = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        packed += int(tensor.n_bytes)
    if os.path.getsize(path) < packed:
        raise ValueError("it is cut short (its tensors need more bytes than the file has)")
    return GgufHeader(architecture=architecture, types=types, shapes=shapes, packed_bytes=packed)


def gguf_weights(transformer_folder: str) -> str | None:
    """The GGUF file a transformer folder loads from (its ``GGUF_WEIGHTS``), or None: a safetensors folder."""
    path = os.path.join(transformer_folder, GGUF_WEIGHTS)
    return path if os.path.exists(path) else None


def write_moves(moves: Iterable[Move], folder: str) -> None:
    """Record beside the link how the file's tensors become the model's (the family layout's moves, sources by the
    file's own keys), for the ranks to apply to the packed tensors."""
    rows = [[m.target, m.source, list(m.rows) if m.rows else None, m.swap_halves] for m in moves]
    with open(os.path.join(folder, GGUF_MOVES), "w") as f:
        json.dump(rows, f)


def _read_moves(folder: str) -> list[Move]:
    with open(os.path.join(folder, GGUF_MOVES)) as f:
        rows = json.load(f)
    return [Move(target=t, source=s, rows=tuple(r) if r else None, swap_halves=bool(w)) for t, s, r, w in rows]


def moved_keys(folder: str) -> set[str]:
    """The model's keys the folder's GGUF tensors become (what the client checks the config's block counts against)."""
    return {move.target for move in _read_moves(folder)}


def load_gguf_transformer(
    cls: type, model_dir: str, dtype: torch.dtype, device: str, subfolder: str = "transformer"
) -> torch.nn.Module:
    """``cls`` from ``model_dir``'s GGUF transformer (in ``subfolder``) onto ``device``: the file's tensors read
    packed by diffusers' GGUF reader, moved to the model's keys by the family's moves (rows of a packed tensor are
    whole blocks, so a slice along the first dimension stays packed), and the model built by diffusers' own GGUF
    path (``from_single_file`` with ``GGUFQuantizationConfig``): the weights stay packed; each layer dequantizes to
    ``dtype`` when it runs. (diffusers' own FLUX converter assumes FLUX.1's width, 3072; the family's moves read the
    width from the file, as they do for a safetensors file.)"""
    from diffusers import GGUFQuantizationConfig
    from diffusers.models.model_loading_utils import load_gguf_checkpoint

    folder = os.path.join(model_dir, subfolder)
    packed = load_gguf_checkpoint(gguf_weights(folder))
    by_source = group_moves(_read_moves(folder))
    state_dict = dict(apply_moves(by_source, ((source, packed.pop(source)) for source in list(by_source))))
    return cls.from_single_file(
        state_dict,
        config=model_dir,
        subfolder=subfolder,
        quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
        torch_dtype=dtype,
        device=device,
        local_files_only=True,
    )


def is_gguf_model(module: torch.nn.Module) -> bool:
    """Whether a loaded transformer holds GGUF-packed weights (diffusers' quantizer records itself on the model)."""
    quantizer = getattr(module, "hf_quantizer", None)
    return type(quantizer).__name__ == "GGUFQuantizer"
