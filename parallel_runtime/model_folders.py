"""Where models come from: diffusers ``save_pretrained`` folders under known roots, safetensors only.

Roots are ComfyUI's ``diffusers`` model folders (``folder_paths``, when ComfyUI has loaded it) followed by the
directories in ``COMFY_PARALLEL_MODELS`` (os.pathsep-separated). A model is named by its folder's path below its root
(``FLUX.1-dev``, ``black-forest-labs/FLUX.1-dev``). What is confined is the widget's string: only a listed name
resolves (no ``..``, no absolute path); a model folder that is a symbolic link the user put into a root (models kept
on another disk) is the user's choice and loads.

Folders converted from ComfyUI's own files (``comfy_files``, ParallelModelFromComfyFiles) resolve too, from
``converted_root()`` after the roots; they are not listed (that node names them). ComfyUI's own files themselves come
from ``comfyui_folders`` too (``comfy_files`` says which folder kinds each widget reads).

LoRAs are files under ComfyUI's ``loras`` folders (``folder_paths``, once ComfyUI has loaded it) followed by the
directories in ``COMFY_PARALLEL_LORAS``, named by their path below the root (``style.safetensors``,
``flux/style.safetensors``) and confined the same way.

Weight files that are never loaded (``REFUSED_SUFFIXES``, with the reason each is refused) are listed beside the
safetensors ones wherever files are listed, so that picking one says why it is refused rather than that it does not
exist.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator

from . import families
from .errors import InvalidInput
from .families.lora import SAFETENSORS_SUFFIXES
from .wire import ModelRef

log = logging.getLogger(__name__)

_PICKLE = "a pickle, which can run code when it is loaded"
_PICKLE_ARCHIVE = "a PyTorch archive of pickles, which can run code when it is loaded"
# What ComfyUI lists besides safetensors (its supported_pt_extensions, and ComfyUI-GGUF's .gguf), with the reason it is
# never loaded.
REFUSED_SUFFIXES = {
    ".ckpt": _PICKLE,
    ".pt": _PICKLE,
    ".pth": _PICKLE,
    ".bin": _PICKLE,
    ".pkl": _PICKLE,
    ".pt2": _PICKLE_ARCHIVE,
    ".gguf": "a GGUF file (ComfyUI-GGUF's quantization), which diffusers' parallel strategies cannot load",
}
# What a loras folder lists besides LoRAs: the pickles (LoRA files are refused by ``families.lora.check_file``).
PICKLE_SUFFIXES = tuple(suffix for suffix, why in REFUSED_SUFFIXES.items() if why in (_PICKLE, _PICKLE_ARCHIVE))
MAX_DEPTH = 3  # folder levels searched below a root: "name" and "org/name" are the usual layouts
_warned: set[str] = set()


def comfyui_folders(kind: str, variable: str, *, kind_below: bool = False) -> list[str]:
    """Where files of ComfyUI's folder ``kind`` are: ComfyUI's own folders of that kind (once ComfyUI has loaded
    ``folder_paths``), then the directories in the environment ``variable`` (os.pathsep-separated) or, with
    ``kind_below``, their ``kind`` sub-folders (the variable names ComfyUI-style ``models`` directories). Absolute,
    each once, in that order."""
    found = []
    folder_paths = sys.modules.get("folder_paths")  # ComfyUI's, once ComfyUI has loaded it
    if folder_paths is not None:
        try:
            found += folder_paths.get_folder_paths(kind)
        except KeyError:
            pass
    found += [os.path.join(p, kind) if kind_below else p for p in os.environ.get(variable, "").split(os.pathsep) if p]
    return [os.path.abspath(p) for p in dict.fromkeys(found)]


def roots() -> list[str]:
    return comfyui_folders("diffusers", "COMFY_PARALLEL_MODELS")


def converted_root() -> str:
    """Where ComfyUI's own files are converted to (``comfy_files``): ``COMFY_PARALLEL_CONVERTED``, else ComfyUI's
    models directory's ``parallel_diffusers_converted``, else ``~/.cache/comfyui-parallel-diffusers/converted``."""
    if os.environ.get("COMFY_PARALLEL_CONVERTED"):
        return os.path.abspath(os.environ["COMFY_PARALLEL_CONVERTED"])
    folder_paths = sys.modules.get("folder_paths")
    if folder_paths is not None and getattr(folder_paths, "models_dir", None):
        return os.path.join(folder_paths.models_dir, "parallel_diffusers_converted")
    return os.path.join(os.path.expanduser("~"), ".cache", "comfyui-parallel-diffusers", "converted")


def _warn_once(path: str, why: str) -> None:
    if path not in _warned:
        _warned.add(path)
        log.warning("parallel_diffusers: skipping %s: %s", path, why)


def pipeline_class(model_dir: str) -> str | None:
    """model_index.json's _class_name, or None when the folder holds no readable diffusers pipeline (logged once)."""
    index = os.path.join(model_dir, "model_index.json")
    try:
        with open(index) as f:
            data = json.load(f)
    except OSError:
        return None
    except (ValueError, RecursionError) as e:
        _warn_once(index, f"not valid JSON ({type(e).__name__})")
        return None
    name = data.get("_class_name") if isinstance(data, dict) else None
    if not isinstance(name, str):
        _warn_once(index, "no _class_name string in it")
        return None
    return name


def _pipeline_folders(root: str) -> Iterator[tuple[str, str]]:
    """Folders below ``root`` that hold a model_index.json, as (name, path). Symbolic links are followed, except one
    that leads back to a folder it sits in (a loop); the depth limit bounds the rest."""
    for here, dirs, files in os.walk(root, followlinks=True):
        depth = 0 if here == root else os.path.relpath(here, root).count(os.sep) + 1
        if "model_index.json" in files:
            dirs[:] = []  # a pipeline's components are not pipelines of their own
            yield os.path.relpath(here, root).replace(os.sep, "/"), here
            continue
        real = os.path.realpath(here)
        dirs[:] = (
            []
            if depth >= MAX_DEPTH
            else sorted(
                d for d in dirs if not (real + os.sep).startswith(os.path.realpath(os.path.join(here, d)) + os.sep)
            )
        )


def list_models() -> list[str]:
    """Names of the supported pipelines found under the roots, sorted. One broken folder is skipped (with a warning
    naming it), never a reason for the node list to fail."""
    names = set()
    for root in roots():
        for name, path in _pipeline_folders(root):
            class_name = pipeline_class(path)
            if families.for_pipeline(class_name) is not None:
                names.add(name)
            elif class_name is not None:
                _warn_once(path, f"{class_name} is not a supported pipeline ({families.supported()})")
    return sorted(names)


def confined(name: str, widget: str, what: str = "a model name; pick a folder name from the list") -> str:
    """``name`` as a relative path that stays below whatever root it is joined to; InvalidInput naming ``widget``
    (``name`` is not ``what``) for an absolute path, ``..`` or an empty part."""
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or ".." in parts or "" in parts:
        raise InvalidInput(widget, f"{name!r} is not {what}")
    return os.path.join(*parts)


def resolve(name: str, widget: str = "model") -> ModelRef:
    """Model ``name`` checked: a listed folder below a root, a supported pipeline, safetensors weights only."""
    if not name:
        raise InvalidInput(
            widget,
            "no model selected; put a diffusers folder (save_pretrained) in "
            "models/diffusers or COMFY_PARALLEL_MODELS and pick it here",
        )
    relative = confined(name, widget)
    # Last: ComfyUI's own files converted by ParallelModelFromComfyFiles (not listed: that node names them).
    model_dir = next(
        (
            os.path.join(root, relative)
            for root in [*roots(), converted_root()]
            if os.path.isfile(os.path.join(root, relative, "model_index.json"))
        ),
        None,
    )
    if model_dir is None:
        where = ", ".join(roots()) or "no model folder is configured (set COMFY_PARALLEL_MODELS)"
        raise InvalidInput(widget, f"unknown model {name!r}; models are diffusers folders in: {where}")
    class_name = pipeline_class(model_dir)
    adapter = families.for_pipeline(class_name)
    if adapter is None:
        what = f"a {class_name}" if class_name else "not a readable diffusers pipeline (see the log)"
        raise InvalidInput(widget, f"{name!r} is {what}; supported pipelines: {families.supported()}")
    for component in sorted(os.listdir(model_dir)):
        sub = os.path.join(model_dir, component)
        if not os.path.isdir(sub):
            continue
        files = os.listdir(sub)
        refused = sorted(f for f in files if refused_because(f))
        if refused and not any(f.endswith(".safetensors") for f in files):
            raise InvalidInput(
                widget,
                f"{name}/{component} has no safetensors weights, only {refused[0]}, {refused_because(refused[0])}; "
                "only safetensors are loaded — re-save it with save_pretrained(safe_serialization=True)",
            )
    return ModelRef(name=name, path=model_dir, family=adapter.key)


def refused_because(file_name: str) -> str | None:
    """Why a weights file named ``file_name`` is never loaded (``REFUSED_SUFFIXES``), or None."""
    return REFUSED_SUFFIXES.get(os.path.splitext(file_name)[1].lower())


def read_config(model: ModelRef, component: str) -> dict:
    with open(os.path.join(model.path, component, "config.json")) as f:
        return json.load(f)


# -- LoRA files --------------------------------------------------------------------------------------------------
def lora_roots() -> list[str]:
    return comfyui_folders("loras", "COMFY_PARALLEL_LORAS")


def _lora_files(root: str):
    """Files below ``root`` with a LoRA's (or a pickle's) suffix, as names relative to it; symbolic links followed,
    loops not."""
    seen: set[str] = set()
    for here, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(here)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        for file in sorted(files):
            if file.lower().endswith(SAFETENSORS_SUFFIXES + PICKLE_SUFFIXES):
                yield os.path.relpath(os.path.join(here, file), root).replace(os.sep, "/")


def list_loras() -> list[str]:
    """Names of the LoRA files under the LoRA roots, sorted."""
    return sorted({name for root in lora_roots() for name in _lora_files(root)})


def resolve_lora(name: str, widget: str = "lora_name") -> str:
    """LoRA ``name`` checked: a listed file below a LoRA root. Its path; the suffix is the caller's to check."""
    if not name:
        raise InvalidInput(
            widget, "no LoRA selected; put a .safetensors LoRA in models/loras or COMFY_PARALLEL_LORAS and pick it here"
        )
    relative = confined(name, widget, "a LoRA name; pick a file from the list")
    if not name.lower().endswith(SAFETENSORS_SUFFIXES + PICKLE_SUFFIXES):
        raise InvalidInput(widget, f"{name!r} is not a LoRA file name; pick a file from the list")
    path = next(
        (os.path.join(root, relative) for root in lora_roots() if os.path.isfile(os.path.join(root, relative))), None
    )
    if path is None:
        where = ", ".join(lora_roots()) or "no LoRA folder is configured (set COMFY_PARALLEL_LORAS)"
        raise InvalidInput(widget, f"unknown LoRA {name!r}; LoRAs are .safetensors files in: {where}")
    return path
