"""ComfyUI entry point of comfyui-parallel-diffusers: ``comfy_entrypoint`` (the V3 extension) and the web folder.

ComfyUI imports this file as a module named after the folder, so the pack's own packages are imported by their
absolute names: putting this folder first on sys.path makes the checkout win over any pip-installed copy and keeps
exactly one copy of ``parallel_runtime`` (whose backend registry is process-global) in the ComfyUI process. The nodes
are imported when ComfyUI asks for them, so importing this file needs nothing of ComfyUI (pytest imports it as the
checkout's package).
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.insert(0, _here)

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():  # noqa: ANN201 (a ComfyExtension; its class lives with the nodes)
    from parallel_nodes import comfy_entrypoint as nodes_entrypoint

    return await nodes_entrypoint()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
