"""The pack's ComfyUI nodes, each declared once in ComfyUI's V3 schema (``define_schema``) and listed in ``NODES``.

Thin: a node declares its inputs, outputs and tooltips and calls one step of ``parallel_runtime.jobs``.

The package is called ``parallel_nodes``, not ``nodes``: ComfyUI imports its own top-level ``nodes`` module first, and
the pack's root is on ``sys.path``, so a package of that name would shadow ComfyUI's (or be shadowed by it).
"""

from __future__ import annotations

import logging

from comfy_api.latest import ComfyExtension, io

from parallel_runtime.internals import untested_diffusers

from . import comfy
from .advisor import ParallelAdvisor
from .backend import ParallelBackend
from .comfy_files import ParallelModelFromComfyFiles
from .encode import EncodeOnBalancedGPUs
from .lora import ParallelLoraLoader
from .sampler import ParallelSampler
from .transformer import LoadShardedTransformer
from .vae import VAEDecodeSingleGPU
from .vae_encode import VAEEncodeSingleGPU

NODES: list[type[io.ComfyNode]] = [
    ParallelBackend,
    EncodeOnBalancedGPUs,
    LoadShardedTransformer,
    ParallelSampler,
    VAEDecodeSingleGPU,
    ParallelLoraLoader,
    VAEEncodeSingleGPU,
    ParallelModelFromComfyFiles,
    ParallelAdvisor,
]
NODES_BY_ID = comfy.NODES_BY_ID  # filled here, read by comfy's validation
NODES_BY_ID.update({node.define_schema().node_id: node for node in NODES})


class ParallelDiffusersExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> ParallelDiffusersExtension:
    """ComfyUI's entry point: the pack's nodes, and (inside a server) its routes and the validation hook. A diffusers
    outside the tested range is said in ComfyUI's log, and ParallelBackend's text, rather than found in a run."""
    from . import routes

    if (untested := untested_diffusers()) is not None:
        logging.getLogger(__name__).warning("parallel_diffusers: %s", untested)

    routes.register()
    return ParallelDiffusersExtension()


__all__ = [
    "NODES",
    "NODES_BY_ID",
    "EncodeOnBalancedGPUs",
    "LoadShardedTransformer",
    "ParallelBackend",
    "ParallelLoraLoader",
    "ParallelModelFromComfyFiles",
    "ParallelSampler",
    "VAEDecodeSingleGPU",
    "VAEEncodeSingleGPU",
    "comfy_entrypoint",
]
