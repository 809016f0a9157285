"""ComfyUI entry point of comfyui-parallel-diffusers.

ComfyUI imports this file as a module named after the folder, so the pack's own packages are
imported by their absolute names: putting this folder first on sys.path makes the checkout win over any
pip-installed copy and keeps exactly one copy of ``parallel_runtime`` (whose backend registry is
process-global) in the ComfyUI process.
"""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.insert(0, _here)

from parallel_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
