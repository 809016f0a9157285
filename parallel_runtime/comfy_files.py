"""ComfyUI's own model files (``models/diffusion_models``, ``text_encoders``, ``vae``) as a diffusers pipeline folder.

A one-time conversion, cached: the family's files are checked from their safetensors headers (no tensor read), the
family is told by the transformer's keys, and a diffusers ``save_pretrained`` folder is written once under the
conversion root (``converted_root``), named by the files' identities (path, size, modification time), so picking the
same files again reuses it and a file replaced on disk makes a new one. The folder is then an ordinary model folder:
every strategy loads it exactly as it loads any other (tensor parallel through diffusers' ``parallel_config``, which
reads each rank's slices; bench/comfy_files_memory.py measures what a rank holds at its peak).

What differs between families is the family's ``FilesLayout`` (``families/files.py``; each family's in its folder's
``files.py``, all listed in ``families.FILES_LAYOUTS``): it recognises its transformer, names the
text-encoder widgets it takes (a family with one leaves ``text_encoder_2`` at "none") and describes the folder from the
headers' shapes (``FilesContents``). What is the same for all is here:

- a transformer is moved one source tensor at a time (the layout's ``Move`` list) into shards of at most
  ``SHARD_BYTES``, so the conversion never holds more than a shard in memory;
- a component kept as it is (a text encoder already in transformers' layout) is a symbolic link to the file beside its
  config, nothing copied — rewritten, streamed into shards, only when fp8 weights have to be cast (a text encoder's),
  scales renamed or a prefix dropped;
- a small component (a VAE) goes through the layout's converter (diffusers' own, e.g. ``convert_ldm_vae_checkpoint``);
- the tokenizers are copied from the ComfyUI installation (FLUX.1: ``comfy/sd1_tokenizer``, ``comfy/text_encoders/
  t5_tokenizer``), the scheduler and ``model_index.json`` are the layout's data. Nothing comes from the internet.

Weights as ComfyUI distributes them: bf16 / fp16 / fp32 are kept. A transformer's fp8 (``float8_e4m3fn`` /
``float8_e5m2``) weights stay fp8 in the folder, and ComfyUI's scaled fp8 (``scale_weight`` beside the weight, or
``weight_scale`` with ``_quantization_metadata``) keeps its scales beside them as float32 tensors under diffusers'
names (``<layer>.weight_scale``, ``wire.FP8_SCALE_SUFFIX``, moved with their weights' rows): the folder is no larger
than the file, and the ranks hold the weights in fp8 or dequantize them as LoadShardedTransformer's ``weights`` says
(``worker/fp8_weights.py``). A text encoder's fp8 weights stay fp8 the same way (their scales beside them): the
ranks hold its Linear layers in fp8 (``worker/stages.py``, always: it runs once per prompt) and transformers' load
casts the rest up. A plain-fp8 transformer or text encoder already in its library's keys is linked, not copied. A GGUF
transformer (ComfyUI-GGUF's) is linked as it is, its moves beside it, and stays packed on the ranks (``gguf_files``).
NF4 (bitsandbytes), nunchaku (SVDQuant),
GPTQ / AWQ and other integer formats are refused by name.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator

from .errors import Cancelled, InvalidInput
from .families import FILES_LAYOUTS, FilesLayout, join_words
from .families.files import (
    TEXT_ENCODER_WIDGETS,
    Component,
    FilesContents,
    Move,
    Tokenizer,
    TokenizerFromFile,
    apply_moves,
    group_moves,
)
from .families.lora import SAFETENSORS_SUFFIXES
from .gguf_files import GGUF_SUFFIX, GGUF_WEIGHTS, ReshapedTensors, computable_types, read_gguf, write_moves
from .headers import read_header
from .model_folders import (
    PARTIAL,
    REFUSED_SUFFIXES,
    comfyui_folders,
    confined,
    converted_root,
    is_partial,
    refused_because,
)
from .processes import process_alive
from .wire import FLOAT8_DTYPES, FP8_SCALE_SUFFIX

log = logging.getLogger(__name__)

# What a widget lists, per role: ComfyUI's folder names (new name first, its legacy alias second).
FOLDERS = {
    "diffusion_model": ("diffusion_models", "unet"),
    "text_encoder": ("text_encoders", "clip"),
    "text_encoder_2": ("text_encoders", "clip"),
    "vae": ("vae",),
    "diffusion_model_2": ("diffusion_models", "unet"),
    "clip_vision": ("clip_vision",),
}
USE_INSTEAD = "use the bf16 / fp16 file, or an fp8 one (plain or ComfyUI's scaled fp8), or a diffusers folder"
SHARD_BYTES = 2 << 30  # the converted transformer's shards: what the conversion holds in memory at most
CONVERSION_VERSION = 4  # part of every cache key: a change of what the conversion writes makes new folders
_FLOATS = ("F32", "F16", "BF16", *FLOAT8_DTYPES)
# Every dtype safetensors 0.8 writes, by its bits per element.
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F64": 8}
_STRIP_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "first_stage_model.", "vae.")
# Tokenizer data ComfyUI keeps inside a text encoder file (uint8 tensors): read by a family's tokenizer, never weights.
# (Integer tensors a format check lets through besides: ComfyUI's ``comfy_quant`` records, BatchNorm's step count, and
# the position index older transformers saved in a CLIP vision file, ``embeddings.position_ids``, which loaders skip.)
_TOKENIZER_DATA = ("tekken_model", "spiece_model")
_TEXT_PREFIXES = ("cond_stage_model.transformer.", "transformer.", "te.", "text_encoders.t5xxl.transformer.")


# -- where the files are -----------------------------------------------------------------------------------------
def _roots(role: str) -> list[str]:
    """ComfyUI's folders for ``role`` (once ComfyUI has loaded ``folder_paths``), then the same sub-folders of each
    directory in ``COMFY_PARALLEL_COMFY_MODELS`` (ComfyUI-style ``models`` directories, os.pathsep-separated)."""
    found = [p for kind in FOLDERS[role] for p in comfyui_folders(kind, "COMFY_PARALLEL_COMFY_MODELS", kind_below=True)]
    return [p for p in dict.fromkeys(found) if os.path.isdir(p)]


def list_files(role: str) -> list[str]:
    """The names (paths below their folder) a widget of ``role`` offers, sorted."""
    names = set()
    for root in _roots(role):
        for here, dirs, files in os.walk(root, followlinks=True):
            dirs.sort()
            for file in files:
                if file.lower().endswith((*SAFETENSORS_SUFFIXES, GGUF_SUFFIX, *REFUSED_SUFFIXES)):
                    names.add(os.path.relpath(os.path.join(here, file), root).replace(os.sep, "/"))
    return sorted(names)


def comfy_package_dir() -> str | None:
    """ComfyUI's ``comfy`` package directory (its tokenizers): the loaded one, else ``COMFYUI_DIR``'s."""
    comfy = sys.modules.get("comfy")
    candidates = [os.path.dirname(comfy.__file__)] if comfy is not None and getattr(comfy, "__file__", None) else []
    folder_paths = sys.modules.get("folder_paths")
    if folder_paths is not None and getattr(folder_paths, "base_path", None):
        candidates.append(os.path.join(folder_paths.base_path, "comfy"))
    if os.environ.get("COMFYUI_DIR"):
        candidates.append(os.path.join(os.environ["COMFYUI_DIR"], "comfy"))
    return next((c for c in candidates if os.path.isdir(os.path.join(c, "sd1_tokenizer"))), None)


# -- one file, read from its header ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SourceFile:
    """A file a widget picked, with what its safetensors header says.

    Args:
        widget: the input that picked it (errors name it).
        name: the widget's value.
        path: the resolved file.
        size: its size in bytes, and mtime_ns its modification time: with ``path``, its identity.
        dtypes: each tensor's safetensors dtype, by key (prefix stripped); shapes: each tensor's shape.
        keys: the file's own key of each stripped key.
        metadata: the header's ``__metadata__``.
    """

    widget: str
    name: str
    path: str
    size: int
    mtime_ns: int
    dtypes: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    keys: dict[str, str]
    metadata: dict[str, str]

    @property
    def identity(self) -> tuple[str, int, int]:
        return (os.path.realpath(self.path), self.size, self.mtime_ns)

    @property
    def is_gguf(self) -> bool:
        """A GGUF file (its ``dtypes`` are GGML type names, ``metadata`` its ``general.architecture``)."""
        return self.path.lower().endswith(GGUF_SUFFIX)

    @property
    def has_fp8(self) -> bool:
        return any(d in FLOAT8_DTYPES for d in self.dtypes.values())

    @property
    def scales(self) -> dict[str, str]:
        """ComfyUI's scaled fp8: the weight key → the key of its scale."""
        found = {}
        for key in self.dtypes:
            for suffix in (".scale_weight", ".weight_scale"):
                if key.endswith(suffix):
                    found[key[: -len(suffix)] + ".weight"] = key
        return found

    @property
    def stripped_prefix(self) -> bool:
        return any(k != v for k, v in self.keys.items())

    @property
    def weight_keys(self) -> list[str]:
        """The keys of the model's weights: the file's without ComfyUI's quantization bookkeeping and tokenizer data."""
        return [k for k in self.shapes if not _skipped(self, k)]

    def high_precision_dtype(self) -> str:
        """What fp8 weights become: the dtype most of the file's other floating tensors have (bf16 if none)."""
        scales = set(self.scales.values())
        counts: dict[str, int] = {}
        for key, dtype in self.dtypes.items():
            if dtype in ("F32", "F16", "BF16") and key not in scales:
                counts[dtype] = counts.get(dtype, 0) + 1
        return max(counts, key=counts.get) if counts else "BF16"


def resolve(role: str, name: str, widget: str) -> str:
    """The path of file ``name`` of ``role`` (confined to its folders); InvalidInput naming ``widget`` otherwise."""
    if not name:
        raise InvalidInput(widget, f"no file selected; put the file in models/{FOLDERS[role][0]} and pick it here")
    relative = confined(name, widget, "a file name; pick one from the list")
    for root in _roots(role):
        path = os.path.join(root, relative)
        if os.path.isfile(path):
            return path
    where = ", ".join(_roots(role)) or f"no models/{FOLDERS[role][0]} folder is configured"
    raise InvalidInput(widget, f"unknown file {name!r}; the files are in: {where}")


def _strip(key: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def read_file(role: str, name: str, widget: str) -> SourceFile:
    """``name`` resolved and its header read and checked: safetensors, in a format the conversion takes."""
    path = resolve(role, name, widget)
    if name.lower().endswith(GGUF_SUFFIX):
        return _read_gguf_file(role, name, widget, path)
    refused = refused_because(name)
    if refused is not None:
        raise InvalidInput(widget, f"{name!r} is {refused}; only safetensors are loaded: {USE_INSTEAD}")
    try:
        header, metadata = read_header(path)
    except OSError as e:
        raise InvalidInput(widget, f"{name!r} cannot be read ({e.strerror}); check the file") from None
    except ValueError as e:
        raise InvalidInput(
            widget, f"{name!r} is not a readable safetensors file ({e}); download it again, or pick another file"
        ) from None
    prefixes = _STRIP_PREFIXES + (_TEXT_PREFIXES if role.startswith("text_encoder") else ())
    keys = {_strip(k, prefixes): k for k in header}
    stat = os.stat(path)
    file = SourceFile(
        widget=widget,
        name=name,
        path=path,
        size=stat.st_size,
        mtime_ns=stat.st_mtime_ns,
        dtypes={k: header[v][0] for k, v in keys.items()},
        shapes={k: header[v][1] for k, v in keys.items()},
        keys=keys,
        metadata=metadata,
    )
    _check_format(file)
    return file


def _read_gguf_file(role: str, name: str, widget: str, path: str) -> SourceFile:
    """A GGUF transformer's header, checked: readable, whole, every tensor of a type diffusers computes."""
    if role != "diffusion_model":
        raise InvalidInput(
            widget,
            f"{name!r} is a GGUF file; only the diffusion model may be GGUF here (ComfyUI-GGUF's transformers): "
            "pick the text encoder's / VAE's safetensors file",
        )
    try:
        header = read_gguf(path)
    except OSError as e:
        raise InvalidInput(widget, f"{name!r} cannot be read ({e.strerror}); check the file") from None
    except ReshapedTensors as e:
        raise InvalidInput(widget, f"{name!r} is a GGUF file this pack does not load: {e}") from None
    except ValueError as e:
        raise InvalidInput(widget, f"{name!r} is not a GGUF file this pack reads: {e}; download it again") from None
    unknown = sorted(set(header.types.values()) - computable_types())
    if unknown:
        raise InvalidInput(
            widget,
            f"{name!r} holds {', '.join(unknown)} tensors, which diffusers' GGUF path cannot compute; pick a "
            "Q8_0, Q6_K, Q5_K, Q4_K or Q4_0 file (or the bf16 / fp8 safetensors)",
        )
    keys = {_strip(k, _STRIP_PREFIXES): k for k in header.types}
    stat = os.stat(path)
    return SourceFile(
        widget=widget,
        name=name,
        path=path,
        size=stat.st_size,
        mtime_ns=stat.st_mtime_ns,
        dtypes={k: header.types[v] for k, v in keys.items()},
        shapes={k: header.shapes[v] for k, v in keys.items()},
        keys=keys,
        metadata={"general.architecture": header.architecture or ""},
    )


def _check_format(file: SourceFile) -> None:
    """Refuse quantizations the conversion cannot undo, by name, with what to use instead."""
    keys = file.dtypes
    for marker, what in (
        ((".absmax", ".quant_map", "quant_state.bitsandbytes"), "NF4 / FP4 (bitsandbytes)"),
        ((".qweight", ".wscales", ".smooth_factor", ".wtscale"), "nunchaku (SVDQuant, int4)"),
        ((".qzeros", ".g_idx", ".weight_packed"), "GPTQ / AWQ (int4)"),
    ):
        if any(any(m in k for m in marker) for k in keys):
            raise InvalidInput(
                file.widget, f"{file.name!r} is quantized as {what}, which is not supported; {USE_INSTEAD}"
            )
    meta = file.metadata.get("_quantization_metadata")
    if meta:
        try:
            layers = json.loads(meta).get("layers", {})
            formats = {str(v.get("format")) for v in layers.values()}
        except (ValueError, AttributeError, RecursionError):
            formats = {"unreadable"}
        unknown = sorted(formats - {"float8_e4m3fn", "float8_e5m2"})
        if unknown:
            raise InvalidInput(
                file.widget,
                f"{file.name!r} is quantized as {', '.join(unknown)}, which is not supported; {USE_INSTEAD}",
            )
    odd = sorted(
        {
            d
            for k, d in keys.items()
            if d not in _FLOATS
            and not k.endswith(("comfy_quant", "num_batches_tracked", "position_ids"))
            and k not in _TOKENIZER_DATA
        }
    )
    if odd:
        raise InvalidInput(
            file.widget,
            f"{file.name!r} holds {', '.join(odd)} tensors (an integer quantization), which is not supported; "
            f"{USE_INSTEAD}",
        )


# -- a family's files, planned -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FilesPlan:
    """What the conversion will write, known from the headers alone.

    Args:
        family: the family adapter's key; variant: what the user has ("FLUX.1-dev", "FLUX.1-schnell", "Qwen-Image").
        transformer, text_encoders, vae: the files (text_encoders in the pipeline's order).
        transformer_2: a second transformer (Wan 2.2 A14B's low-noise expert), or None.
        name: the model name the nodes take (the folder's name below ``converted_root``); folder: its path.
        configs: each component's config.
        write_bytes: what the conversion writes to disk (links cost nothing).
        contents: the family layout's description of the folder (``families.files.FilesContents``).
    """

    family: str
    variant: str
    transformer: SourceFile
    text_encoders: tuple[SourceFile, ...]
    vae: SourceFile
    name: str
    folder: str
    configs: dict[str, dict]
    write_bytes: int
    contents: FilesContents
    transformer_2: SourceFile | None = None

    @property
    def converted(self) -> bool:
        return os.path.isfile(os.path.join(self.folder, "model_index.json"))


# The value of a widget its family does not use (ComfyUI's combos need a value).
NO_FILE = "none"
# The widgets a family may leave at NO_FILE: a second text encoder, a second transformer (Wan 2.2 A14B's two experts),
# an image encoder (Wan 2.1 I2V's CLIP vision file).
OPTIONAL_WIDGETS = ("text_encoder_2", "diffusion_model_2", "clip_vision")
# ParallelModelFromComfyFiles' file widgets, in ``plan_files``' order (``comfy-parallel advise`` takes the same).
WIDGETS = ("diffusion_model", "text_encoder", "text_encoder_2", "vae", "diffusion_model_2", "clip_vision")


def widget_options(widget: str) -> list[str]:
    """What a widget's combo offers: its folder's files, and for the optional widgets first "none" (families with one
    text encoder or one transformer leave them there)."""
    files = list_files(widget)
    return [NO_FILE, *files] if widget in OPTIONAL_WIDGETS else files


def _layout_of(transformer: SourceFile) -> tuple[FilesLayout, str]:
    shapes = transformer.shapes
    for layout in FILES_LAYOUTS:
        variant = layout.variant(shapes)
        if variant is not None:
            if transformer.is_gguf:
                _check_architecture(transformer, layout)
            return layout, variant
    if transformer.is_gguf:
        _check_architecture(transformer, None)
    examples = " or ".join(layout.example_files.split(", ")[0] for layout in FILES_LAYOUTS)
    by_layout: dict[str, list[str]] = {}
    for layout in FILES_LAYOUTS:
        by_layout.setdefault(layout.transformer_layout, []).append(layout.name)
    recognised = ", ".join(f"{join_words(names, 'or')} {keys}" for keys, names in by_layout.items())
    if any(
        k.startswith(("encoder.", "decoder.", "text_model.", "shared.", "model.layers.", "visual.")) for k in shapes
    ):
        raise InvalidInput(
            transformer.widget,
            f"{transformer.name!r} is a VAE or a text encoder, not a diffusion model; pick the transformer file "
            f"(e.g. {examples}) here",
        )
    raise InvalidInput(
        transformer.widget,
        f"{transformer.name!r} is not a transformer this pack recognises ({recognised}); pick {examples} from "
        "models/diffusion_models, or use a diffusers folder",
    )


def _check_architecture(transformer: SourceFile, layout: FilesLayout | None) -> None:
    """A GGUF file names its family (``general.architecture``, ComfyUI-GGUF's "flux", "qwen_image"): one of another
    family, or one whose name and tensors disagree, is refused by name."""
    arch = transformer.metadata.get("general.architecture") or None
    families = [(a, other.name) for other in FILES_LAYOUTS for a in other.gguf_architectures]
    loads = join_words(list(dict.fromkeys(name for _, name in families)), "or")
    if arch is not None and arch not in dict(families):
        raise InvalidInput(
            transformer.widget,
            f"{transformer.name!r} is a GGUF of {arch!r} (its general.architecture), a family this pack does not run; "
            f"pick a GGUF of {loads}",
        )
    if layout is not None and arch is not None and arch not in layout.gguf_architectures:
        raise InvalidInput(
            transformer.widget,
            f"{transformer.name!r} says it is a GGUF of {arch!r} (its general.architecture) but holds {layout.name}'s "
            "tensors; the file was written wrongly: download it again, or pick another file",
        )


def _tensor_bytes(file: SourceFile, key: str, out_dtype: str | None = None) -> int:
    n = 1
    for d in file.shapes[key]:
        n *= d
    return n * _DTYPE_BYTES.get(out_dtype or file.dtypes[key], 4)


def _out_dtype(file: SourceFile, key: str, keep_fp8: bool) -> str:
    return file.high_precision_dtype() if file.dtypes[key] in FLOAT8_DTYPES and not keep_fp8 else file.dtypes[key]


def _keeps_fp8(component: Component) -> bool:
    """The transformers' (Wan 2.2's second expert too) and the text encoders' fp8 weights stay fp8 (the ranks hold them
    so: the fp8 reader takes the expert's subfolder)."""
    return component.name.startswith(("transformer", "text_encoder"))


def _needs_rewrite(component: Component) -> bool:
    """A kept component is linked unless its tensors change: fp8 to cast, scales to rename, or a prefix to drop."""
    file = component.file
    return bool((file.has_fp8 and not _keeps_fp8(component)) or file.scales or file.stripped_prefix)


def _write_bytes(component: Component) -> int:
    file = component.file
    if file.is_gguf:
        return 0  # a link and its moves
    if component.convert is not None:
        return file.size
    filled = sum(_filled_bytes(file, shape) for shape, _ in component.filled.values())
    if component.moves is None and not _needs_rewrite(component):
        return filled  # a link, and the filled tensors beside it
    keep = _keeps_fp8(component)
    return filled + sum(_tensor_bytes(file, k, _out_dtype(file, k, keep)) for k in file.shapes)


def _filled_bytes(file: SourceFile, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * _DTYPE_BYTES[file.high_precision_dtype()]


def _text_encoders(layout: FilesLayout, picked: dict[str, str]) -> list[SourceFile]:
    """The text-encoder files ``layout`` takes, read; a widget it does not take must be left at "none"."""
    files = []
    for widget in TEXT_ENCODER_WIDGETS:
        value = picked[widget]
        empty = value in ("", NO_FILE)
        if widget in layout.text_encoder_widgets:
            if empty:
                n = len(layout.text_encoder_widgets)
                raise InvalidInput(
                    widget,
                    f"{layout.name} takes {n} text encoder{'s' if n > 1 else ''} (its files: "
                    f"{layout.example_files}); pick one from models/text_encoders here",
                )
            files.append(read_file(widget, value, widget))
        elif not empty:
            raise InvalidInput(
                widget,
                f"{layout.name} takes one text encoder, in {layout.text_encoder_widgets[0]}; set {widget} to {NO_FILE}",
            )
    return files


# What a layout that does not take an optional file widget tells the user to do instead.
_NOT_TAKEN = {
    "diffusion_model_2": "takes one transformer, in diffusion_model",
    "clip_vision": "reads no CLIP vision file (Wan 2.1 I2V does)",
}


def _optional_file(layout: FilesLayout, widget: str, value: str) -> SourceFile | None:
    """An optional widget's file (``diffusion_model_2``, ``clip_vision``), read, for a layout that takes one; a layout
    that does not takes "none"."""
    if value in ("", NO_FILE):
        return None
    if widget not in layout.widget_files:
        raise InvalidInput(widget, f"{layout.name} {_NOT_TAKEN[widget]}; set {widget} to none")
    return read_file(widget, value, widget)


def plan_files(
    diffusion_model: str,
    text_encoder: str,
    text_encoder_2: str,
    vae: str,
    diffusion_model_2: str = NO_FILE,
    clip_vision: str = NO_FILE,
) -> FilesPlan:
    """The widgets' files read (headers only) and checked, the family told by the transformer's keys (its
    ``FilesLayout`` says what the folder holds), and the cache folder named. Raises InvalidInput naming the widget and
    the fix."""
    transformer = read_file("diffusion_model", diffusion_model, "diffusion_model")
    layout, variant = _layout_of(transformer)
    encoders = _text_encoders(layout, {"text_encoder": text_encoder, "text_encoder_2": text_encoder_2})
    vae_file = read_file("vae", vae, "vae")
    transformer_2 = _optional_file(layout, "diffusion_model_2", diffusion_model_2)
    image_encoder = _optional_file(layout, "clip_vision", clip_vision)
    # A layout is given only the optional files its widgets name (the layouts of one transformer never a second).
    optional = {"transformer_2": transformer_2, "clip_vision": image_encoder}
    contents = layout.contents(
        variant, transformer, encoders, vae_file, **{k: v for k, v in optional.items() if v is not None}
    )
    # The optional files are the last identities, so a folder converted before they existed keeps its name.
    files = (transformer, *contents.text_encoders, vae_file, *(f for f in optional.values() if f is not None))
    key = hashlib.sha256(json.dumps([CONVERSION_VERSION, [f.identity for f in files]]).encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(transformer.path))[0]
    name = f"{stem}-{key}"
    return FilesPlan(
        family=contents.family or layout.family,
        variant=contents.variant,
        transformer=transformer,
        text_encoders=contents.text_encoders,
        vae=vae_file,
        name=name,
        folder=os.path.join(converted_root(), name),
        configs={c.name: c.config for c in contents.components},
        write_bytes=sum(_write_bytes(c) for c in contents.components),
        contents=contents,
        transformer_2=transformer_2,
    )


# -- the conversion ----------------------------------------------------------------------------------------------
Progress = Callable[[int, int, "str | None"], None]


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):.1f} MiB"


def convert(
    plan: FilesPlan,
    *,
    on_progress: Progress | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> str:
    """Write ``plan``'s diffusers folder (once) and return its model name. The folder appears complete or not at all:
    it is written beside (``<name>.partial-<host>-<pid>``, its ``model_index.json`` last, so that it is no model
    folder until complete), then renamed; a failed or cancelled conversion leaves nothing behind, and one that was
    killed leaves a partial folder that the next conversion removes (``sweep_partials``) and nothing lists."""
    if plan.converted:
        return plan.name
    root = os.path.dirname(plan.folder)
    os.makedirs(root, exist_ok=True)
    sweep_partials(root)
    free = shutil.disk_usage(root).free
    need = plan.write_bytes + (256 << 20)
    if free < need:
        raise InvalidInput(
            "diffusion_model",
            f"converting {plan.transformer.name!r} writes {_gib(plan.write_bytes)} to {root}, which has "
            f"{_gib(free)} free; free some space, or set COMFY_PARALLEL_CONVERTED to a folder on a larger disk",
        )
    comfy_dir = comfy_package_dir()
    if comfy_dir is None and plan.contents.tokenizers:
        raise InvalidInput(
            "text_encoder",
            "the tokenizers come from the ComfyUI installation ("
            + ", ".join(f"comfy/{t.source}" for t in plan.contents.tokenizers)
            + "), which was not found; run inside ComfyUI or set COMFYUI_DIR",
        )
    log.info("parallel_diffusers: converting %s to %s (%s)", plan.transformer.name, plan.folder, _gib(plan.write_bytes))
    from safetensors import SafetensorError

    partial = f"{plan.folder}{PARTIAL}{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        _write_folder(plan.contents, partial, comfy_dir, on_progress, should_cancel)
        os.rename(partial, plan.folder)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(partial, ignore_errors=True)
        if plan.converted:  # another process finished the same conversion first
            return plan.name
        if getattr(e, "errno", None) == errno.ENOSPC or "os error 28" in str(e):
            raise InvalidInput(
                "diffusion_model",
                f"the disk of {root} filled up while converting {plan.transformer.name!r}, which writes "
                f"{_gib(plan.write_bytes)} there ({_gib(free)} were free when it started; nothing was kept); free "
                "some space, or set COMFY_PARALLEL_CONVERTED to a folder on a larger disk",
            ) from None
        raise InvalidInput("diffusion_model", f"could not write the converted model to {root}: {e}") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return plan.name


def sweep_partials(root: str) -> list[str]:
    """Remove the folders in ``root`` that a conversion on this machine was writing when it was killed (its process is
    gone); returns their paths. A conversion that runs, or one of another machine sharing the folder, is left alone."""
    swept = []
    host = socket.gethostname()
    try:
        names = os.listdir(root)
    except OSError:
        return swept
    for name in names:
        writer_host, _, pid = name.rpartition(PARTIAL)[2].rpartition("-")
        if is_partial(name) and writer_host == host and pid.isdigit() and not process_alive(int(pid)):
            path = os.path.join(root, name)
            log.warning("parallel_diffusers: removing %s, left by a conversion that was killed", path)
            shutil.rmtree(path, ignore_errors=True)
            swept.append(path)
    return swept


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


class _Steps:
    """Progress over the whole conversion, and the user's Cancel between tensors."""

    def __init__(self, total: int, on_progress: Progress | None, should_cancel: Callable[[], bool] | None):
        self.done, self.total = 0, total
        self.on_progress, self.should_cancel = on_progress, should_cancel

    def __call__(self, text: str, n: int = 1) -> None:
        if self.should_cancel is not None and self.should_cancel():
            raise Cancelled("conversion cancelled by the user (nothing was kept)", steps_by_rank=[])
        self.done = min(self.total, self.done + n)
        if self.on_progress is not None:
            self.on_progress(self.done, self.total, text)


def _write_folder(
    contents: FilesContents,
    out: str,
    comfy_dir: str,
    on_progress: Progress | None,
    should_cancel: Callable[[], bool] | None,
) -> None:
    """The family layout's folder: scheduler and tokenizers, each component in turn, and model_index.json last (what
    makes a folder a model: a folder cut short by a kill has none)."""
    steps = _Steps(sum(_units(c) for c in contents.components) + 1, on_progress, should_cancel)
    _write_json(os.path.join(out, "scheduler", "scheduler_config.json"), contents.scheduler)
    for tokenizer in contents.tokenizers:
        _write_tokenizer(out, comfy_dir, tokenizer)
    for made in contents.tokenizers_from_files:
        _write_tokenizer_from_file(out, made)
    for made in contents.folders:
        made.write(comfy_dir, os.path.join(out, made.folder))
    for component in contents.components:
        folder = os.path.join(out, component.name)
        _write_json(os.path.join(folder, "config.json"), component.config)
        if component.file.is_gguf:
            _write_gguf(component, folder)
            steps(f"linking {component.name}")
            continue
        if component.moves is not None:
            _write_moved(component, folder, steps)
            continue
        if component.convert is not None:
            _write_converted(component, folder)
            steps(f"converting {component.name}")
        else:
            _write_whole(component, folder, steps)
    _write_json(os.path.join(out, "model_index.json"), contents.model_index)
    steps("converted")


def _write_tokenizer_from_file(out: str, made: TokenizerFromFile) -> None:
    """A tokenizer folder the family makes from the bytes of a tensor its file carries."""
    from safetensors import safe_open

    file = made.file
    with safe_open(file.path, framework="pt") as f:
        data = f.get_tensor(file.keys[made.key]).numpy().tobytes()
    try:
        made.write(data, os.path.join(out, made.folder))
    except (ValueError, KeyError) as e:
        raise InvalidInput(
            file.widget,
            f"{file.name!r} carries no readable tokenizer in {made.key!r} ({e}); pick the file as ComfyUI "
            "distributes it",
        ) from None


def _write_tokenizer(out: str, comfy_dir: str, tokenizer: Tokenizer) -> None:
    """A tokenizer folder from ComfyUI's copy, with the length and the chat template the pipeline reads from it."""
    src, dst = os.path.join(comfy_dir, *tokenizer.source.split("/")), os.path.join(out, tokenizer.folder)
    os.makedirs(dst, exist_ok=True)
    for file in tokenizer.files:
        shutil.copyfile(os.path.join(src, file), os.path.join(dst, file))
    settings = {"model_max_length": tokenizer.model_max_length, "chat_template": tokenizer.chat_template}
    settings = {name: value for name, value in settings.items() if value is not None}
    if settings:
        path = os.path.join(dst, "tokenizer_config.json")
        with open(path) as f:
            config = json.load(f)
        _write_json(path, config | settings)


def _tensors(file: SourceFile, keys: list[str], keep_fp8: bool = False) -> Iterator[tuple[str, object]]:
    """``keys`` (stripped) of ``file``, one at a time: fp8 as stored (``keep_fp8``), else dequantized or cast to the
    file's high-precision dtype."""
    import torch
    from safetensors import safe_open

    out_dtype = getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[file.high_precision_dtype()])
    scales = file.scales
    with safe_open(file.path, framework="pt") as f:
        for key in keys:
            tensor = f.get_tensor(file.keys[key])
            if key in scales and not keep_fp8:
                scale = f.get_tensor(file.keys[scales[key]]).to(torch.float32)
                if scale.ndim == 1 and tensor.ndim > 1 and scale.numel() == tensor.shape[0]:
                    scale = scale.reshape(-1, *([1] * (tensor.ndim - 1)))  # per output channel
                tensor = (tensor.to(torch.float32) * scale).to(out_dtype)
            elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and not keep_fp8:
                tensor = tensor.to(out_dtype)
            yield key, tensor


def _skipped(file: SourceFile, key: str) -> bool:
    """ComfyUI's quantization bookkeeping, tokenizer data, CLIP's position index and flags (an empty tensor named
    ``__like_this__``: Qwen-Image-Edit-2511's ``__index_timestep_zero__``), which diffusers models do not have as
    weights. A linked file keeps them, and every loader ignores a key its model has no place for."""
    return (
        key == "scaled_fp8"
        or (key.startswith("__") and key.endswith("__"))
        or key in _TOKENIZER_DATA
        or key.endswith(
            (".scale_weight", ".weight_scale", ".scale_input", ".input_scale", "comfy_quant", "position_ids")
        )
    )


def _units(component: Component) -> int:
    """The component's steps of progress: one per source tensor it streams, else one."""
    if component.file.is_gguf:
        return 1
    if component.moves is not None:
        return len(group_moves(component.moves)) + (len(component.file.scales) if _keeps_fp8(component) else 0)
    if component.convert is None and _needs_rewrite(component):
        return len(component.file.weight_keys)
    return 1


def _write_whole(component: Component, folder: str, steps: _Steps) -> None:
    """Tensors kept as they are (a text encoder in transformers' layout, a transformer in diffusers'): linked, or
    streamed one tensor at a time into shards when fp8 weights need casting or a prefix dropping; the component's filled
    tensors beside them (after a link, in a shard of their own, the link the first shard of the index)."""
    file = component.file
    os.makedirs(folder, exist_ok=True)
    if not _needs_rewrite(component) and not component.filled:
        os.symlink(os.path.realpath(file.path), os.path.join(folder, component.weights))
        steps(f"linking {component.name}")
        return
    shards = _Shards(folder, component.weights)
    if _needs_rewrite(component):
        keep = _keeps_fp8(component)
        for key, tensor in _tensors(file, file.weight_keys, keep_fp8=keep):
            shards.add(key, tensor)
            steps(f"converting {component.name}")
        if keep:
            sources = {key: [Move(source=key, target=key)] for key in file.scales if key in file.shapes}
            for key, scale in _moved_scales(file, sources):
                shards.add(key, scale)
    else:
        # Not prefix-stripped (else it would be rewritten): the file's keys are the folder's.
        sizes = {k: _tensor_bytes(file, k) for k in file.shapes if not _skipped(file, k)}
        shards.link(os.path.realpath(file.path), sizes)
        steps(f"linking {component.name}")
    import torch

    dtype = getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[file.high_precision_dtype()])
    for key, (shape, value) in component.filled.items():
        shards.add(key, torch.full(shape, value, dtype=dtype))
    shards.close()


def _write_gguf(component: Component, folder: str) -> None:
    """A GGUF transformer stays packed in its file (``gguf_files``): linked, with the moves that make its tensors the
    model's (a component kept whole moves each tensor to its own key), sources by the file's own keys."""
    file = component.file
    os.symlink(os.path.realpath(file.path), os.path.join(folder, GGUF_WEIGHTS))
    moves = component.moves if component.moves is not None else [Move(k, k) for k in file.weight_keys]
    write_moves((dataclasses.replace(m, source=file.keys[m.source]) for m in moves), folder)


def _write_moved(component: Component, out: str, steps: _Steps) -> None:
    """A transformer in diffusers' layout, streamed: one source tensor read at a time, written into shards of at most
    SHARD_BYTES as they fill (diffusers' sharded layout with its index)."""
    by_source = group_moves(component.moves)
    shards = _Shards(out, component.weights)
    keep = _keeps_fp8(component)
    for target, tensor in apply_moves(by_source, _tensors(component.file, list(by_source), keep_fp8=keep), steps):
        shards.add(target, tensor)
    if keep:
        for target, scale in _moved_scales(component.file, by_source):
            shards.add(target, scale)
            steps("converting transformer")
    shards.close()


def _moved_scales(file: SourceFile, by_source: dict[str, list[Move]]) -> Iterator[tuple[str, object]]:
    """The scales of the scaled-fp8 weights among ``by_source``'s, under their diffusers weights' names
    (``<layer>.weight_scale``, float32): a per-tensor scale for each weight made of its tensor, a per-row one moved
    with the rows."""
    import torch
    from safetensors import safe_open

    scales = file.scales
    with safe_open(file.path, framework="pt") as f:
        for source, moves in by_source.items():
            if source not in scales:
                continue
            scale = f.get_tensor(file.keys[scales[source]]).to(torch.float32)
            if scale.numel() == 1:
                for move in moves:
                    yield move.target + FP8_SCALE_SUFFIX, scale.reshape(()).clone()
                continue
            for target, part in apply_moves({source: moves}, iter([(source, scale.reshape(-1))])):
                yield target + FP8_SCALE_SUFFIX, part


class _Shards:
    """The sharded safetensors layout diffusers and transformers read (``weights``, or ``<stem>-0000N-of-0000M``
    files and their ``.index.json``), written as it fills: at most SHARD_BYTES held at a time."""

    def __init__(self, out: str, weights: str):
        self.out, self.weights = out, weights
        self.current: dict[str, object] = {}
        self.size = 0
        self.written: list[tuple[str, dict[str, int]]] = []  # (file, {key: bytes})

    def link(self, source: str, sizes: dict[str, int]) -> None:
        """A whole existing safetensors file as the next shard, linked (not copied): ``sizes`` (bytes by key) are the
        tensors the index maps to it."""
        if self.current:
            self._flush()
        file = f"shard-{len(self.written)}.safetensors"
        os.symlink(source, os.path.join(self.out, file))
        self.written.append((file, dict(sizes)))

    def add(self, key: str, tensor: object) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > SHARD_BYTES:
            self._flush()
        self.current[key] = tensor.contiguous()
        self.size += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        file = f"shard-{len(self.written)}.safetensors"
        save_file(self.current, os.path.join(self.out, file), metadata={"format": "pt"})
        self.written.append((file, {k: t.numel() * t.element_size() for k, t in self.current.items()}))
        self.current, self.size = {}, 0

    def close(self) -> None:
        if self.current or not self.written:
            self._flush()
        if len(self.written) == 1:
            os.rename(os.path.join(self.out, self.written[0][0]), os.path.join(self.out, self.weights))
            return
        stem = self.weights.removesuffix(".safetensors")
        weight_map, total = {}, 0
        for i, (file, keys) in enumerate(self.written):
            name = f"{stem}-{i + 1:05d}-of-{len(self.written):05d}.safetensors"
            os.rename(os.path.join(self.out, file), os.path.join(self.out, name))
            weight_map.update(dict.fromkeys(keys, name))
            total += sum(keys.values())
        _write_json(
            os.path.join(self.out, f"{self.weights}.index.json"),
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )


def _write_converted(component: Component, out: str) -> None:
    """A small model (a VAE) through its converter, the whole state dict at once."""
    from safetensors.torch import save_file

    file = component.file
    keys = [k for k in file.shapes if not _skipped(file, k)]
    converted = component.convert(dict(_tensors(file, keys)))
    save_file(
        {k: v.contiguous() for k, v in converted.items()},
        os.path.join(out, component.weights),
        metadata={"format": "pt"},
    )
