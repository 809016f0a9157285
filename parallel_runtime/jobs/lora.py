"""ParallelLoraLoader's step: check a LoRA file against the transformer it is chained to, then add it to the handle.

Nothing loads on the backend here: the LoRA becomes part of the transformer handle (``TransformerSpec.loras``) and the
ranks apply it when the sampler runs, to the transformer they already hold. The file is read here once per content
(path, size, modification time) and model, so validation, execution and the sampler's validation of one prompt read it
once, and a prompt that only changes a strength reads nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os

from .. import model_folders
from ..errors import InvalidInput
from ..families.lora import LoraError, check_file, read_lora
from ..wire import LoraRef
from .transformer import TransformerHandle
from .widgets import check_finite

MAX_STRENGTH = 10.0
_CACHE_SIZE = 64  # checked (file, model) pairs remembered; each entry is a few numbers


@dataclasses.dataclass(frozen=True)
class LoraCheck:
    """What checking a LoRA found, for the node's text.

    Args:
        layers: transformer layers the LoRA changes.
        text_encoder_keys: keys for text encoders (kohya ``lora_te*``), which are not applied.
        notes: what diffusers' converter left out of the file, in its words.
    """

    layers: int
    text_encoder_keys: int = 0
    notes: tuple[str, ...] = ()

    def describe(self, name: str, strength: float) -> str:
        text = f"{name}: {self.layers} transformer layers at strength {strength:g}"
        if self.text_encoder_keys:
            text += (
                f"; its {self.text_encoder_keys} text-encoder weights (lora_te…) are not applied: this loader changes "
                "the transformer only, like ComfyUI's LoraLoaderModelOnly"
            )
        for note in self.notes:
            text += f"; not applied (diffusers: {note})"
        return text


_checked: collections.OrderedDict[tuple, LoraCheck | str] = collections.OrderedDict()


def _check(handle: TransformerHandle, ref: LoraRef) -> LoraCheck:
    key = (*ref.file, handle.spec.model.family, handle.spec.model.path, json.dumps(handle.config, sort_keys=True))
    if key not in _checked:
        try:
            weights = read_lora(handle.family, ref.path, handle.config)
            _checked[key] = LoraCheck(len(weights.modules), weights.text_encoder_keys, weights.notes)
        except LoraError as e:
            _checked[key] = str(e)
        while len(_checked) > _CACHE_SIZE:
            _checked.popitem(last=False)
    _checked.move_to_end(key)
    found = _checked[key]
    if isinstance(found, str):
        raise InvalidInput(
            "lora_name", f"{ref.name} {found} (checked against {handle.spec.model.name}, {handle.family.name})"
        )
    return found


def validate_lora(handle: TransformerHandle | None, *, lora_name: str, strength: float = 1.0) -> LoraRef:
    """Every check ParallelLoraLoader can make before it runs (also its validate_inputs): the strength, the file
    (listed, safetensors, a sound header) and, given the transformer it is chained to, its content against that
    transformer (see ``families.lora.read_lora``). Without a handle (a transformer only execution will know) the
    file alone is checked."""
    check_finite("strength", strength)
    if abs(strength) > MAX_STRENGTH:
        raise InvalidInput("strength", f"{strength:g} is out of range; use -{MAX_STRENGTH:g}..{MAX_STRENGTH:g}")
    path = model_folders.resolve_lora(lora_name)
    try:
        check_file(path)
        stat = os.stat(path)
    except LoraError as e:
        raise InvalidInput("lora_name", f"{lora_name} {e}") from None
    except OSError as e:
        raise InvalidInput("lora_name", f"{lora_name} cannot be read ({e.strerror}); check the file") from None
    ref = LoraRef(name=lora_name, path=path, strength=float(strength), size=stat.st_size, mtime_ns=stat.st_mtime_ns)
    if handle is not None:
        _check(handle, ref)
    return ref


def add_lora(
    handle: TransformerHandle, *, lora_name: str, strength: float = 1.0
) -> tuple[TransformerHandle, LoraCheck]:
    """The handle with the LoRA added after those it carries (chained loaders stack, each with its own strength), and
    what the check found. Loads nothing: the ranks apply the LoRAs to the transformer they hold when it samples."""
    ref = validate_lora(handle, lora_name=lora_name, strength=strength)
    spec = dataclasses.replace(handle.spec, loras=(*handle.spec.loras, ref))
    return dataclasses.replace(handle, spec=spec), _check(handle, ref)
