"""How an SPMD transformer is built and how a batch is shared: context, tensor and data parallelism.

A strategy is a small dict from the client: ``{"kind": "context_parallel", "ring_degree": r, "ulysses_degree": u,
"anything": bool, "attention_backend": "auto"|name}``, ``{"kind": "tensor_parallel", "tp_degree": t}`` or
``{"kind": "data_parallel"}``. Family-agnostic: the transformer class comes from its config.json.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def describe(strategy: dict) -> str:
    """A short, stable name for the resident-model key."""
    kind = strategy["kind"]
    if kind == "context_parallel":
        mode = "+anything" if strategy.get("anything") else ""
        return f"cp:ring{strategy['ring_degree']}xulysses{strategy['ulysses_degree']}{mode}:{strategy.get('attention_backend', 'auto')}"
    if kind == "tensor_parallel":
        return f"tp{strategy['tp_degree']}"
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


def load_transformer(model_dir: str, dtype: torch.dtype, device: torch.device, strategy: dict) -> torch.nn.Module:
    """This rank's transformer for ``strategy`` (collective: every rank calls it together)."""
    from diffusers import ContextParallelConfig, TensorParallelConfig

    cls = _transformer_class(model_dir)
    kind = strategy["kind"]
    if kind == "tensor_parallel":
        # Each rank reads only its slice of every planned weight while loading; the full checkpoint is never
        # materialised per rank.
        return cls.from_pretrained(model_dir, subfolder="transformer", dtype=dtype,
                                   parallel_config=TensorParallelConfig(tp_degree=strategy["tp_degree"]))
    transformer = cls.from_pretrained(model_dir, subfolder="transformer", dtype=dtype).to(device)
    if kind == "context_parallel":
        ring, ulysses, anything = strategy["ring_degree"], strategy["ulysses_degree"], strategy.get("anything", False)
        backend = _attention_backend(strategy, device)
        if backend is not None:
            transformer.set_attention_backend(backend)
        # `from_pretrained(parallel_config=ContextParallelConfig(...))` fails in diffusers 0.42.1; CP keeps full
        # weights on every rank anyway, so enabling it after loading costs nothing.
        transformer.enable_parallelism(config=ContextParallelConfig(
            ring_degree=ring, ulysses_degree=ulysses,
            ulysses_anything=anything and ulysses > 1, ring_anything=anything and ring > 1))
    return transformer


def share(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first image, count) of this rank's slice of a batch: consecutive, the first ranks take one more."""
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


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
