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
from .gguf_files import GGUF_SUFFIX, gguf_weights, moved_keys
from .headers import read_header
from .wire import ModelRef

log = logging.getLogger(__name__)

_PICKLE = "a pickle, which can run code when it is loaded"
_PICKLE_ARCHIVE = "a PyTorch archive of pickles, which can run code when it is loaded"
# What ComfyUI lists besides safetensors (its supported_pt_extensions), with the reason it is never loaded.
# (ComfyUI-GGUF's .gguf transformers load through ParallelModelFromComfyFiles: gguf_files.)
REFUSED_SUFFIXES = {
    ".ckpt": _PICKLE,
    ".pt": _PICKLE,
    ".pth": _PICKLE,
    ".bin": _PICKLE,
    ".pkl": _PICKLE,
    ".pt2": _PICKLE_ARCHIVE,
}
# What a loras folder lists besides LoRAs: the pickles (LoRA files are refused by ``families.lora.check_file``).
PICKLE_SUFFIXES = tuple(suffix for suffix, why in REFUSED_SUFFIXES.items() if why in (_PICKLE, _PICKLE_ARCHIVE))
_WEIGHTS = (".safetensors", ".sft", GGUF_SUFFIX, *REFUSED_SUFFIXES)  # files that make a folder look like a model
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


PARTIAL = ".partial-"  # a conversion's folder while it is written: <name>.partial-<host>-<pid> (``comfy_files``)


def is_partial(name: str) -> bool:
    """Whether a folder (its name or path) is a conversion being written, or one whose writer was killed: never a
    model, never listed."""
    return PARTIAL in os.path.basename(name.rstrip("/"))


def _warn_once(path: str, why: str) -> None:
    if path not in _warned:
        _warned.add(path)
        log.warning("parallel_diffusers: skipping %s: %s", path, why)


def model_index(model_dir: str) -> dict | None:
    """model_index.json's contents, or None when the folder holds no readable diffusers pipeline (no JSON object with
    a ``_class_name`` string; logged once)."""
    index = os.path.join(model_dir, "model_index.json")
    try:
        with open(index) as f:
            data = json.load(f)
    except OSError:
        return None
    except (ValueError, RecursionError) as e:
        _warn_once(index, f"not valid JSON ({type(e).__name__})")
        return None
    if not isinstance(data, dict) or not isinstance(data.get("_class_name"), str):
        _warn_once(index, "no _class_name string in it")
        return None
    return data


def pipeline_class(model_dir: str) -> str | None:
    """model_index.json's _class_name, or None when the folder holds no readable diffusers pipeline (logged once)."""
    index = model_index(model_dir)
    return None if index is None else index["_class_name"]


def family_of(model_dir: str) -> families.FamilyAdapter | None:
    """The family of the pipeline in ``model_dir`` (its class and, for a variant of another family's class, its
    model_index.json's flags: ``families.for_pipeline``), or None."""
    index = model_index(model_dir)
    return None if index is None else families.for_pipeline(index["_class_name"], index)


def _model_folders(root: str) -> Iterator[tuple[str, str, bool]]:
    """Folders below ``root`` that hold a model_index.json (True), or weights or a ``transformer/`` folder without one
    (False: what a user put there as a model, which is no diffusers pipeline), as (name, path, has the index).
    Symbolic links are followed, except one that leads back to a folder it sits in (a loop); the depth limit bounds
    the rest; hidden folders and a conversion's partial folders are not models."""
    for here, dirs, files in os.walk(root, followlinks=True):
        depth = 0 if here == root else os.path.relpath(here, root).count(os.sep) + 1
        indexed, components = "model_index.json" in files, "transformer" in dirs
        if indexed or (depth > 0 and (components or any(f.endswith(_WEIGHTS) for f in files))):
            yield os.path.relpath(here, root).replace(os.sep, "/"), here, indexed
        if indexed or components:
            dirs[:] = []  # a pipeline's components are not pipelines of their own
            continue
        real = os.path.realpath(here)
        dirs[:] = (
            []
            if depth >= MAX_DEPTH
            else sorted(
                d
                for d in dirs
                if not d.startswith(".")
                and not is_partial(d)
                and not (real + os.sep).startswith(os.path.realpath(os.path.join(here, d)) + os.sep)
            )
        )


# Why a folder a user put among the models is not one (the node's tooltip and the refusal say it).
NO_INDEX = (
    "has no model_index.json, so it is not a diffusers pipeline folder (save_pretrained writes one, with a folder "
    "per component); a single .safetensors file goes in models/diffusion_models, for ParallelModelFromComfyFiles"
)


def list_models() -> list[str]:
    """Names of the supported pipelines found under the roots, sorted. One broken folder is skipped (with a warning
    naming it, and in ``skipped_models``), never a reason for the node list to fail."""
    names = set()
    for root in roots():
        for name, path, indexed in _model_folders(root):
            class_name = pipeline_class(path) if indexed else None
            if families.for_pipeline(class_name) is not None:
                names.add(name)
            elif class_name is not None:
                _warn_once(path, f"{class_name} is not a supported pipeline ({families.supported()})")
    return sorted(names)


def skipped_models() -> list[tuple[str, str]]:
    """The folders under the roots that are not listed, as (name, why), sorted: ComfyUI itself says only "Value not in
    list" of a model that is missing from the list, so the model widget's tooltip names them."""
    skipped = {}
    for root in roots():
        for name, path, indexed in _model_folders(root):
            if not indexed:
                skipped.setdefault(name, NO_INDEX)
                continue
            class_name = pipeline_class(path)
            if class_name is None:
                skipped.setdefault(name, "has a model_index.json without a readable _class_name")
            elif families.for_pipeline(class_name) is None:
                skipped.setdefault(name, f"is a {class_name}, not a supported pipeline ({families.supported()})")
    return sorted(skipped.items())


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
    if is_partial(relative):
        raise InvalidInput(
            widget, f"{name!r} is a conversion that was cut short (a partial folder), not a model; pick another model"
        )
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
        if any(os.path.isdir(os.path.join(root, relative)) for root in roots()):
            raise InvalidInput(widget, f"{name!r} {NO_INDEX}")
        where = ", ".join(roots()) or "no model folder is configured (set COMFY_PARALLEL_MODELS)"
        raise InvalidInput(widget, f"unknown model {name!r}; models are diffusers folders in: {where}")
    class_name = pipeline_class(model_dir)
    adapter = family_of(model_dir)
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
        if component == "transformer" and gguf_weights(sub) is not None:
            continue  # ComfyUI-GGUF's transformer, linked by a conversion (gguf_files)
        if any(f.endswith(GGUF_SUFFIX) for f in files) and not any(f.endswith(".safetensors") for f in files):
            raise InvalidInput(
                widget,
                f"{name}/{component} holds GGUF weights, which load only as the transformer of ComfyUI's files: put "
                "the .gguf file in models/diffusion_models and pick it in ParallelModelFromComfyFiles",
            )
        if "config.json" in files and not any(f.endswith(".safetensors") for f in files):
            expected = _weights_name(os.path.join(sub, "config.json"))
            raise InvalidInput(
                widget,
                f"{name}/{component}/ has a config.json but no weights: {expected} "
                "(or its shards and their .index.json) is expected beside it; copy the component's weights there, or "
                "save the pipeline again with save_pretrained",
            )
    return ModelRef(name=name, path=model_dir, family=adapter.key)


def refused_because(file_name: str) -> str | None:
    """Why a weights file named ``file_name`` is never loaded (``REFUSED_SUFFIXES``), or None."""
    return REFUSED_SUFFIXES.get(os.path.splitext(file_name)[1].lower())


def _weights_name(config_path: str) -> str:
    """The weights file a component's config.json goes with: diffusers' name, or transformers' for its models."""
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError):
        config = {}
    transformers = isinstance(config, dict) and "transformers_version" in config
    return "model.safetensors" if transformers else "diffusion_pytorch_model.safetensors"


def read_config(model: ModelRef, component: str) -> dict:
    with open(os.path.join(model.path, component, "config.json")) as f:
        return json.load(f)


def transformer_config(model: ModelRef, widget: str = "model") -> dict:
    """The transformer's config.json, checked against its weights (their safetensors headers and index only): each
    block count the family's ``block_lists`` names is the number of blocks the weights hold. Nothing is built from a
    config before this (a config that asks for 10,000 layers would cost minutes and gigabytes to build)."""
    config = read_config(model, "transformer")
    if not isinstance(config, dict):
        raise InvalidInput(widget, f"{model.name}/transformer/config.json is not a JSON object; save the model again")
    keys = _weight_keys(os.path.join(model.path, "transformer"), model.name, widget)
    for field, prefix in families.family(model.family).block_lists.items():
        if field not in config:
            continue
        held = len({key.split(".")[1] for key in keys if key.startswith(prefix + ".")})
        if config[field] != held:
            raise InvalidInput(
                widget,
                f"{model.name}/transformer/config.json says {field} = {config[field]!r}, but its weights hold {held} "
                f"{prefix}: the config belongs to another model or was edited; put the model's own config.json back, "
                "or save the model again with save_pretrained",
            )
    return config


def _weight_keys(folder: str, name: str, widget: str) -> set[str]:
    """The tensor names of a component's weights: its index's weight map, else its safetensors files' headers (a
    GGUF transformer's: the model's keys its moves make)."""
    if gguf_weights(folder) is not None:
        try:
            return moved_keys(folder)
        except (OSError, ValueError, TypeError) as e:
            raise InvalidInput(
                widget, f"{name}/transformer/ has GGUF moves that cannot be read ({e}); convert the files again"
            ) from None
    files = sorted(f for f in os.listdir(folder) if f.endswith((".safetensors", ".safetensors.index.json")))
    index = next((f for f in files if f.endswith(".index.json")), None)
    try:
        if index is not None:
            with open(os.path.join(folder, index)) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map")
            return set(weight_map)
        return {key for file in files for key in read_header(os.path.join(folder, file))[0]}
    except (OSError, ValueError, RecursionError, AttributeError) as e:
        raise InvalidInput(
            widget, f"{name}/transformer/ has weights that cannot be read ({e}); save the model again"
        ) from None


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
