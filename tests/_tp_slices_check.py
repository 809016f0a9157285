"""Run under torchrun on CPU: the pack's slice-by-slice tensor-parallel load (``worker/tp_slices``) against
diffusers' own (``from_pretrained(parallel_config=TensorParallelConfig(...))``), its refusals, and its peak memory.

    torchrun --standalone --nproc-per-node N tests/_tp_slices_check.py RESULTS_JSON CASE...

A CASE ``peak:LOADER:DIR`` (first, before anything else loads in the process) is bench/tp_load_memory.py's
``measure_load``: each rank's anonymous memory while ``LOADER`` (``slices`` or ``diffusers``) loads DIR's FLUX.1 in
float32. A CASE ``same:FAMILY:DIR:DTYPE`` loads the transformer both ways on every rank and compares every tensor
(names, DTensor placements, the rank's local tensor bit for bit, its dtype and device) and a forward pass on identical
inputs, bit for bit: its outcome is the first difference, or "same". A CASE ``refuse:FAMILY:DIR`` loads DIR the pack's
way: its outcome is "refused: " and the error's message, or "loaded". Rank 0 writes ``{case: [each rank's
outcome]}``; a case that raises otherwise is recorded as its traceback.
"""

import json
import sys
import traceback

import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel, TensorParallelConfig
from torch.distributed.tensor import DTensor

from bench.tp_load_memory import measure_load
from parallel_runtime.arena import TORCH_DTYPES
from parallel_runtime.families import family
from parallel_runtime.worker.cpu_shims import apply_cpu_shims
from parallel_runtime.worker.meshes import device_mesh
from parallel_runtime.worker.ops import OpError
from parallel_runtime.worker.tp_slices import load_tensor_parallel


def diffusers_load(cls: type, model_dir: str, dtype: torch.dtype, mesh) -> torch.nn.Module:
    config = TensorParallelConfig(mesh=mesh)
    return cls.from_pretrained(model_dir, subfolder="transformer", dtype=dtype, parallel_config=config)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def first_difference(ours: torch.nn.Module, theirs: torch.nn.Module) -> str:
    mine, reference = dict(ours.state_dict(keep_vars=True)), dict(theirs.state_dict(keep_vars=True))
    if mine.keys() != reference.keys():
        return f"tensors differ: {sorted(mine.keys() ^ reference.keys())[:5]}"
    for name, tensor in reference.items():
        other = mine[name]
        # Sharded or whole, and how. (Not Parameter against Tensor: on CPU diffusers moves each whole weight to
        # "cpu:0", which accelerate's set_module_tensor_to_device takes for another device, so it copies it and keeps
        # the copy as a plain Tensor; on a GPU it keeps Parameters, as the pack's load does everywhere.)
        if isinstance(other, DTensor) != isinstance(tensor, DTensor) or (
            isinstance(tensor, DTensor) and other.placements != tensor.placements
        ):
            return f"{name}: {type(other).__name__} {getattr(other, 'placements', '')} vs {type(tensor).__name__} "
        a, b = local(other), local(tensor)
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device or not torch.equal(a, b):
            return f"{name}: {a.dtype} {tuple(a.shape)} {a.device} vs {b.dtype} {tuple(b.shape)} {b.device}"
    if ours._parallel_config is None or ours._parallel_config.tensor_parallel_config is None:
        return "the model does not record its tensor-parallel config"
    return "same"


@torch.no_grad()
def same(name: str, model_dir: str, dtype: str, mesh) -> str:
    cls = family(name).transformer_class()
    ours = load_tensor_parallel(cls, model_dir, TORCH_DTYPES[dtype], torch.device("cpu"), mesh)
    theirs = diffusers_load(cls, model_dir, TORCH_DTYPES[dtype], mesh)
    difference = first_difference(ours, theirs)
    if difference != "same":
        return difference
    inputs = forward_inputs(theirs, TORCH_DTYPES[dtype])
    if not torch.equal(ours(**inputs, return_dict=False)[0], theirs(**inputs, return_dict=False)[0]):
        return "the forward passes differ"
    return "same"


def refuse(name: str, model_dir: str, mesh) -> str:
    try:
        load_tensor_parallel(family(name).transformer_class(), model_dir, torch.float32, torch.device("cpu"), mesh)
    except OpError as e:
        return f"refused: {e}"
    return "loaded"


def forward_inputs(transformer: torch.nn.Module, dtype: torch.dtype) -> dict:
    """Random inputs (the same on every rank) for a forward of the family's transformer, 4 image and 3 text tokens."""
    config, generator = transformer.config, torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    inputs = {
        "hidden_states": randn(1, 4, config.in_channels),
        "encoder_hidden_states": randn(1, 3, config.joint_attention_dim),
        "timestep": torch.full((1,), 0.7, dtype=dtype),
    }
    if isinstance(transformer, FluxTransformer2DModel):
        inputs |= {"pooled_projections": randn(1, config.pooled_projection_dim), "guidance": torch.full((1,), 3.5)}
        inputs |= {"img_ids": torch.zeros(4, 3), "txt_ids": torch.zeros(3, 3)}
    elif type(transformer).__name__ == "Flux2Transformer2DModel":
        inputs |= {"guidance": torch.full((1,), 4.0), "img_ids": torch.zeros(1, 4, 4), "txt_ids": torch.zeros(1, 3, 4)}
    else:  # Qwen-Image
        inputs |= {"img_shapes": [(1, 2, 2)], "encoder_hidden_states_mask": torch.ones(1, 3, dtype=torch.long)}
    return inputs


def main() -> None:
    results_path, *cases = sys.argv[1:]
    apply_cpu_shims()
    dist.init_process_group("gloo")
    mesh = device_mesh("cpu", (dist.get_world_size(),), ("tp",))
    checks = {"peak": measure_load, "same": same, "refuse": refuse}
    mine = {}
    for case in cases:
        check, *fields = case.split(":")
        assert check != "peak" or not mine, "a peak is measured first, before any other load"
        try:
            mine[case] = checks[check](*fields, mesh)
        except Exception:
            mine[case] = traceback.format_exc()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        keys = mine.keys()
        with open(results_path, "w") as f:
            json.dump({key: [rank[key] for rank in everyone] for key in keys}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
