"""ParallelLoraLoader's step: check a LoRA file against the transformer it is chained to, then add it to the handle.

Nothing loads on the backend here: the LoRA becomes part of the transformer handle (``TransformerSpec.loras``) and the
ranks apply it when the sampler runs, to the transformer they already hold. A file is identified by its content's
sha256 (taken once per path, size, modification and change time, inode), which the ranks check before they merge it.
Its content is checked here once per digest and model, so validation, execution and the sampler's validation of one
prompt read it once, and a prompt that only changes a strength reads nothing. The check runs in a thread of its own
with a deadline (``CHECK_SECONDS``): ComfyUI validates on its event loop, which must keep answering whatever the file.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import os
import threading

from .. import model_folders
from ..errors import InvalidInput
from ..families.lora import LoraError, check_file, read_lora, sha256
from ..gguf_files import TENSOR_PARALLEL_LORAS, gguf_weights
from ..wire import Expert, LoraRef
from .transformer import TransformerHandle
from .widgets import check_finite

MAX_STRENGTH = 10.0
_CACHE_SIZE = 64  # checked (file, model) pairs and digests remembered; each entry is a few numbers
# The longest a LoRA's check may take: a large LoRA on a FLUX.1-dev config takes seconds; beyond this, something in
# the file makes diffusers' reading run away, and the prompt is refused rather than ComfyUI held.
CHECK_SECONDS = 120.0


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
_digests: collections.OrderedDict[tuple, str] = collections.OrderedDict()
_lock = threading.Lock()  # ComfyUI validates prompts of several requests at once, in threads (the node's validation)


def _remember(cache: collections.OrderedDict, key: tuple, value: object) -> None:
    with _lock:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)


def _read(handle: TransformerHandle, ref: LoraRef) -> LoraCheck | str:
    try:
        weights = read_lora(handle.family, ref.path, handle.config, expected_sha256=ref.sha256)
    except LoraError as e:
        return str(e)
    except Exception as e:  # a reading that fails unforeseen is still a refusal that names the file, not a traceback
        return f"cannot be read as a {handle.family.name} LoRA ({type(e).__name__}: {str(e)[:200]})"
    return LoraCheck(len(weights.modules), weights.text_encoder_keys, weights.notes)


def _check(handle: TransformerHandle, ref: LoraRef) -> LoraCheck:
    key = (*ref.file, handle.spec.model.family, handle.spec.model.path, json.dumps(handle.config, sort_keys=True))
    with _lock:
        found = _checked.get(key)
    if found is None:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def read() -> None:
            result = _read(handle, ref)
            _remember(_checked, key, result)  # also after the deadline: the next prompt gets the real outcome
            future.set_result(result)

        threading.Thread(target=read, name=f"lora-check {ref.name}", daemon=True).start()
        try:
            found = future.result(timeout=CHECK_SECONDS)
        except concurrent.futures.TimeoutError:
            found = (
                f"took more than {CHECK_SECONDS:g} s to check, so it was given up (its reading may loop on a damaged "
                "value); check the file, or download it again"
            )
            with _lock:
                _checked.setdefault(key, found)
    else:
        _remember(_checked, key, found)
    if isinstance(found, str):
        raise InvalidInput(
            "lora_name", f"{ref.name} {found} (checked against {handle.spec.model.name}, {handle.family.name})"
        )
    return found


def _digest(path: str, stat: os.stat_result) -> str:
    """The file's sha256, taken again only when what a replacement changes (size, times, inode) changed."""
    key = (path, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)
    with _lock:
        found = _digests.get(key)
    if found is None:
        found = sha256(path)
    _remember(_digests, key, found)
    return found


def _expert(handle: TransformerHandle | None, expert: str) -> Expert:
    """The ``expert`` widget: one of the model's experts only where it has two."""
    try:
        chosen = Expert(expert)
    except ValueError:
        raise InvalidInput(
            "expert", f"unknown expert {expert!r}; choose one of {', '.join(e.value for e in Expert)}"
        ) from None
    if chosen is not Expert.BOTH and handle is not None:
        subfolders = handle.family.transformer_subfolders(handle.spec.model.path)
        if len(subfolders) < 2:
            raise InvalidInput(
                "expert",
                f"{chosen.value} picks one of two experts (Wan 2.2 A14B), but {handle.spec.model.name} has one "
                "transformer; set both",
            )
    return chosen


def validate_lora(
    handle: TransformerHandle | None, *, lora_name: str, strength: float = 1.0, expert: str = Expert.BOTH.value
) -> LoraRef:
    """Every check ParallelLoraLoader can make before it runs (also its validate_inputs): the strength, the expert,
    the file (listed, safetensors, a sound header) and, given the transformer it is chained to, its content against
    that transformer (see ``families.lora.read_lora``; two experts have one config). Without a handle (a transformer
    only execution will know) the file alone is checked."""
    check_finite("strength", strength)
    if abs(strength) > MAX_STRENGTH:
        raise InvalidInput("strength", f"{strength:g} is out of range; use -{MAX_STRENGTH:g}..{MAX_STRENGTH:g}")
    chosen = _expert(handle, expert)
    path = model_folders.resolve_lora(lora_name)
    try:
        stat = os.stat(path)
        check_file(path)
        digest = _digest(path, stat)
    except LoraError as e:
        raise InvalidInput("lora_name", f"{lora_name} {e}") from None
    except OSError as e:
        raise InvalidInput("lora_name", f"{lora_name} cannot be read ({e.strerror}); check the file") from None
    ref = LoraRef(name=lora_name, path=path, strength=float(strength), sha256=digest, expert=chosen)
    if handle is not None and handle.spec.plan.shards_weights:
        if gguf_weights(os.path.join(handle.spec.model.path, "transformer")) is not None:
            raise InvalidInput("lora_name", f"{lora_name}: {TENSOR_PARALLEL_LORAS}")
    if handle is not None:
        _check(handle, ref)
    return ref


def add_lora(
    handle: TransformerHandle, *, lora_name: str, strength: float = 1.0, expert: str = Expert.BOTH.value
) -> tuple[TransformerHandle, LoraCheck]:
    """The handle with the LoRA added after those it carries (chained loaders stack, each with its own strength and
    expert), and what the check found. Loads nothing: the ranks apply the LoRAs to the transformer they hold when it
    samples."""
    ref = validate_lora(handle, lora_name=lora_name, strength=strength, expert=expert)
    spec = dataclasses.replace(handle.spec, loras=(*handle.spec.loras, ref))
    return dataclasses.replace(handle, spec=spec), _check(handle, ref)
