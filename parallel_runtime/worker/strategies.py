"""How an SPMD transformer is built from its ``StrategyPlan`` and how a batch is shared: context, tensor, data and
CFG parallelism. Family-agnostic: the family names its transformer class.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import InvalidInput
from ..families.base import expand_batch
from ..gguf_files import gguf_weights, load_gguf_transformer
from ..strategy import StrategyPlan, check_attention_on_gpu, ring_attention_backend
from ..wire import Weights
from .cfg_parallel import enable_cfg_parallel
from .diagnostics import device_label
from .meshes import device_mesh
from .ops import WidgetError
from .tp_slices import fp8_files, load_gguf_tensor_parallel, load_tensor_parallel

if TYPE_CHECKING:
    from diffusers import ContextParallelConfig


def check_attention(plan: StrategyPlan, device: torch.device) -> None:
    """WidgetError when this rank's GPU cannot run the plan's attention (before anything loads; the client checked
    the dtype and the packages already)."""
    if device.type != "cuda":
        return
    try:
        check_attention_on_gpu(plan, torch.cuda.get_device_capability(device), device_label(device))
    except InvalidInput as e:
        raise WidgetError(e.widget, str(e).removeprefix(f"{e.widget}: ")) from None


def _attention_backend(plan: StrategyPlan, device: torch.device) -> str | None:
    """Ring attention merges partial results by their log-sum-exp, so it needs a backend whose op returns it, chosen
    by the GPU's generation (``strategy.ring_attention_backend``); Ulysses works with the default one."""
    if plan.attention_backend != "auto":
        return plan.attention_backend
    if plan.ring_degree > 1:
        if device.type == "cpu":
            from .cpu_shims import CPU_RING_ATTENTION_BACKEND

            return CPU_RING_ATTENTION_BACKEND
        return ring_attention_backend(torch.cuda.get_device_capability(device))
    return None


def _context_parallel_config(plan: StrategyPlan, mesh: DeviceMesh) -> ContextParallelConfig:
    from diffusers import ContextParallelConfig

    ring, ulysses = plan.ring_degree, plan.ulysses_degree
    return ContextParallelConfig(
        ring_degree=ring,
        ulysses_degree=ulysses,
        mesh=mesh,
        ulysses_anything=plan.anything and ulysses > 1,
        ring_anything=plan.anything and ring > 1,
    )


def _set_attention_backend(transformer: torch.nn.Module, backend: str) -> None:
    """``transformer.set_attention_backend(backend)`` for this model only. diffusers also makes it the process-wide
    default, which in a persistent rank leaks into every model loaded later: after a Ring run, a data-parallel
    Qwen-Image batch with a text mask failed on a backend that takes no mask."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    default = _AttentionBackendRegistry.get_active_backend()[0]
    transformer.set_attention_backend(backend)
    _AttentionBackendRegistry.set_active_backend(default)


def _enable_context_parallel(
    transformer: torch.nn.Module, plan: StrategyPlan, device: torch.device, mesh: DeviceMesh
) -> None:
    """Split the tokens over ``mesh``'s ring and ulysses axes, beside any tensor-parallel sharding already applied.

    diffusers 0.42.1 gives both configs a ``mesh`` argument for TP × CP, but its ``ParallelConfig`` still refuses to
    hold both and ``enable_parallelism`` refuses a model loaded with a ``parallel_config``. So the TP config is set
    aside while CP is enabled on the same mesh, then recorded beside the CP one so that diffusers' own guards
    (``_is_tensor_parallel``) still see the model as sharded. This works because the attention processors are
    TP-agnostic (they read the local head count) and CP splits the sequence before the first sharded layer.
    Experimental, as the tooltip says.
    """
    backend = _attention_backend(plan, device)
    if backend is not None:
        _set_attention_backend(transformer, backend)
    sharded = transformer._parallel_config  # a tensor-parallel load's, None otherwise
    transformer._parallel_config = None
    transformer.enable_parallelism(config=_context_parallel_config(plan, mesh))
    if sharded is not None:
        transformer._parallel_config.tensor_parallel_config = sharded.tensor_parallel_config


def load_transformer(
    cls: type,
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    plan: StrategyPlan,
    weights: Weights = Weights.AS_STORED,
    subfolder: str = "transformer",
) -> torch.nn.Module:
    """This rank's ``cls`` transformer (in ``subfolder``: Wan 2.2's second expert is another) for ``plan``
    (collective: every rank calls it together), built axis by axis on the plan's one mesh: the weights' slices, then
    the tokens' split, then true CFG's passes. A folder's fp8 weights are held as ``weights`` says
    (``worker/fp8_weights.py``)."""
    mesh = device_mesh(device.type, plan.mesh_shape, plan.mesh_dim_names) if plan.mesh_dim_names else None
    as_stored = weights is Weights.AS_STORED
    gguf = gguf_weights(os.path.join(model_dir, subfolder)) is not None
    if plan.shards_weights:
        # Each rank reads only its slice of every planned weight, into the tensor it keeps: no rank ever holds the
        # whole model, not even while loading.
        if gguf:
            transformer = load_gguf_tensor_parallel(cls, model_dir, dtype, device, mesh["tp"], subfolder)
        else:
            transformer = load_tensor_parallel(cls, model_dir, dtype, device, mesh["tp"], as_stored, subfolder)
    elif gguf:
        transformer = load_gguf_transformer(cls, model_dir, dtype, str(device), subfolder)
    elif fp8_files(model_dir, subfolder):
        # from_pretrained would cast every fp8 weight to ``dtype`` (the whole model in it at once) and ignore the
        # scales: the same reader as tensor parallelism's, for the whole model.
        transformer = load_tensor_parallel(cls, model_dir, dtype, device, None, as_stored, subfolder)
    else:
        # Each tensor goes to the rank's device as it is read: loading on the host and moving afterwards would hold
        # the whole model in every rank's host memory at once (N × 24 GB for FLUX.1-dev on N GPUs when its dtype
        # changes).
        transformer = cls.from_pretrained(
            model_dir, subfolder=subfolder, dtype=dtype, use_safetensors=True, device_map={"": str(device)}
        )
    if plan.splits_tokens:
        # `from_pretrained(parallel_config=ContextParallelConfig(...))` fails in diffusers 0.42.1; the split lives in
        # hooks, not in the weights, so enabling it after loading costs nothing.
        _enable_context_parallel(transformer, plan, device, mesh)
    if plan.splits_cfg:
        enable_cfg_parallel(transformer, mesh["cfg"])
    return transformer


def slice_batch(tensors: dict[str, torch.Tensor], batch_size: int, start: int, count: int) -> dict[str, torch.Tensor]:
    """Images ``start .. start + count`` of a batch's conditioning (laid out as ``expand_batch`` does: prompt by
    prompt), so a rank's slice may span prompts."""
    return {name: rows[start : start + count] for name, rows in expand_batch(tensors, batch_size).items()}


def gather_batch(local: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor | None:
    """Rank 0 gets every rank's slice in order (``counts``: each rank's images; others get None). gloo gathers equal
    shapes only: pad, gather, trim."""
    longest = max(counts)
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype)
    padded[: local.shape[0]] = local.cpu()
    pieces = [torch.empty_like(padded) for _ in counts] if dist.get_rank() == 0 else None
    dist.gather(padded, pieces, dst=0)
    if pieces is None:
        return None
    return torch.cat([piece[:count] for piece, count in zip(pieces, counts)])
