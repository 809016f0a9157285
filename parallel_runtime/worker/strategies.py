"""How an SPMD transformer is built and how a batch is shared: context, tensor and data parallelism.

A strategy is a small dict from the client: ``{"kind": "context_parallel", "ring_degree": r, "ulysses_degree": u,
"anything": bool, "attention_backend": "auto"|name}``, ``{"kind": "tensor_parallel", "tp_degree": t}``, ``tp_cp``
(both key sets: TP within groups of ``tp_degree`` neighbouring ranks, CP across them) or ``{"kind": "data_parallel"}``.
Family-agnostic: the transformer class comes from its config.json.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from .families import expand_batch


def describe(strategy: dict) -> str:
    """A short, stable name for the resident-model key."""
    kind = strategy["kind"]
    if kind == "context_parallel":
        mode = "+anything" if strategy.get("anything") else ""
        return f"cp:ring{strategy['ring_degree']}xulysses{strategy['ulysses_degree']}{mode}:{strategy.get('attention_backend', 'auto')}"
    if kind == "tensor_parallel":
        return f"tp{strategy['tp_degree']}"
    if kind == "tp_cp":
        return f"tp{strategy['tp_degree']}x" + describe({**strategy, "kind": "context_parallel"})
    return kind


def _transformer_class(model_dir: str) -> type:
    import diffusers

    with open(os.path.join(model_dir, "transformer", "config.json")) as f:
        return getattr(diffusers, json.load(f)["_class_name"])


def _attention_backend(strategy: dict, device: torch.device) -> str | None:
    """Ring attention merges partial results by their log-sum-exp, so it needs a backend whose op returns it;
    Ulysses works with the default one."""
    chosen = strategy.get("attention_backend", "auto")
    if chosen != "auto":
        return chosen
    if strategy["ring_degree"] > 1:
        if device.type == "cpu":
            from ..cpu_shims import CPU_RING_ATTENTION_BACKEND

            return CPU_RING_ATTENTION_BACKEND
        return "_native_cudnn"
    return None


def _context_parallel_config(strategy: dict, mesh=None):
    from diffusers import ContextParallelConfig

    ring, ulysses, anything = strategy["ring_degree"], strategy["ulysses_degree"], strategy.get("anything", False)
    return ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses, mesh=mesh,
                                 ulysses_anything=anything and ulysses > 1, ring_anything=anything and ring > 1)


def _set_attention_backend(transformer: torch.nn.Module, backend: str) -> None:
    """``transformer.set_attention_backend(backend)`` for this model only. diffusers also makes it the process-wide
    default, which in a persistent rank leaks into every model loaded later: after a Ring run, a data-parallel
    Qwen-Image batch with a text mask failed on a backend that takes no mask."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    default = _AttentionBackendRegistry.get_active_backend()[0]
    transformer.set_attention_backend(backend)
    _AttentionBackendRegistry.set_active_backend(default)


def _enable_context_parallel(transformer: torch.nn.Module, strategy: dict, device: torch.device, mesh=None) -> None:
    backend = _attention_backend(strategy, device)
    if backend is not None:
        _set_attention_backend(transformer, backend)
    transformer.enable_parallelism(config=_context_parallel_config(strategy, mesh))


def _tp_cp_transformer(cls: type, model_dir: str, dtype: torch.dtype, device: torch.device,
                       strategy: dict) -> torch.nn.Module:
    """Tensor parallelism inside groups of ``tp_degree`` neighbouring ranks, context parallelism across the groups,
    on one (ring, ulysses, tp) mesh. TP is the innermost axis: it all-reduces in every block, so its ranks should
    share the fastest links (one node, NVLink).

    diffusers 0.42.1 gives both configs a ``mesh`` argument for this, but its ``ParallelConfig`` still refuses to
    hold both and ``enable_parallelism`` refuses a model loaded with a ``parallel_config``. So: load TP-sharded
    (each rank reads its slice), enable CP on the same mesh, then record the TP config beside the CP one so that
    diffusers' own guards (``_is_tensor_parallel``) still see the model as sharded. This works because the attention
    processors are TP-agnostic (they read the local head count) and CP splits the sequence before the first sharded
    layer. Experimental, as the tooltip says.
    """
    from diffusers import TensorParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (strategy["ring_degree"], strategy["ulysses_degree"], strategy["tp_degree"]),
                            mesh_dim_names=("ring", "ulysses", "tp"))
    transformer = cls.from_pretrained(model_dir, subfolder="transformer", dtype=dtype,
                                      parallel_config=TensorParallelConfig(mesh=mesh["tp"]))
    tensor_parallel = transformer._parallel_config.tensor_parallel_config
    transformer._parallel_config = None
    _enable_context_parallel(transformer, strategy, device, mesh)
    transformer._parallel_config.tensor_parallel_config = tensor_parallel
    return transformer


def load_transformer(model_dir: str, dtype: torch.dtype, device: torch.device, strategy: dict) -> torch.nn.Module:
    """This rank's transformer for ``strategy`` (collective: every rank calls it together)."""
    from diffusers import TensorParallelConfig

    cls = _transformer_class(model_dir)
    kind = strategy["kind"]
    if kind == "tensor_parallel":
        # Each rank reads only its slice of every planned weight while loading; the full checkpoint is never
        # materialised per rank.
        return cls.from_pretrained(model_dir, subfolder="transformer", dtype=dtype,
                                   parallel_config=TensorParallelConfig(tp_degree=strategy["tp_degree"]))
    if kind == "tp_cp":
        return _tp_cp_transformer(cls, model_dir, dtype, device, strategy)
    transformer = cls.from_pretrained(model_dir, subfolder="transformer", dtype=dtype).to(device)
    if kind == "context_parallel":
        # `from_pretrained(parallel_config=ContextParallelConfig(...))` fails in diffusers 0.42.1; CP keeps full
        # weights on every rank anyway, so enabling it after loading costs nothing.
        _enable_context_parallel(transformer, strategy, device)
    return transformer


def share(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first image, count) of this rank's slice of a batch: consecutive, the first ranks take one more."""
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def slice_batch(tensors: dict[str, torch.Tensor], batch_size: int, start: int, count: int) -> dict[str, torch.Tensor]:
    """Images ``start .. start + count`` of a batch's conditioning (laid out as ``families.expand_batch`` does: prompt
    by prompt), so a rank's slice may span prompts."""
    return {name: rows[start:start + count] for name, rows in expand_batch(tensors, batch_size).items()}


def gather_batch(local: torch.Tensor, batch_size: int, world_size: int) -> torch.Tensor | None:
    """Rank 0 gets every rank's slice in order (others get None). gloo gathers equal shapes only: pad, gather, trim."""
    counts = [share(batch_size, r, world_size)[1] for r in range(world_size)]
    longest = max(counts)
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype)
    padded[: local.shape[0]] = local.cpu()
    pieces = [torch.empty_like(padded) for _ in counts] if dist.get_rank() == 0 else None
    dist.gather(padded, pieces, dst=0)
    if pieces is None:
        return None
    return torch.cat([piece[:count] for piece, count in zip(pieces, counts)])
