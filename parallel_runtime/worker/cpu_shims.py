"""Compatibility shims that let diffusers' (0.42) context and tensor parallelism run on CPU ranks over gloo.

diffusers' distributed code is written for accelerators and NCCL. With these five shims every strategy runs on
CPU and matches a single process to float32 rounding, which is what makes the CPU mode (and the test suite on a
machine without GPUs) real. Each shim changes only what a CPU run trips over, and each names the diffusers code
it works around, so it can be dropped when upstream fixes that code.

`apply_cpu_shims()` is idempotent. The caller decides when the ranks run on CPU; on GPUs nothing here is needed.

Ring, unified and ring-anything attention also need an attention backend whose op returns the log-sum-exp; on CPU
that is `CPU_RING_ATTENTION_BACKEND` (set it with `transformer.set_attention_backend(...)`). diffusers' default
"native" backend cannot return it, and Ulysses does not need it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.hooks import context_parallel, tensor_parallel
from diffusers.models import _modeling_parallel, attention_dispatch
from diffusers.models.modeling_utils import ModelMixin

CPU_RING_ATTENTION_BACKEND = "_native_flash"

_applied = False


def apply_cpu_shims() -> None:
    """Apply the CPU shims to diffusers, once per process."""
    global _applied
    if _applied:
        return
    _report_a_device_while_resolving_parallel_config()
    _allow_tensor_parallel_on_cpu()
    _route_native_flash_to_cpu_kernel()
    _gather_sizes_on_cpu()
    _pad_uneven_all_gathers()
    _applied = True


def _report_a_device_while_resolving_parallel_config() -> None:
    # `ModelMixin._resolve_parallel_config` (used by `enable_parallelism` and `from_pretrained(parallel_config=...)`)
    # picks the rank's device as `rank % torch.accelerator.device_count()`, which is 0 on a CPU-only machine:
    # ZeroDivisionError. While it runs, report one device; the result is then `cpu:0` for every rank. The patch is
    # scoped to that call because torch itself reads `device_count()` elsewhere (RNG state, launchers) and must
    # keep seeing the truth.
    resolve = ModelMixin._resolve_parallel_config

    @functools.wraps(resolve)
    def resolve_with_a_device(self: ModelMixin, *args: object, **kwargs: object) -> object:
        device_count = torch.accelerator.device_count
        torch.accelerator.device_count = lambda: max(1, device_count())
        try:
            return resolve(self, *args, **kwargs)
        finally:
            torch.accelerator.device_count = device_count

    ModelMixin._resolve_parallel_config = resolve_with_a_device


def _allow_tensor_parallel_on_cpu() -> None:
    # `diffusers.hooks.tensor_parallel.apply_tensor_parallel` refuses any mesh whose device type is not in
    # `_SUPPORTED_TP_DEVICES` ("cuda", "neuron", "tpu", "xpu"). torch's DTensor parallel styles work on CPU over
    # gloo as they are, so "cpu" only has to be admitted.
    if "cpu" not in tensor_parallel._SUPPORTED_TP_DEVICES:
        tensor_parallel._SUPPORTED_TP_DEVICES = (*tensor_parallel._SUPPORTED_TP_DEVICES, "cpu")


def _route_native_flash_to_cpu_kernel() -> None:
    # Ring attention merges per-chunk results with their log-sum-exp, so it needs a forward op that returns it. The
    # `_native_flash` backend's op, `attention_dispatch._native_flash_attention_forward_op`, calls
    # `aten._scaled_dot_product_flash_attention`, which has no CPU kernel. The CPU kernel is
    # `aten._scaled_dot_product_flash_attention_for_cpu` (same math, returns (out, lse)). Forward only: the backend
    # never trains, and the CPU kernel's backward differs from the CUDA one that diffusers' backward op calls.
    cuda_forward_op = attention_dispatch._native_flash_attention_forward_op

    @functools.wraps(cuda_forward_op)
    def forward_op(
        ctx: object,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_lse: bool = False,
        _save_ctx: bool = True,
        _parallel_config: object = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if query.device.type != "cpu":
            return cuda_forward_op(
                ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                _save_ctx=_save_ctx, _parallel_config=_parallel_config,
            )  # fmt: skip
        if enable_gqa:
            raise ValueError("`enable_gqa` is not yet supported for native flash attention.")
        # diffusers' layout is (batch, seq, heads, dim); the kernel's is (batch, heads, seq, dim).
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            dropout_p,
            is_causal,
            attn_mask=attn_mask,
            scale=scale,
        )
        out = out.transpose(1, 2).contiguous()
        lse = lse.transpose(1, 2).contiguous()  # (batch, seq, heads), as the CUDA op returns it
        return (out, lse) if return_lse else out

    attention_dispatch._native_flash_attention_forward_op = forward_op


def _gather_sizes_on_cpu() -> None:
    # The "anything" modes first exchange each rank's sequence length with
    # `diffusers.models._modeling_parallel.gather_size_by_comm`. It allocates those sizes on the CPU only when the
    # group's backend string contains "cpu" (e.g. "cpu:gloo,cuda:nccl"), otherwise on
    # `torch.accelerator.current_accelerator()`, which is "cuda" for any CUDA build of torch even with no GPU
    # present: a plain "gloo" group then fails ("Found no NVIDIA driver") or receives CUDA tensors it cannot send.
    # For gloo groups, gather on the CPU. The function is imported by name into two modules, so all three names
    # are replaced.
    gather_on_accelerator = _modeling_parallel.gather_size_by_comm

    @functools.wraps(gather_on_accelerator)
    def gather_size_by_comm(size: int, group: dist.ProcessGroup) -> list[int]:
        if "gloo" not in str(dist.get_backend(group=group)):
            return gather_on_accelerator(size, group)
        sizes = [torch.empty((1,), dtype=torch.int64) for _ in range(dist.get_world_size(group=group))]
        dist.all_gather(sizes, torch.tensor([size], dtype=torch.int64), group=group)
        return [s.item() for s in sizes]

    for module in (_modeling_parallel, context_parallel, attention_dispatch):
        module.gather_size_by_comm = gather_size_by_comm


def _pad_uneven_all_gathers() -> None:
    # The "anything" modes (`ulysses_anything`, `ring_anything`) let ranks hold different sequence lengths and
    # gather the model output with `diffusers.hooks.context_parallel._all_gather_anything`, a `dist.all_gather` of
    # differently shaped tensors. NCCL accepts that; gloo requires equal sizes. Pad every rank's tensor to the
    # longest, gather, then trim each piece back to its rank's true length.
    def all_gather_anything(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        tensor = tensor.contiguous()
        sizes = context_parallel.gather_size_by_comm(tensor.shape[dim], group)
        longest = max(sizes)
        # F.pad lists (left, right) pairs from the last dimension backwards.
        padding = [0, 0] * (tensor.ndim - 1 - dim % tensor.ndim) + [0, longest - tensor.shape[dim]]
        padded = F.pad(tensor, padding).contiguous()
        gathered = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(gathered, padded, group=group)
        return torch.cat([piece.narrow(dim, 0, size) for piece, size in zip(gathered, sizes)], dim=dim)

    context_parallel._all_gather_anything = all_gather_anything
