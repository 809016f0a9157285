"""GGUF transformers (ComfyUI-GGUF's ``.gguf`` files): what the pack reads from one, where a converted folder keeps
it, and how a rank loads it.

A GGUF transformer stays the file it is. The converted folder's ``transformer/`` holds the config the family's layout
derived from the file's shapes and a symbolic link to the file (``GGUF_WEIGHTS``), nothing rewritten: diffusers cannot
save GGUF-packed weights (its GGUF quantizer is not serializable), and a key layout is a matter of names, which the
family's layout already maps (its moves, kept beside the link). A rank loads it with ``from_single_file`` and
``GGUFQuantizationConfig``: the weights stay packed on the rank (Q8_0 about 1.06 bytes a parameter, Q4_K 0.56) and each
linear layer dequantizes its weight to the compute dtype when it runs. Under every strategy that keeps a replica per
rank (context parallel, data parallel, cfg_parallel) each rank holds the packed weights; device_map spreads them over
its GPUs by their packed bytes (``spread_over_gpus``). Under tensor parallelism (and tp_cp) a rank keeps only its
own slices (``worker/tp_slices.py``), by one rule per weight (``slices_packed``): a GGUF block is 32 or 256 values of
one row, so a slice of whole rows (a colwise layer) is always whole blocks and stays packed; a slice of the input
columns (a rowwise layer) stays packed where each rank's share of the columns is whole blocks, and otherwise that
slice alone is dequantized to the compute dtype at load (its bytes in the dtype, not packed: the node says how many).

The file is read through a copy-on-write memory map (``file_tensors``): the tensors stay the file's pages until a
rank copies what it keeps, so a rank never holds the whole packed model in its own memory, not even while loading.

The header is read by the ``gguf`` package's reader (a memory map: the tensor data is not read): a file cut short, a
tensor type the package does not know, or one diffusers cannot compute are refused here, before anything loads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from .families.files import Move, apply_moves, group_moves

if TYPE_CHECKING:
    import torch

    from .families.base import TensorParallelPlan

GGUF_SUFFIX = ".gguf"
GGUF_WEIGHTS = "diffusion_pytorch_model.gguf"  # the converted transformer folder's link to the file
GGUF_MOVES = "gguf_moves.json"  # beside it: how its tensors become the model's (the family layout's moves)
# Types torch holds as they are (diffusers leaves them unpacked); every other type is a packed GGUFParameter.
_PLAIN = ("F32", "F16")
# Neither way of applying a LoRA fits a GGUF transformer's tensor-parallel slices: fusing would quantize the delta away,
# and PEFT's adapters are whole layers beside a rank's slices (diffusers refuses them on a sharded model).
TENSOR_PARALLEL_LORAS = (
    "LoRAs on a GGUF transformer are not applied under tensor parallelism (its slices are packed, and diffusers "
    "refuses adapters on a sharded model); use context_parallel, data_parallel or cfg_parallel (adapters beside the "
    "packed weights), or the model's bf16 / fp8 file for tensor_parallel with LoRAs"
)


class ReshapedTensors(ValueError):
    """A GGUF file whose tensors ComfyUI-GGUF stored reshaped (a video model's 5-D convolutions): whole and readable,
    but not loaded; the message names the file to use instead."""


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
            # ComfyUI-GGUF stores a video model's 5-D convolutions (Wan's patch embedding) reshaped, with the shape
            # beside; diffusers' GGUF path reads the stored shape, so the pack does not load them (yet).
            raise ReshapedTensors(
                f"its tensor {tensor.name} is stored reshaped (ComfyUI-GGUF's way with a video model's 5-D "
                "convolutions, as in Wan's GGUF files), which this pack does not load; use the model's bf16 or fp8 "
                "safetensors file (fp8 stays fp8 on every strategy)"
            )
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


def read_moves(folder: str) -> list[Move]:
    """The moves ``write_moves`` recorded in ``folder``."""
    with open(os.path.join(folder, GGUF_MOVES)) as f:
        rows = json.load(f)
    return [Move(target=t, source=s, rows=tuple(r) if r else None, swap_halves=bool(w)) for t, s, r, w in rows]


def moved_keys(folder: str) -> set[str]:
    """The model's keys the folder's GGUF tensors become (what the client checks the config's block counts against)."""
    return {move.target for move in read_moves(folder)}


def file_tensors(path: str) -> dict[str, torch.Tensor]:
    """The file's tensors by its keys, as diffusers' GGUF reader makes them (a packed type a ``GGUFParameter`` of its
    bytes, F32 / F16 plain) but views of a copy-on-write memory map of the file: nothing is read, nor held in the
    process's own memory, until a tensor is copied (diffusers' ``load_gguf_checkpoint`` copies the whole file)."""
    import gguf
    import torch
    from diffusers.quantizers.gguf.utils import GGUFParameter

    reader = gguf.GGUFReader(path, "c")  # "c": writable views for torch, the file never written
    tensors = {}
    for tensor in reader.tensors:
        data = torch.from_numpy(tensor.data)
        plain = tensor.tensor_type.name in _PLAIN
        tensors[tensor.name] = data if plain else GGUFParameter(data, quant_type=tensor.tensor_type)
    return tensors


def moved_tensors(folder: str, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors the folder's moves make of ``tensors`` (``file_tensors`` of its file), one at a time; rows
    of a packed tensor are whole blocks, so a tensor moved by rows stays packed."""
    by_source = group_moves(read_moves(folder))
    return apply_moves(by_source, ((source, tensors.pop(source)) for source in list(by_source)))


def load_gguf_transformer(
    cls: type, model_dir: str, dtype: torch.dtype, device: str, subfolder: str = "transformer"
) -> torch.nn.Module:
    """``cls`` from ``model_dir``'s GGUF transformer (in ``subfolder``) onto ``device``: the file's tensors read
    packed (``file_tensors``), moved to the model's keys by the family's moves, and the model built by diffusers' own
    GGUF path (``from_single_file`` with ``GGUFQuantizationConfig``): the weights stay packed; each layer dequantizes
    to ``dtype`` when it runs. (diffusers' own FLUX converter assumes FLUX.1's width, 3072; the family's moves read
    the width from the file, as they do for a safetensors file.)"""
    from diffusers import GGUFQuantizationConfig

    folder = os.path.join(model_dir, subfolder)
    state_dict = dict(moved_tensors(folder, file_tensors(gguf_weights(folder))))
    return cls.from_single_file(
        state_dict,
        config=model_dir,
        subfolder=subfolder,
        quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
        torch_dtype=dtype,
        device=device,
        local_files_only=True,
    )


def block_shape(qtype: str) -> tuple[int, int]:
    """(values, bytes) of one block of GGML type ``qtype`` (Q8_0: 32 values in 34 bytes; F32: one value in 4)."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]


def slices_packed(qtype: str, dim: int | None, block_sizes: Iterable[int] | None, ranks: int) -> bool:
    """Whether a rank's tensor-parallel slice of a weight packed as ``qtype`` stays packed (the rule, decided per
    weight): a slice of rows (``dim`` 0, a colwise layer) or a whole tensor (``dim`` None) always does, as a block
    lies within one row; a slice of the input columns (``dim`` 1, a rowwise layer, in diffusers' ``block_sizes``)
    does where each rank's share of every block of columns is whole blocks of the type (Q8_0: 32 values, Q4_K: 256).
    Otherwise the rank dequantizes that slice to the compute dtype at load."""
    if dim != 1:
        return True
    values, _ = block_shape(qtype)
    return all((block // ranks) % values == 0 for block in block_sizes or ())


@dataclasses.dataclass(frozen=True)
class TensorParallelShare:
    """What one tensor-parallel rank holds of a GGUF transformer (``tensor_parallel_share``).

    Args:
        packed_bytes: its slices that stay packed, and the whole tensors the plan does not split.
        dequantized_bytes: its slices dequantized at load (rowwise layers whose share of the columns is not whole
            blocks), in the compute dtype.
        dequantized_weights: how many weights those are.
    """

    packed_bytes: int
    dequantized_bytes: int
    dequantized_weights: int


def tensor_parallel_share(folder: str, plan: TensorParallelPlan, ranks: int, itemsize: int) -> TensorParallelShare:
    """An estimate, from the file's header and the folder's moves alone, of what a rank holds of the GGUF transformer
    in ``folder`` under a tensor-parallel ``plan`` over ``ranks``, computing
    in a dtype of ``itemsize`` bytes, by ``slices_packed``'s rule. A packed rowwise style whose blocks the model sets
    in its ``__init__`` (FLUX.1's single blocks' ``proj_out``) is taken as one block here; the ranks apply the exact
    blocks."""
    header = read_gguf(gguf_weights(folder))
    packed = dequantized = count = 0
    for move in read_moves(folder):
        qtype, shape = header.types[move.source], header.shapes[move.source]
        rows = (move.rows[1] - move.rows[0]) if move.rows else shape[0]
        shape = (rows, *shape[1:])
        values, size = block_shape(qtype)
        whole = math.prod(shape) // values * size
        found = plan.style_of(move.target)
        if found is None:
            packed += whole
            continue
        style, name = found
        rowwise = style == "rowwise" or type(style).__name__ == "PackedRowwiseParallel"
        if rowwise and name != "weight":
            packed += whole  # a rowwise bias is added after the all-reduce: every rank keeps it whole
        elif rowwise and qtype not in _PLAIN:
            blocks = getattr(style, "blocks", None)
            sizes = [shape[1] * b // sum(blocks) for b in blocks] if blocks else [shape[1]]
            if slices_packed(qtype, 1, sizes, ranks):
                packed += whole // ranks
            else:
                dequantized += math.prod(shape) // ranks * itemsize
                count += 1
        else:
            packed += whole // ranks
    return TensorParallelShare(packed, dequantized, count)


def spread_by_packed_bytes(model: torch.nn.Module, max_memory: dict[int | str, int | str] | None) -> dict[str, object]:
    """Where device_map puts each block of a loaded GGUF transformer: diffusers' own ``device_map="auto"`` placement
    (``_determine_device_map``: the memory balanced over ``max_memory``'s devices, all the GPUs' free memory without
    it, the model's no-split blocks kept whole) of the parameters as they are held, so a packed weight counts its
    packed bytes, not its values in a dtype."""
    from diffusers.models.model_loading_utils import _determine_device_map

    return _determine_device_map(model, "auto", max_memory, None)


def spread_over_gpus(model: torch.nn.Module, max_memory: dict[int | str, int | str] | None) -> torch.nn.Module:
    """``model`` (a GGUF transformer loaded on the CPU, its tensors the file's pages) spread over the GPUs by
    ``spread_by_packed_bytes``, as diffusers' ``device_map="auto"`` spreads a safetensors one (``from_single_file``,
    its GGUF path, takes no device_map). Each block is moved by ``Module.to`` before accelerate's hooks are attached:
    accelerate rebuilds a parameter it moves from its class alone, which drops a packed weight's quant_type."""
    from accelerate import dispatch_model

    device_map = spread_by_packed_bytes(model, max_memory)
    offloaded = sorted({str(device) for device in device_map.values() if device in ("cpu", "disk")})
    if offloaded:
        raise ValueError(
            f"its packed weights do not fit the GPUs within max_memory (device_map would put some on the "
            f"{' and '.join(offloaded)}, which a GGUF transformer cannot run from); raise max_memory, or use more GPUs"
        )
    for name, device in device_map.items():
        (model.get_submodule(name) if name else model).to(device)
    return dispatch_model(model, device_map)


def is_gguf_model(module: torch.nn.Module) -> bool:
    """Whether a loaded transformer holds GGUF-packed weights (diffusers' quantizer records itself on the model)."""
    quantizer = getattr(module, "hf_quantizer", None)
    return type(quantizer).__name__ == "GGUFQuantizer"
