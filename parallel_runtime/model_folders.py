"""Where models come from: diffusers ``save_pretrained`` folders under known roots, safetensors only.

Roots are ComfyUI's ``diffusers`` model folders (``folder_paths``, when running inside ComfyUI) followed by
the directories in ``COMFY_PARALLEL_MODELS`` (os.pathsep-separated). A model is named by its folder name; a
name that resolves outside every root is refused.
"""
from __future__ import annotations

import glob
import json
import os

from .errors import InvalidInput

# model_index.json's _class_name -> (family adapter module in worker/families, the family's name for users).
PIPELINES = {
    "FluxPipeline": ("flux", "FLUX.1"),
    "Flux2Pipeline": ("flux2", "FLUX.2"),
    "QwenImagePipeline": ("qwenimage", "Qwen-Image"),
}
_UNSAFE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def roots() -> list[str]:
    found = []
    try:
        import folder_paths  # ComfyUI's; absent outside ComfyUI

        found += folder_paths.get_folder_paths("diffusers")
    except (ImportError, KeyError):
        pass
    found += [p for p in os.environ.get("COMFY_PARALLEL_MODELS", "").split(os.pathsep) if p]
    return [os.path.realpath(p) for p in dict.fromkeys(found)]


def pipeline_class(model_dir: str) -> str | None:
    """model_index.json's _class_name, or None when the folder is no diffusers pipeline."""
    try:
        with open(os.path.join(model_dir, "model_index.json")) as f:
            return json.load(f).get("_class_name")
    except (OSError, ValueError):
        return None


def list_models() -> list[str]:
    """Names of the supported pipelines found under the roots, sorted."""
    names = set()
    for root in roots():
        for index in glob.glob(os.path.join(root, "**", "model_index.json"), recursive=True):
            model_dir = os.path.dirname(index)
            if pipeline_class(model_dir) in PIPELINES:
                names.add(os.path.relpath(model_dir, root))
    return sorted(names)


def resolve(name: str, widget: str = "model") -> str:
    """The folder of model ``name``, checked: inside a root, a supported pipeline, safetensors weights only."""
    if not name:
        raise InvalidInput(widget, "no model selected; put a diffusers folder (save_pretrained) in "
                                   "models/diffusers or COMFY_PARALLEL_MODELS and pick it here")
    for root in roots():
        model_dir = os.path.realpath(os.path.join(root, name))
        if os.path.commonpath([root, model_dir]) != root:
            raise InvalidInput(widget, f"{name!r} points outside the model folders; pick a folder name from the list")
        if os.path.isfile(os.path.join(model_dir, "model_index.json")):
            break
    else:
        where = ", ".join(roots()) or "no model folder is configured (set COMFY_PARALLEL_MODELS)"
        raise InvalidInput(widget, f"unknown model {name!r}; models are diffusers folders in: {where}")
    class_name = pipeline_class(model_dir)
    if class_name not in PIPELINES:
        raise InvalidInput(widget, f"{name!r} is a {class_name}; supported pipelines: "
                                   + ", ".join(f"{label} ({k})" for k, (_, label) in PIPELINES.items()))
    for component in sorted(os.listdir(model_dir)):
        sub = os.path.join(model_dir, component)
        unsafe = [p for pattern in _UNSAFE_WEIGHTS for p in glob.glob(os.path.join(sub, pattern))]
        if unsafe and not glob.glob(os.path.join(sub, "*.safetensors")):
            raise InvalidInput(widget, f"{name}/{component} has only pickle weights ({os.path.basename(unsafe[0])}); "
                                       "only safetensors are loaded — re-save it with save_pretrained(safe_serialization=True)")
    return model_dir


def read_config(model_dir: str, component: str) -> dict:
    with open(os.path.join(model_dir, component, "config.json")) as f:
        return json.load(f)
