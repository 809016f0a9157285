"""What a family's ComfyUI files are and what converting them writes: the interface each family's ``<name>_files.py``
implements (``FilesLayout``), and the plain data it answers with.

``comfy_files`` (the client) does everything that is the same for every family — reading and checking the files'
headers, fp8 and scaled-fp8 dequantization, the cache key and free-disk check, the ``.partial`` folder and its rename,
shards, progress and Cancel — and asks the family's layout only what differs: is this transformer yours (and which
variant), which text-encoder widgets do you take, and, from the headers' shapes, what does the diffusers folder hold
(``FilesContents``: model_index.json, the scheduler, the tokenizers to copy from ComfyUI's installation, and each
component with its config and how its weights are made). A layout reads no tensor; it raises ``InvalidInput`` naming
the widget and the fix when the files do not fit.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import ClassVar, Protocol

from ..errors import InvalidInput

Shapes = Mapping[str, tuple[int, ...]]

# The widgets a layout may take its text encoders from, in this order (the node's inputs).
TEXT_ENCODER_WIDGETS = ("text_encoder", "text_encoder_2")


class SourceHeader(Protocol):
    """A picked file as a layout sees it (``comfy_files.SourceFile``): the widget that picked it, its name, and each
    tensor's shape by key (the file's own prefix stripped)."""

    widget: str
    name: str
    shapes: Shapes


@dataclasses.dataclass(frozen=True)
class Move:
    """One diffusers tensor made from one source tensor.

    Args:
        target: the diffusers key.
        source: the source file's key (its prefix already stripped).
        rows: (start, stop) along dim 0, or None: the whole tensor.
        swap_halves: BFL's final AdaLN holds (shift, scale); diffusers' (scale, shift).
    """

    target: str
    source: str
    rows: tuple[int, int] | None = None
    swap_halves: bool = False


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A tokenizer folder copied from ComfyUI's installation (nothing is downloaded).

    Args:
        folder: the pipeline's component ("tokenizer").
        source: its folder below ComfyUI's ``comfy`` package ("sd1_tokenizer").
        files: the files copied.
        model_max_length: written into tokenizer_config.json (the length the pipeline pads and cuts to), or None to
            keep ComfyUI's.
        chat_template: written into tokenizer_config.json (the model's own, where ComfyUI's copy is another model's
            that shares its vocabulary), or None to keep ComfyUI's.
    """

    folder: str
    source: str
    files: tuple[str, ...]
    model_max_length: int | None = None
    chat_template: str | None = None


@dataclasses.dataclass(frozen=True)
class TokenizerFromFile:
    """A tokenizer folder made from data a picked file carries (FLUX.2's Mistral file holds its tekken vocabulary as a
    uint8 tensor): ``comfy_files`` reads that tensor's bytes and ``write`` makes the folder (nothing is downloaded).

    Args:
        folder: the pipeline's component ("tokenizer").
        file: the file holding the data.
        key: the tensor holding it (``file``'s stripped key).
        write: (the bytes, the folder to write) → None; ValueError when the bytes are not what it reads.
    """

    folder: str
    file: SourceHeader
    key: str
    write: Callable[[bytes, str], None]


@dataclasses.dataclass(frozen=True)
class FolderFromComfy:
    """A folder the family writes from ComfyUI's installation and the headers (nothing is downloaded): Qwen-Image-Edit's
    ``processor``, its tokenizer ComfyUI's and its image processor's values Qwen2.5-VL's.

    Args:
        folder: the pipeline's component ("processor").
        write: (ComfyUI's ``comfy`` package folder, the folder to write) → None.
    """

    folder: str
    write: Callable[[str, str], None]


@dataclasses.dataclass(frozen=True)
class Component:
    """One component of the diffusers folder and how its weights are made from one source file.

    Exactly one of ``moves``, ``convert`` or neither: ``moves`` streams the source one tensor at a time into
    diffusers' sharded layout (a transformer); ``convert`` takes the whole state dict (small models: a VAE); neither
    keeps the tensors in one ``model.safetensors``, a symbolic link to the source
    when nothing about them changes (a text encoder already in transformers' layout).

    Args:
        name: the folder ("transformer", "text_encoder", "vae").
        file: the source file.
        config: its config.json.
        moves: the diffusers tensors and their sources.
        convert: the source state dict (fp8 already dequantized) → diffusers' state dict.
        weights: the weights' file name (``convert``; ``moves`` writes diffusers' own name, shards and index).
        filled: tensors the folder's model has and the file has not, each (shape, value) filled with one value in
            the file's dtype (kept components only; FLUX.2's cut text encoder): beside a link, their own shard.
    """

    name: str
    file: SourceHeader
    config: dict
    moves: tuple[Move, ...] | None = None
    convert: Callable[[dict], dict] | None = None
    weights: str = "diffusion_pytorch_model.safetensors"
    filled: Mapping[str, tuple[tuple[int, ...], float]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.moves is not None and self.convert is not None:
            raise ValueError(f"{self.name}: give moves or convert, not both")
        if self.filled and (self.moves is not None or self.convert is not None):
            raise ValueError(f"{self.name}: filled tensors go with kept components only")


@dataclasses.dataclass(frozen=True)
class FilesContents:
    """What the diffusers folder holds, known from the headers alone.

    Args:
        variant: what the user has, for the node's text ("FLUX.1-dev").
        model_index: model_index.json.
        scheduler: scheduler/scheduler_config.json.
        tokenizers: copied from ComfyUI's installation.
        components: written in this order (progress follows it).
        text_encoders: the text-encoder files in the pipeline's order (whatever widget picked them).
        tokenizers_from_files: tokenizers made from data the picked files carry.
        folders: other folders the family writes (a processor).
        family: the adapter's key when it is not the layout's (Qwen-Image-Edit's files are Qwen-Image's layout).
    """

    variant: str
    model_index: dict
    scheduler: dict
    tokenizers: tuple[Tokenizer, ...]
    components: tuple[Component, ...]
    text_encoders: tuple[SourceHeader, ...]
    tokenizers_from_files: tuple[TokenizerFromFile, ...] = ()
    folders: tuple[FolderFromComfy, ...] = ()
    family: str | None = None


class FilesLayout(abc.ABC):
    """One family's ComfyUI files (implemented in ``families/<key>/files.py``, listed in ``families.FILES_LAYOUTS``).

    Declarations (class attributes):
        family: the ``FamilyAdapter`` key of the converted folder.
        name: the family's name for users.
        text_encoder_widgets: the widgets its text encoders come from (``TEXT_ENCODER_WIDGETS``, in order); the node's
            others must be left at "none".
        variants: the variants it converts, for the node's description ("FLUX.1 (dev and schnell)").
        transformer_layout: the keys its transformer file has, for the refusal of one that fits no family.
        gguf_architectures: the ``general.architecture`` values of its ComfyUI-GGUF transformers ("flux"): a GGUF file
            naming another family is refused.
        widget_files: per widget it takes (in the node's order), what the user picks there, for the node's tooltips
            and messages ("CLIP-L (clip_l.safetensors)"; the first file named is the example). A layout that names
            ``diffusion_model_2`` takes a second transformer there (Wan 2.2 A14B's low-noise expert), one that names
            ``clip_vision`` an image encoder (Wan 2.1 I2V's CLIP ViT-H).
    """

    family: ClassVar[str]
    name: ClassVar[str]
    text_encoder_widgets: ClassVar[tuple[str, ...]]
    variants: ClassVar[str]
    transformer_layout: ClassVar[str]
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    widget_files: ClassVar[Mapping[str, str]]

    @property
    def example_files(self) -> str:
        """A file a user picks for each widget, for the node's messages ("flux1-dev.safetensors, clip_l...")."""
        return ", ".join(re.search(r"[\w.-]+\.safetensors", files)[0] for files in self.widget_files.values())

    @abc.abstractmethod
    def variant(self, shapes: Shapes) -> str | None:
        """The variant ("FLUX.1-dev") when ``shapes`` are this family's transformer, else None."""

    @abc.abstractmethod
    def contents(
        self,
        variant: str,
        transformer: SourceHeader,
        text_encoders: list[SourceHeader],
        vae: SourceHeader,
        transformer_2: SourceHeader | None = None,
        clip_vision: SourceHeader | None = None,
    ) -> FilesContents:
        """The folder's contents from the headers (``text_encoders`` in ``text_encoder_widgets``' order), after checking
        that the files are this family's and fit together; ``InvalidInput`` naming the widget and the fix otherwise.
        ``transformer_2`` (``diffusion_model_2``'s file) and ``clip_vision`` (an image encoder's) are given only to a
        layout whose ``widget_files`` name their widgets."""


def count(shapes: Shapes, pattern: str) -> int:
    """How many numbered blocks ``pattern`` (with one ``(\\d+)`` group) finds in ``shapes``' keys."""
    found = {int(m.group(1)) for key in shapes if (m := re.match(pattern, key))}
    return max(found) + 1 if found else 0


def configs_from_shapes(
    derivations: Iterable[tuple[str, SourceHeader, Callable[[Shapes], dict]]], model: str
) -> dict[str, dict]:
    """Each component's config, derived from its file's shapes. A file that lacks a tensor the config is read from, or
    whose tensor has the wrong shape, is refused naming its widget: cut short, or not ``model``'s ("FLUX.1")."""
    configs = {}
    for component, file, derive in derivations:
        try:
            configs[component] = derive(file.shapes)
        except (KeyError, IndexError, ValueError) as e:
            what = f"has {e}" if isinstance(e, ValueError) else f"lacks {e}"
            raise InvalidInput(
                file.widget, f"{file.name!r} {what} (cut short, or not {model}'s); pick {model}'s complete file"
            ) from None
    return configs


def group_moves(moves: tuple[Move, ...] | list[Move]) -> dict[str, list[Move]]:
    """The moves by source key, in the order the sources are first needed."""
    by_source: dict[str, list[Move]] = {}
    for move in moves:
        by_source.setdefault(move.source, []).append(move)
    return by_source


def apply_moves(
    by_source: dict[str, list[Move]],
    tensors: Iterator[tuple[str, object]],
    steps: Callable[[str], None] | None = None,
) -> Iterator[tuple[str, object]]:
    """The diffusers tensors made from each (source key, tensor), in turn: a source tensor is let go once its moves
    are made."""
    import torch

    for source, tensor in tensors:
        # fp8 rows are moved as bytes (cat of float8 is not implemented everywhere), which is exact.
        fp8 = tensor.dtype if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else None
        rows = tensor.view(torch.uint8) if fp8 is not None else tensor
        for move in by_source[source]:
            part = rows if move.rows is None else rows[move.rows[0] : move.rows[1]].clone()
            if move.swap_halves:
                shift, scale = part.chunk(2, dim=0)
                part = torch.cat([scale, shift], dim=0)
            part = part.contiguous()
            yield move.target, part.view(fp8) if fp8 is not None else part
        if steps is not None:
            steps("converting transformer")
