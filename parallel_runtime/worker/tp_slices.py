"""A tensor-parallel transformer read slice by slice: each rank copies only its own part of every weight the model's
tensor-parallel plan (``families.tp_plan``: diffusers' ``_tp_plan``, or the pack's) shards, straight from the
safetensors files into the tensor it keeps, so no rank holds the whole model, not even while loading.

diffusers 0.42.1's own tensor-parallel load (``from_pretrained(parallel_config=TensorParallelConfig(...))``) reads
slices too, but it makes each one in the file's dtype first and then casts it (and concatenates the blocks of a
packed weight): a temporary per weight, freed between the weights the rank keeps. On a CPU rank, where the kept
weights share the heap with those temporaries, glibc keeps the freed pages: measured on a 145M-parameter FLUX.1 read
from bf16 into float32 on 2 ranks, a rank's anonymous memory peaks at 0.72–1.24 × the whole model (it moves with the
heap's history) while the rank holds 0.65 × (``bench/tp_load_memory.py``). Here each kept tensor is allocated once,
in its final dtype on the rank's device, and filled by ``copy_`` from a view of the file (safetensors 0.8's
``get_slice`` hands out views of the mapped file), which slices, casts and moves in one pass: the peak is what the
rank keeps, 0.65 ×. On a GPU rank a slice of whole rows in the run's dtype goes from the file's pages to the GPU
without a host copy; a slice of columns (a rowwise weight), or a tensor stored in another dtype, passes through one
host buffer of its size on its way (torch's ``copy_`` gathers and casts it there).

The result is the model ``from_pretrained`` builds, weight for weight (``tests/test_tp_slices.py`` compares every
rank's tensors bit for bit): planned weights as ``DTensor`` shards (``Shard(dim)``, or ``Replicate()`` for a rowwise
bias), the rest whole, diffusers' own tensor-parallel forward hooks, and ``_parallel_config`` recorded, so diffusers'
guards (no adapters, no ``enable_parallelism``) and the pack's fused LoRAs (``worker/lora.py``) see it as diffusers
sharded it. The slicing arithmetic is diffusers' (``resolve_tp_shard_specs`` gives each weight's dimension and
blocks; a rank takes its equal part of every block).

A plan the pack writes may also name what diffusers' plan form cannot say (``families.TensorParallelPlan``): RMSNorms
over all the heads, which become ``HeadShardedRMSNorm`` (each rank normalises its own columns with the mean square of
the whole row, summed over the TP ranks), and attention modules whose ``heads`` count becomes the rank's share.

A GGUF transformer (ComfyUI-GGUF's file, ``gguf_files``) is sliced by the same plan and arithmetic, from the file's
memory map, into diffusers' GGUF layers: each slice packed where it is whole blocks of the file's type, else
dequantized at load (``load_gguf_tensor_parallel``, by ``gguf_files.slices_packed``'s rule).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import gguf_files
from ..families import TensorParallelPlan, tp_plan
from . import fp8_weights
from .ops import OpError, WidgetError

TRANSFORMERS_WEIGHTS_NAME = "model.safetensors"  # a text encoder's (transformers' save_pretrained), beside its index


def weight_files(model_dir: str, subfolder: str = "transformer") -> list[str]:
    """A model's safetensors files in ``model_dir`` (its ``subfolder``): the shards its index lists, or its one file,
    under diffusers' names (a transformer) or transformers' (a text encoder)."""
    from diffusers.utils import SAFETENSORS_WEIGHTS_NAME

    folder = os.path.join(model_dir, subfolder)
    for single in (SAFETENSORS_WEIGHTS_NAME, TRANSFORMERS_WEIGHTS_NAME):
        index = os.path.join(folder, single + ".index.json")  # both libraries name the index so
        if os.path.isfile(index):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(folder, shard) for shard in shards]
        if os.path.isfile(os.path.join(folder, single)):
            return [os.path.join(folder, single)]
    raise OpError(
        f"{folder} has no {SAFETENSORS_WEIGHTS_NAME} (nor its .index.json): tensor_parallel reads each rank's slice "
        "of a safetensors file; save the model with safe_serialization=True, or pick another strategy"
    )


def _planned(model: torch.nn.Module, pattern: str) -> Iterator[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, attribute, module) of each module a plan's glob names (one ``*`` over a ModuleList, as diffusers'
    ``_tp_plan`` keys), leaving out those the model's config does not build (None or absent: Wan T2V has no image
    projections). A name that is neither fails loudly: ``get_submodule`` raises for a wrong path."""
    prefix, star, suffix = pattern.partition("*")
    containers = model.get_submodule(prefix.strip(".")) if star else [model]
    path = suffix.strip(".") if star else pattern
    parent_path, _, attribute = path.rpartition(".")
    for container in containers:
        parent = container.get_submodule(parent_path)
        module = getattr(parent, attribute, None)
        if module is not None:
            yield parent, attribute, module


def _plan_of(cls: type) -> TensorParallelPlan:
    plan = tp_plan(cls.__name__)
    if plan is None:
        raise OpError(
            f"{cls.__name__} has no tensor-parallel plan (neither diffusers' _tp_plan nor one the pack writes); "
            "use context_parallel or data_parallel"
        )
    return plan


def tp_layers(model: torch.nn.Module) -> dict:
    """The layers of the model's tensor-parallel plan that this model has, in diffusers' ``_tp_plan`` form."""
    layers = _plan_of(type(model)).layers
    return {pattern: style for pattern, style in layers.items() if next(_planned(model, pattern), None) is not None}


def shard_specs(model: torch.nn.Module, ranks: int) -> dict:
    """diffusers' ``TPShardSpec`` of every weight the model's plan splits over ``ranks``, by the weight's name."""
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    try:
        return resolve_tp_shard_specs(model, tp_layers(model), ranks)
    except ValueError as e:  # a width the strategy's checks did not know of: refused before any weight is read
        raise WidgetError("tp_degree", f"{e} Use a tp_degree that divides it (and as many ranks)") from None


class HeadShardedRMSNorm(torch.nn.Module):
    """An RMSNorm over a width whose columns are split over the TP ranks (all the heads of a colwise projection): each
    rank normalises its own columns by the mean square of the whole row, summed over the ranks, and scales them by its
    part of the weight, so the result is the rank's columns of the whole norm. The weight stays whole (it is small),
    under its own name, so the model's tensors keep their names and shapes and a LoRA that changes it still fits."""

    def __init__(self, norm: torch.nn.RMSNorm, mesh: DeviceMesh):
        super().__init__()
        (self.width,) = norm.normalized_shape
        self.eps = norm.eps
        self.weight = norm.weight
        self.group, self.rank, self.ranks = mesh.get_group(), mesh.get_local_rank(), mesh.size()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        columns = hidden_states.shape[-1]
        if columns * self.ranks != self.width:
            raise RuntimeError(f"a rank's {columns} columns × {self.ranks} ranks is not the norm's width {self.width}")
        upcast = hidden_states.float()
        squares = upcast.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares, group=self.group)
        eps = self.eps if self.eps is not None else torch.finfo(hidden_states.dtype).eps
        normed = upcast * torch.rsqrt(squares / self.width + eps)
        if self.weight is not None:
            normed = normed * self.weight.narrow(0, self.rank * columns, columns).float()
        return normed.type_as(hidden_states)


def split_heads(model: torch.nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh) -> None:
    """What a plan needs beyond its layers, once they are split over ``mesh``: its norms over all the heads reduce over
    the ranks, and its attention modules count the rank's heads."""
    for pattern in plan.head_norms:
        for parent, attribute, norm in _planned(model, pattern):
            setattr(parent, attribute, HeadShardedRMSNorm(norm, mesh))
    for pattern in plan.head_counts:
        for _, _, attention in _planned(model, pattern):
            attention.heads //= mesh.size()


def fp8_files(model_dir: str, subfolder: str = "transformer") -> list[str]:
    """A model's safetensors files (a transformer's, a text encoder's) when they store fp8 weights, else []."""
    try:
        files = weight_files(model_dir, subfolder)
    except OpError:  # no safetensors (a .bin folder): no fp8 either
        return []
    return files if fp8_weights.stored_fp8(files) else []


def _parts(
    stored: object, ndim: int, dim: int, block_sizes: list[int], rank: int, ranks: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """(offset along ``dim`` in the rank's tensor, the file's part there) for each part of the rank's slice of a
    safetensors tensor (``stored``: its ``get_slice``): the rank's equal share of every block, as diffusers'
    ``_local_shard`` cuts them."""
    start, offset = 0, 0
    for block in block_sizes:
        chunk = block // ranks
        index = [slice(None)] * ndim
        index[dim] = slice(start + rank * chunk, start + (rank + 1) * chunk)
        yield offset, stored[tuple(index)]
        start, offset = start + block, offset + chunk


def _target_dtype(key: str, stored: torch.dtype, dtype: torch.dtype, keep_in_fp32: list[str]) -> torch.dtype:
    """The dtype ``from_pretrained`` gives a tensor: floating ones the run dtype (float32 in the modules the class
    keeps there), the others as stored."""
    if not stored.is_floating_point:
        return stored
    return torch.float32 if any(name in key.split(".") for name in keep_in_fp32) else dtype


def _empty_model(cls: type, config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """``cls`` as from_pretrained builds it before reading weights: on the meta device, under the run dtype, no
    initialisation run."""
    from accelerate import init_empty_weights
    from diffusers.models.modeling_utils import no_init_weights

    previous = cls._set_default_torch_dtype(dtype)
    try:
        with no_init_weights(), init_empty_weights():
            return cls.from_config(config)
    finally:
        if previous is not None:
            torch.set_default_dtype(previous)


def _sharding(
    model: torch.nn.Module, config: dict, mesh: DeviceMesh | None
) -> tuple[TensorParallelPlan | None, dict, int, int]:
    """(the plan, each planned weight's diffusers ``TPShardSpec``, this rank, the ranks) of ``model`` over ``mesh``,
    checked by diffusers' own checks and recorded on the model as from_pretrained does; with no mesh, nothing split."""
    if mesh is None:
        return None, {}, 0, 1
    from diffusers import TensorParallelConfig
    from diffusers.hooks.tensor_parallel import _check_tp_supported

    plan = _plan_of(type(model))
    tp_config = TensorParallelConfig(mesh=mesh)
    _check_tp_supported(type(model).__name__, plan.layers, config.get("num_attention_heads"), tp_config)
    model._resolve_parallel_config(tp_config)
    return plan, shard_specs(model, mesh.size()), mesh.get_local_rank(), mesh.size()


def _loaded(model: torch.nn.Module, model_dir: str, device: torch.device) -> None:
    """What from_pretrained does once the weights are in: the model's name, eval mode, and its buffers (Wan's rotary
    tables), which stayed on the CPU while it was built under ``init_empty_weights``, on the rank's device."""
    model.register_to_config(_name_or_path=model_dir)
    model.eval()
    for module in model.modules():
        module._buffers.update({name: b.to(device) for name, b in module._buffers.items() if b is not None})


def load_tensor_parallel(
    cls: type,
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    mesh: DeviceMesh | None,
    fp8_as_stored: bool = False,
    subfolder: str = "transformer",
) -> torch.nn.Module:
    """This rank's ``cls`` transformer from ``model_dir``, sharded over ``mesh`` by the class's tensor-parallel plan
    (``families.tp_plan``; collective only where diffusers' forward hooks and the plan's head norms are: every rank of
    ``mesh`` calls it together); with no mesh, the whole model, read the same way (the replicas of context, data and
    CFG parallelism of a folder that stores fp8).

    Weights the folder stores in fp8 stay fp8 with ``fp8_as_stored`` (this rank's slices, and of a per-row scale its
    rows; ``worker/fp8_weights.py`` hooks their layers), else become ``dtype`` times their scales as they are read."""
    from accelerate.utils import set_module_tensor_to_device
    from diffusers.hooks.tensor_parallel import apply_tensor_parallel
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, Replicate, Shard

    config = cls.load_config(model_dir, subfolder=subfolder)
    if config.get("quantization_config") is not None:
        # What from_pretrained refuses too: a quantizer's packed layout cannot be cut into DTensor slices.
        raise OpError(
            f"{os.path.join(model_dir, subfolder)} holds quantized weights (quantization_config in its "
            "config.json), which tensor parallelism cannot shard; use an unquantized (bf16 / fp16) folder, or "
            "another strategy"
        )
    files = weight_files(model_dir, subfolder)
    scales = fp8_weights.read_scales(files)
    model = _empty_model(cls, config, dtype)
    plan, specs, rank, ranks = _sharding(model, config, mesh)
    expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
    keep_in_fp32 = cls._keep_in_fp32_modules or []
    held: dict[str, torch.Tensor | None] = {}  # the weights kept in fp8: their (local) scales

    loaded: set[str] = set()
    for path in files:
        # The views get_slice hands out read the file's mapped pages: every copy happens inside this block.
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key not in expected:
                    continue  # from_pretrained ignores keys the model has no place for (it only warns)
                stored = f.get_slice(key)
                shape = torch.Size(stored.get_shape())
                if shape != expected[key]:
                    raise OpError(
                        f"{path} holds {key} with shape {tuple(shape)}, but the transformer's config.json makes it "
                        f"{tuple(expected[key])}: the folder's weights and config are of different models; "
                        "download or convert the model again"
                    )
                spec = specs.get(key)
                stored_dtype = fp8_weights.FLOAT8_NAMES.get(stored.get_dtype())
                # An fp8 weight is read as fp8 when it stays so or has a scale to apply first, else cast as it is read.
                as_fp8 = stored_dtype is not None and (
                    key in scales or (fp8_as_stored and fp8_weights.can_hold(model, key, keep_in_fp32))
                )
                if spec is None or spec.dim is None:
                    whole = stored[...]  # a view of the file's pages (a copy with safetensors before 0.8)
                    target = stored_dtype if as_fp8 else _target_dtype(key, whole.dtype, dtype, keep_in_fp32)
                    local = torch.empty(shape, dtype=target, device=device).copy_(whole)
                else:
                    parts = list(_parts(stored, len(shape), spec.dim, spec.block_sizes, rank, ranks))
                    local_shape = list(shape)
                    local_shape[spec.dim] //= ranks
                    target = stored_dtype if as_fp8 else _target_dtype(key, parts[0][1].dtype, dtype, keep_in_fp32)
                    local = torch.empty(local_shape, dtype=target, device=device)
                    for offset, part in parts:
                        local.narrow(spec.dim, offset, part.shape[spec.dim]).copy_(part)
                if as_fp8:
                    scale = _local_scale(scales.get(key), spec, rank, ranks, device)
                    if fp8_as_stored and fp8_weights.can_hold(model, key, keep_in_fp32):
                        held[key] = scale
                    else:
                        local = fp8_weights.dequantized(
                            local, scale, _target_dtype(key, local.dtype, dtype, keep_in_fp32)
                        )
                if spec is None:
                    # Given its dtype, accelerate keeps a held fp8 weight fp8 (by default it casts to the model's).
                    set_module_tensor_to_device(
                        model, key, device, value=local, dtype=local.dtype if key in held else None
                    )
                else:
                    module_name, _, name = key.rpartition(".")
                    module = model.get_submodule(module_name)
                    # A rowwise bias is added after the all-reduce, so every rank keeps it whole; it is still a
                    # DTensor, as a plain tensor beside a sharded weight fails the addmm dispatch.
                    placement = Replicate() if spec.dim is None else Shard(spec.dim)
                    module.register_parameter(
                        name,
                        torch.nn.Parameter(
                            DTensor.from_local(local, mesh, [placement], run_check=False),
                            requires_grad=getattr(module, name).requires_grad,
                        ),
                    )
                loaded.add(key)
    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise OpError(
            f"{os.path.join(model_dir, subfolder)}'s safetensors files lack {shown}: the folder is incomplete or "
            "of another model; download or convert it again"
        )
    _loaded(model, model_dir, device)
    for key, scale in held.items():
        fp8_weights.hold(model.get_submodule(key.rpartition(".")[0]), scale, dtype)
    if mesh is not None:
        # Every planned weight is placed already: this registers diffusers' forward hooks only.
        tp_config = model._parallel_config.tensor_parallel_config
        apply_tensor_parallel(model, tp_config, tp_layers(model), weights_already_sharded=True)
        split_heads(model, plan, mesh)
    return model


def _local_scale(
    scale: torch.Tensor | None, spec: object | None, rank: int, ranks: int, device: torch.device
) -> torch.Tensor | None:
    """This rank's part of a weight's scale: a per-tensor one whole, a per-row one the rows the rank keeps (a weight
    sharded by rows, in the same blocks), else whole."""
    if scale is None:
        return None
    if scale.numel() > 1 and spec is not None and spec.dim == 0:
        rows = scale.reshape(-1)
        scale = torch.cat([part for _, part in _parts(rows, 1, 0, spec.block_sizes, rank, ranks)])
    return scale.to(device)


def load_gguf_tensor_parallel(
    cls: type,
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    mesh: DeviceMesh,
    subfolder: str = "transformer",
) -> torch.nn.Module:
    """This rank's ``cls`` transformer from ``model_dir``'s GGUF file, sharded over ``mesh`` by the class's
    tensor-parallel plan (collective: every rank of ``mesh`` calls it together).

    The model is diffusers' GGUF model (its packed layers ``GGUFLinear``, dequantizing their weight to ``dtype`` when
    they run), each planned weight this rank's slice of it by ``gguf_files.slices_packed``'s rule: packed where the
    slice is whole blocks, else (a rowwise layer whose share of the columns is not) dequantized at load, from only the
    blocks the slice touches. The slices are plain tensors, not DTensors (a packed tensor is no DTensor's local
    shard), so the forward is the pack's: a colwise layer is its rows' layer as it stands (the rank's output columns,
    as diffusers' colwise hook hands them on), a rowwise layer sums its partial product over the ranks before its
    bias is added (``_reduced_forward``). The file is read through its memory map (``gguf_files.file_tensors``): a
    rank copies only what it keeps, plus one moved tensor at a time where the family's moves concatenate or split."""
    from diffusers import GGUFQuantizationConfig
    from diffusers.quantizers.gguf.gguf_quantizer import GGUFQuantizer
    from diffusers.quantizers.gguf.utils import GGUFParameter, _replace_with_gguf_linear, dequantize_gguf_tensor

    folder = os.path.join(model_dir, subfolder)
    config = cls.load_config(model_dir, subfolder=subfolder)
    model = _empty_model(cls, config, dtype)
    plan, specs, rank, ranks = _sharding(model, config, mesh)
    expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
    keep_in_fp32 = cls._keep_in_fp32_modules or []
    tensors = gguf_files.file_tensors(gguf_files.gguf_weights(folder))
    packed = {key for key, tensor in tensors.items() if isinstance(tensor, GGUFParameter)}
    # diffusers' GGUF layers for the Linear layers whose weight the file packs (it reads only the values' types).
    targets = {move.target: tensors[move.source] for move in gguf_files.read_moves(folder) if move.source in packed}
    _replace_with_gguf_linear(model, dtype, targets, modules_to_not_convert=list(keep_in_fp32))
    loaded: set[str] = set()
    for key, tensor in gguf_files.moved_tensors(folder, tensors):
        if key not in expected:
            continue
        shape = tensor.quant_shape if isinstance(tensor, GGUFParameter) else tensor.shape
        if tuple(shape) != tuple(expected[key]):
            raise OpError(
                f"{folder}'s GGUF file makes {key} {tuple(shape)}, but the transformer's config.json makes it "
                f"{tuple(expected[key])}: the file and config are of different models; convert the files again"
            )
        fp32 = any(name in key.split(".") for name in keep_in_fp32)
        if fp32 and isinstance(tensor, GGUFParameter):  # as diffusers' GGUF path does: such a module computes in fp32
            tensor = dequantize_gguf_tensor(tensor).float()
        local = _gguf_slice(tensor, specs.get(key), rank, ranks, torch.float32 if fp32 else dtype, device)
        module_name, _, name = key.rpartition(".")
        if not isinstance(local, GGUFParameter):
            local = torch.nn.Parameter(local, requires_grad=False)
        model.get_submodule(module_name)._parameters[name] = local
        loaded.add(key)
    missing = sorted(set(expected) - loaded)
    if missing:
        raise OpError(f"{folder}'s GGUF file lacks {', '.join(missing[:5])}: convert the files again")
    _loaded(model, model_dir, device)
    model.hf_quantizer = GGUFQuantizer(GGUFQuantizationConfig(compute_dtype=dtype))  # as from_single_file records it
    group = mesh.get_group()
    for pattern, style in tp_layers(model).items():
        if style == "rowwise" or type(style).__name__ == "PackedRowwiseParallel":
            for _, _, layer in _planned(model, pattern):
                layer.forward = functools.partial(_reduced_forward, layer, group)
    split_heads(model, plan, mesh)
    return model


def _gguf_slice(
    tensor: torch.Tensor, spec: object | None, rank: int, ranks: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """This rank's part of one of a GGUF file's tensors (a ``GGUFParameter`` of packed bytes, or plain), copied onto
    ``device``: a packed slice packed, with its quant_type; a plain one in ``dtype``; a slice of a packed tensor that
    is not whole blocks (``gguf_files.slices_packed``) dequantized from the blocks it touches, in ``dtype``."""
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    quant = getattr(tensor, "quant_type", None)
    dim, blocks = (spec.dim, spec.block_sizes) if spec is not None else (None, None)
    if quant is None or gguf_files.slices_packed(quant.name, dim, blocks, ranks):
        raw = tensor if quant is None else tensor.as_tensor()
        if dim == 1 and quant is not None:
            values, size = gguf_files.block_shape(quant.name)
            blocks = [block // values * size for block in blocks]  # the columns' blocks, counted in bytes
        local_shape, parts = list(raw.shape), [(0, raw)]
        if dim is not None:
            local_shape[dim] //= ranks
            parts = list(_parts(raw, raw.dim(), dim, blocks, rank, ranks))
        local = torch.empty(local_shape, dtype=dtype if quant is None else raw.dtype, device=device)
        for offset, part in parts:
            local.narrow(dim or 0, offset, part.shape[dim or 0]).copy_(part)
        return local if quant is None else GGUFParameter(local, quant_type=quant)
    # A rowwise slice within blocks: dequantize only the blocks each part of the rank's columns touches.
    values, size = gguf_files.block_shape(quant.name)
    raw = tensor.as_tensor()
    local = torch.empty((raw.shape[0], sum(blocks) // ranks), dtype=dtype, device=device)
    start, offset = 0, 0
    for block in blocks:
        chunk = block // ranks
        first, last = start + rank * chunk, start + (rank + 1) * chunk
        low, high = first // values, -(-last // values)
        touched = GGUFParameter(raw[:, low * size : high * size].contiguous(), quant_type=quant)
        columns = dequantize_gguf_tensor(touched)[:, first - low * values : last - low * values]
        local[:, offset : offset + chunk].copy_(columns)
        start, offset = start + block, offset + chunk
    return local


def _reduced_forward(layer: torch.nn.Linear, group: dist.ProcessGroup, inputs: torch.Tensor) -> torch.Tensor:
    """A rowwise layer's forward on this rank's columns of its input: its partial product (the weight dequantized to
    the compute dtype, as diffusers' GGUF layer does), summed over the tensor-parallel ranks, then its bias, once."""
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    compute = getattr(layer, "compute_dtype", None) or inputs.dtype
    output = torch.nn.functional.linear(inputs, dequantize_gguf_tensor(layer.weight).to(compute))
    dist.all_reduce(output, group=group)
    return output if layer.bias is None else output + layer.bias.to(compute)
