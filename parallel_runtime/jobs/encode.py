"""EncodeOnBalancedGPUs' step: check the prompt widgets against the model's family, then encode on the backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .. import families, model_folders
from ..client import ProgressFn, get_backend
from ..errors import InvalidInput
from ..families import ENCODER_IMAGES, FamilyAdapter, names
from ..spec import BackendSpec
from ..wire import EncodeArgs, ModelRef, Prompts
from .widgets import parse_max_memory, prompt_list, resolve_dtype

# The widget's limit: the longest any family takes (each family checks its own).
MAX_SEQUENCE_LENGTH = max(adapter.max_sequence_length for adapter in families.REGISTRY)

# Qwen2.5-VL's image processor refuses an image (as the text encoder sees it) longer than this many times its width,
# or wider than this many times its height.
MAX_ASPECT = 200


@dataclasses.dataclass(frozen=True)
class EditImage:
    """An image an edit model's text encoder reads (an image input of EncodeOnBalancedGPUs, for the families with
    ``encoder_images``), checked; it travels with the conditioning to the sampler, whose transformer reads it too.

    Args:
        name: the input it came on (``image``, ``image_2``, ``image_3``), which is also the name it travels under.
        pixels: ComfyUI's IMAGE [1, H, W, 3 or 4] in 0..1, float32.
        condition: the (width, height) the text encoder sees it at (``FamilyAdapter.condition_size``).
        reference: the (width, height) its VAE latents are made at for the transformer (``reference_size``).
    """

    name: str
    pixels: torch.Tensor = dataclasses.field(compare=False)
    condition: tuple[int, int]
    reference: tuple[int, int]

    def describe(self) -> str:
        """What the node shows of it: its size, and the sizes its pipeline resizes it to."""
        given = f"{self.pixels.shape[2]}×{self.pixels.shape[1]}"
        (cw, ch), (rw, rh) = self.condition, self.reference
        return f"{self.name} {given}: the text encoder sees it at {cw}×{ch}, the transformer at {rw}×{rh}"


def _check_images_linked(family: FamilyAdapter, model: str, linked: list[str]) -> None:
    """An edit model's text encoder needs an image; a model whose text encoder reads none is refused one."""
    if family.encoder_images and not linked:
        raise InvalidInput(
            "image",
            f"is not linked, and {model} ({family.name}) edits images; link the image to edit (LoadImage) to image "
            f"(up to {family.encoder_images} images: {', '.join(ENCODER_IMAGES[: family.encoder_images])})",
        )
    if linked and not family.encoder_images:
        editors = names(lambda f: f.encoder_images > 0, last="or")
        elsewhere = " (it reads its image on ParallelSampler's image input)" if family.reference_images else ""
        raise InvalidInput(
            linked[0],
            f"is linked, but {model}'s ({family.name}) text encoder reads no image{elsewhere}; unlink it, or choose an "
            f"edit model whose text encoder does ({editors})",
        )
    if len(linked) > family.encoder_images:
        extra = linked[family.encoder_images :]
        raise InvalidInput(extra[0], f"{family.name} reads at most {family.encoder_images} images; unlink {extra[0]}")


def read_edit_image(family: FamilyAdapter, name: str, image: object) -> EditImage:
    """An image input of EncodeOnBalancedGPUs checked against an edit family: one IMAGE, finite, of an aspect ratio
    its text encoder takes, with the sizes its pipeline resizes it to."""
    if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] not in (3, 4) or 0 in image.shape:
        raise InvalidInput(name, "is not an IMAGE [batch, height, width, channels]; link an IMAGE (LoadImage)")
    if image.shape[0] != 1:
        raise InvalidInput(
            name,
            f"holds {image.shape[0]} images; each image input takes one (pick one with ImageFromBatch, and give "
            f"the others on {', '.join(ENCODER_IMAGES)})",
        )
    if not torch.isfinite(image).all():
        raise InvalidInput(name, "holds NaN or infinite values; load it again (LoadImage)")
    height, width = image.shape[1:3]
    condition = family.condition_size(width, height)
    if min(condition) == 0 or max(condition) / min(condition) > MAX_ASPECT:
        raise InvalidInput(
            name,
            f"is {width}×{height}, too narrow for {family.name}: its text encoder (Qwen2.5-VL) takes images at most "
            f"{MAX_ASPECT} times as long as wide; crop it (ImageCrop) to a less extreme aspect ratio",
        )
    return EditImage(name, image.float(), condition, family.reference_size(width, height))


@dataclasses.dataclass(frozen=True)
class Conditioning:
    """Encoded prompts on the CPU, one row per prompt: ``prompt_embeds`` and what the family adds (FLUX.1:
    ``pooled_prompt_embeds``; Qwen-Image: ``prompt_embeds_mask`` and the negative prompt's ``negative_prompt_embeds``
    / ``negative_prompt_embeds_mask``).

    Args:
        model: the model whose text encoders made them (EncodeOnBalancedGPUs); None for ComfyUI's CONDITIONING,
            which says only its shapes (``jobs.conditioning`` checks those against the transformer).
        prompts: the prompts' texts where known (EncodeOnBalancedGPUs).
        source: where they came from, as the sampler's node says it.
        guidance: FLUX's distilled guidance that came with them (ComfyUI's FluxGuidance / CLIPTextEncodeFlux);
            it replaces the sampler's guidance_scale.
        images: the images an edit model's text encoder read with the prompts (Qwen-Image-Edit), which its
            transformer reads too: the sampler sends them beside the embeddings.
    """

    model: ModelRef | None
    prompts: tuple[str, ...]
    tensors: dict[str, torch.Tensor] = dataclasses.field(compare=False)
    negative_prompts: tuple[str, ...] = ()
    source: str = ""
    guidance: float | None = None
    images: tuple[EditImage, ...] = ()

    @property
    def count(self) -> int:
        """How many prompts (embedding rows) it holds."""
        return self.tensors["prompt_embeds"].shape[0]


def count_prompts(prompt: str, one_prompt_per_line: bool) -> int:
    """How many prompts EncodeOnBalancedGPUs makes of its ``prompt`` widget."""
    return len(prompt_list("prompt", prompt, one_prompt_per_line))


@dataclasses.dataclass(frozen=True)
class EncodeRequest:
    """EncodeOnBalancedGPUs' widgets, checked: what the encode op needs, minus the backend and the dtype."""

    model: ModelRef
    prompts: Prompts
    max_memory: dict[str, str] | None
    images: tuple[EditImage, ...] = ()


def validate_encode(
    *,
    model: str,
    prompt: str,
    prompt_2: str = "",
    negative_prompt: str = "",
    max_sequence_length: int = 512,
    max_memory: str = "",
    one_prompt_per_line: bool = False,
    image: torch.Tensor | None = None,
    image_2: torch.Tensor | None = None,
    image_3: torch.Tensor | None = None,
    images_linked: tuple[str, ...] = (),
) -> EncodeRequest:
    """Every check EncodeOnBalancedGPUs can make before it runs (also its VALIDATE_INPUTS). ``images_linked``: the
    image inputs that are linked where only execution knows what they hold (at validation)."""
    ref = model_folders.resolve(model)
    family = families.family(ref.family)
    given = dict(zip(ENCODER_IMAGES, (image, image_2, image_3)))
    linked = [name for name in ENCODER_IMAGES if given[name] is not None or name in images_linked]
    _check_images_linked(family, ref.name, linked)
    images = tuple(read_edit_image(family, name, given[name]) for name in linked if given[name] is not None)
    prompts = prompt_list("prompt", prompt, one_prompt_per_line)
    if not prompt.strip():
        raise InvalidInput("prompt", "the prompt is empty; describe the image to generate")
    if family.encoder_images and len(prompts) > 1:
        raise InvalidInput(
            "one_prompt_per_line",
            f"gives {len(prompts)} prompts, but {family.name}'s pipeline edits with one prompt at a time (its text "
            "encoder reads the images with it); turn one_prompt_per_line off, or use one encoder per prompt",
        )
    if prompt_2.strip() and family.text_encoders < 2:
        raise InvalidInput(
            "prompt_2",
            f"{family.name} has one text encoder, so prompt_2 has nothing to feed; leave "
            "it empty and put everything in prompt",
        )
    prompts_2 = prompt_list("prompt_2", prompt_2, one_prompt_per_line) if prompt_2.strip() else None
    if prompts_2 is not None and len(prompts_2) != len(prompts):
        raise InvalidInput(
            "prompt_2",
            f"one_prompt_per_line is on: prompt has {len(prompts)} lines but prompt_2 has "
            f"{len(prompts_2)}; give prompt_2 one line per prompt, or leave it empty",
        )
    if not 1 <= max_sequence_length <= family.max_sequence_length:
        raise InvalidInput(
            "max_sequence_length",
            f"{max_sequence_length} is out of range for {family.name}; use 1..{family.max_sequence_length}",
        )
    negative = None
    if family.true_cfg:
        # The same negative prompt for every prompt, empty or not, as ComfyUI encodes an empty negative: whether it
        # is used is the sampler's true_cfg_scale.
        prompt_list("negative_prompt", negative_prompt, False)
        negative = (negative_prompt,) * len(prompts)
    return EncodeRequest(
        ref,
        Prompts(tuple(prompts), tuple(prompts_2) if prompts_2 else None, negative, max_sequence_length),
        parse_max_memory(max_memory),
        images,
    )


def encode_prompt(
    spec: BackendSpec,
    *,
    model: str,
    prompt: str,
    prompt_2: str = "",
    negative_prompt: str = "",
    max_sequence_length: int = 512,
    max_memory: str = "",
    dtype: str = "auto",
    one_prompt_per_line: bool = False,
    image: torch.Tensor | None = None,
    image_2: torch.Tensor | None = None,
    image_3: torch.Tensor | None = None,
    on_progress: ProgressFn | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> Conditioning:
    """Encode ``prompt`` with the model's text encoders placed ``device_map="balanced"`` across the GPUs.

    With ``one_prompt_per_line`` every non-empty line is a prompt of its own (one embedding row each; the sampler
    makes ``batch_size`` images of each, and data parallelism spreads them over the ranks); ``prompt_2`` then holds
    one line per prompt too, or nothing. Families with true CFG (Qwen-Image) also encode ``negative_prompt``; other
    families ignore it. An edit model whose text encoder reads images (Qwen-Image-Edit) encodes the prompts with
    ``image`` (and ``image_2``, ``image_3``: ComfyUI IMAGEs), resized as its pipeline does; the conditioning carries
    them on to the sampler.
    """
    request = validate_encode(
        model=model,
        prompt=prompt,
        prompt_2=prompt_2,
        negative_prompt=negative_prompt,
        max_sequence_length=max_sequence_length,
        max_memory=max_memory,
        one_prompt_per_line=one_prompt_per_line,
        image=image,
        image_2=image_2,
        image_3=image_3,
    )
    args = EncodeArgs(
        model=request.model, dtype=resolve_dtype(dtype, spec), prompts=request.prompts, max_memory=request.max_memory
    )
    images = {edit.name: edit.pixels for edit in request.images}
    result = get_backend(spec).call(args, images or None, on_progress=on_progress, should_cancel=should_cancel)
    return Conditioning(
        model=request.model,
        prompts=request.prompts.prompts,
        tensors=result.tensors,
        negative_prompts=request.prompts.negative_prompts or (),
        source=f"EncodeOnBalancedGPUs ({request.model.name})",
        images=request.images,
    )
