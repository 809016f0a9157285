"""CFG parallelism: true CFG's conditional and unconditional transformer passes on two halves of the ranks.

A true-CFG pipeline (QwenImagePipeline, WanPipeline) calls its transformer twice per step, inside
``cache_context("cond")`` and ``cache_context("uncond")``, and combines the two predictions. Under ``cfg_parallel``
the first half of the ranks (the mesh's ``cfg`` coordinate 0) runs only the conditional pass and the second half only
the unconditional one; each rank pairs with its twin in the other half (same context-parallel coordinates, so both
hold the whole prediction after the ``_cp_plan``'s output gather) and one all-gather per step gives both ranks both
predictions. The pipeline's own loop, scheduler and guidance arithmetic run unchanged on every rank, on identical
tensors, so the ranks stay in step and the image equals the one-process one.

This is a diffusers ``ModelHook`` on the transformer itself (outermost, so a context-parallel split never runs for a
pass this rank skips), stateful so that diffusers hands it the cache context, which names the pass. The pipeline
holds the conditional prediction before it asks for the unconditional one: the half that did not compute it returns
an empty tensor of the prediction's shape, filled in place by the exchange during the unconditional call, before
the pipeline reads it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from diffusers.hooks.hooks import BaseState, HookRegistry, ModelHook, StateManager
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch.distributed.device_mesh import DeviceMesh

CFG_PARALLEL_HOOK = "cfg_parallel"
PASSES = ("cond", "uncond")  # the mesh's cfg coordinate runs PASSES[coordinate]


def enable_cfg_parallel(transformer: torch.nn.Module, cfg_mesh: DeviceMesh) -> None:
    """Register the hook on ``transformer`` for this rank's half of the 2-rank ``cfg_mesh`` (collective-free)."""
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(
        CfgParallelHook(cfg_mesh.get_group(), PASSES[cfg_mesh.get_local_rank()]), CFG_PARALLEL_HOOK
    )


def cfg_degree(transformer: torch.nn.Module) -> int:
    """2 when ``transformer`` splits true CFG's passes over two halves of the ranks, else 1 (read back from it)."""
    registry = getattr(transformer, "_diffusers_hook", None)
    return 2 if registry is not None and registry.get_hook(CFG_PARALLEL_HOOK) is not None else 1


class CfgParallelHook(ModelHook):
    """Runs ``mine`` ("cond" or "uncond") of each step's two passes and exchanges the predictions with the twin rank
    of the other half (``group``)."""

    _is_stateful = True

    def __init__(self, group: dist.ProcessGroup, mine: str) -> None:
        super().__init__()
        self.group, self.mine = group, mine
        # Only for the cache context diffusers sets on a stateful hook's StateManager; the state lives below.
        self.state_manager = StateManager(BaseState)
        self._cond: torch.Tensor | None = None  # this step's conditional prediction, computed or to be filled

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        name = self.state_manager._context.name if self.state_manager._context is not None else None
        if name not in PASSES:
            raise RuntimeError(
                f"cfg_parallel: the pipeline called the transformer outside cache_context('cond' / 'uncond') "
                f"(context {name!r}), so this rank cannot tell which of true CFG's passes it is"
            )
        if name == "cond":
            if self._cond is not None:
                raise RuntimeError(
                    "cfg_parallel: two conditional passes in a row; the pipeline is not running true CFG "
                    "(true_cfg_scale > 1 and a negative prompt), so half of the ranks have nothing to do"
                )
            if self.mine == "cond":
                output = self.fn_ref.original_forward(*args, **kwargs)
                self._cond = output[0]
                return output
            hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            self._cond = _empty_prediction(module, hidden_states)
            return _output(kwargs, self._cond)
        if self._cond is None:
            raise RuntimeError("cfg_parallel: an unconditional pass without its conditional one")
        cond, self._cond = self._cond, None
        local = self.fn_ref.original_forward(*args, **kwargs)[0] if self.mine == "uncond" else cond
        both = [torch.empty_like(local) for _ in PASSES]
        dist.all_gather(both, local.contiguous(), group=self.group)
        if self.mine == "uncond":
            if both[0].shape != cond.shape:
                raise RuntimeError(
                    f"cfg_parallel: the conditional prediction is {list(both[0].shape)}, expected {list(cond.shape)}"
                )
            cond.copy_(both[0])
        return _output(kwargs, both[1])

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self._cond = None
        self.state_manager.reset()
        return module


def _empty_prediction(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of the prediction's shape for these latents: packed latents [B, tokens, C] give the
    latents' tokens at proj_out's width (patch² × out_channels); a video transformer's [B, C, T, H, W] (Wan) gives
    its own shape at the config's out_channels."""
    if hidden_states.ndim == 5:
        config = module.config
        channels = config.out_channels or config.in_channels
        return hidden_states.new_empty((hidden_states.shape[0], channels, *hidden_states.shape[2:]))
    return hidden_states.new_empty((*hidden_states.shape[:-1], module.proj_out.out_features))


def _output(kwargs: dict, sample: torch.Tensor) -> Any:
    """The transformer's return value (as its ``return_dict`` argument asks) around ``sample``."""
    return Transformer2DModelOutput(sample=sample) if kwargs.get("return_dict", True) else (sample,)
