"""ParallelSampler's step: check steps, sizes and the conditioning against the transformer's family and strategy,
then denoise on the transformer's backend."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from .. import families
from ..client import ProgressFn, get_backend
from ..errors import InvalidInput
from ..families import FamilyAdapter, img2img_steps, names
from ..families.base import REFERENCE_INPUTS, image_tokens
from ..samplers import SAMPLERS, SCHEDULERS, Sampler, Scheduler
from ..wire import CacheReport, DenoiseArgs, DenoiseResult, Sampling
from .conditioning import read_positive, with_negative
from .encode import Conditioning
from .transformer import TransformerHandle
from .widgets import check_finite, check_length


def _check_size(widget: str, value: int, multiple: int) -> None:
    if value < multiple or value % multiple:
        lower, upper = max(multiple, value // multiple * multiple), (value // multiple + 1) * multiple
        raise InvalidInput(
            widget,
            f"{value} is not a multiple of {multiple} (a transformer token is {multiple}×{multiple} pixels: the "
            f"VAE's downscale times the transformer's 2×2 patches); use {lower} or {upper}",
        )


def _text_streams(family: FamilyAdapter, conditioning: Conditioning, true_cfg_scale: float) -> dict[str, torch.Tensor]:
    """The text embeddings the transformer will see, by the prompt they come from."""
    streams = {"prompt": conditioning.tensors["prompt_embeds"]}
    if family.true_cfg and true_cfg_scale > 1:
        streams["negative prompt"] = conditioning.tensors["negative_prompt_embeds"]
    return streams


@dataclasses.dataclass(frozen=True)
class LatentImage:
    """The LATENT ParallelSampler starts from (img2img, hires fix, inpainting), checked against the transformer.

    Args:
        samples: in ComfyUI's convention of the family, float32; batch 1 (it serves every image) or one per image.
        noise_mask: where to repaint, ``[1 or one per image, 1, H, W]`` in 0..1 (ComfyUI's SetLatentNoiseMask); None
            re-denoises all of it.
        width, height: the image size the latent stands for, in pixels (it replaces the width and height widgets).
    """

    samples: torch.Tensor
    noise_mask: torch.Tensor | None
    width: int
    height: int

    @property
    def batch(self) -> int:
        return self.samples.shape[0]


def read_latent_image(handle: TransformerHandle, latent: Any) -> LatentImage:
    """A LATENT (ComfyUI's ``{"samples": ..., "noise_mask": ...}``) checked against the transformer's family: its
    layout and channels, a size of whole transformer tokens, finite values, a mask of the latent's aspect ratio."""
    family = handle.family
    if not family.takes_latent_image:
        raise InvalidInput(
            "latent_image",
            f"{family.name} makes clips from text only here (no video-to-video yet); unlink latent_image",
        )
    samples = latent.get("samples") if isinstance(latent, dict) else None
    if not isinstance(samples, torch.Tensor):
        raise InvalidInput("latent_image", "is not a LATENT (no samples tensor); link a LATENT output")
    layout = family.latent
    # The transformer's input channels are the VAE's latent channels in 2x2 patches (FLUX.2's LATENT stores those
    # patches as channels already).
    channels = handle.config["in_channels"] // 4 * layout.channels_per_vae_channel
    frames = samples.shape[2] if samples.ndim == 5 else 1
    if samples.ndim not in layout.ndims or samples.shape[1] != channels or frames != 1:
        expected = " or ".join(f"{n}-D" for n in layout.ndims)
        raise InvalidInput(
            "latent_image",
            f"a LATENT of shape {list(samples.shape)} does not fit {handle.spec.model.name} ({family.name}: "
            f"{expected}, {channels} channels, one frame); it was made for another model. Start from a LATENT of "
            f"{family.name}: VAEEncodeSingleGPU or a ParallelSampler with this model",
        )
    if not torch.isfinite(samples).all():
        raise InvalidInput("latent_image", "holds NaN or infinite values; re-make it (VAEEncodeSingleGPU)")
    latent_height, latent_width = samples.shape[-2], samples.shape[-1]
    _check_latent_size(family, latent_width, latent_height)
    mask = latent.get("noise_mask")
    if mask is not None:
        mask = _read_mask(mask, latent_width, latent_height)
    return LatentImage(
        samples.float(), mask, width=latent_width * layout.downscale, height=latent_height * layout.downscale
    )


def _check_latent_size(family: FamilyAdapter, latent_width: int, latent_height: int) -> None:
    layout = family.latent
    multiple = family.pixels_per_token // layout.downscale  # latent pixels per token side
    for side, size in (("width", latent_width), ("height", latent_height)):
        if size < multiple or size % multiple:
            lower, upper = max(multiple, size // multiple * multiple), (size // multiple + 1) * multiple
            raise InvalidInput(
                "latent_image",
                f"its {side} of {size} latent pixels ({size * layout.downscale} pixels) is not a whole number of the "
                f"transformer's {family.pixels_per_token}-pixel patches; crop or scale it to {lower} or {upper} "
                f"latent pixels ({lower * layout.downscale} or {upper * layout.downscale} pixels; LatentCrop, "
                "LatentUpscale)",
            )


def _read_mask(mask: Any, latent_width: int, latent_height: int) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.ndim < 2 or mask.numel() == 0:
        raise InvalidInput("noise_mask", "is not a mask tensor; set it with SetLatentNoiseMask from a MASK")
    # ComfyUI's own sampler reads a noise_mask the same way (comfy.sampler_helpers.prepare_mask).
    mask = mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1]).float()
    mask_height, mask_width = mask.shape[-2:]
    # Any size is resized to the image; another aspect ratio would stretch it (more than a latent pixel).
    if abs(mask_height * latent_width / mask_width - latent_height) > 1:
        raise InvalidInput(
            "noise_mask",
            f"is {mask_width}×{mask_height}, another aspect ratio than the latent's {latent_width}×{latent_height} "
            "(it would be stretched over the image); make the mask from this image, or crop and scale it the way "
            "the latent was",
        )
    if not torch.isfinite(mask).all():
        raise InvalidInput("noise_mask", "holds NaN or infinite values; set it again from a MASK")
    return mask


@dataclasses.dataclass(frozen=True)
class ReferenceImage:
    """A reference image of an edit or reference model (ParallelSampler's ``image``, ``image_2``, ``image_3``), or a
    clip's first frame (Wan I2V's ``image``), checked against the transformer's family.

    Args:
        input: the sampler's input it came from.
        pixels: ComfyUI's IMAGE [1 (or one per image, where the family pairs them), H, W, 3 or 4] in 0..1, float32.
        width, height: the size it runs at, resized by the family's pipeline (``FamilyAdapter.reference_size``; a
            first frame: the output's size).
        tokens: the transformer's tokens of it at that size (a first frame: none, it is not in the sequence).
        first_frame: it is the clip's first frame (``FamilyAdapter.first_frame``).
    """

    input: str
    pixels: torch.Tensor
    width: int
    height: int
    tokens: int
    first_frame: bool = False

    @property
    def batch(self) -> int:
        return self.pixels.shape[0]

    def describe(self) -> str:
        """What the node shows of it: the size it was given and the size it ran at."""
        given = f"{self.pixels.shape[2]}×{self.pixels.shape[1]}"
        ran = f"{self.width}×{self.height}"
        what = "start image" if self.first_frame else f"reference {self.input}"
        return f"{what} {given}" + (f", resized to {ran}" if ran != given else "")


def read_reference_images(
    handle: TransformerHandle, images: dict[str, Any], output: tuple[int, int] | None = None
) -> tuple[ReferenceImage, ...]:
    """ParallelSampler's reference inputs (by name, None: not linked) checked against the transformer's family: as
    many as it takes, in order, the first where it edits one; each an IMAGE of a size its pipeline takes, finite. A
    clip's first frame (Wan I2V) is one image, resized to ``output``, the (width, height) of the clip (its own size
    where None)."""
    family = handle.family
    _check_references_linked(handle, tuple(name for name in REFERENCE_INPUTS if images.get(name) is not None))
    references = []
    for name in REFERENCE_INPUTS:
        image = images.get(name)
        if image is None:
            continue
        if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] not in (3, 4):
            raise InvalidInput(name, "is not an IMAGE [batch, height, width, channels]; link an IMAGE (LoadImage)")
        height, width = image.shape[1:3]
        multiple = family.pixels_per_token
        if width < multiple or height < multiple:
            raise InvalidInput(
                name, f"is {width}×{height}, smaller than one {multiple}-pixel token; scale it up (ImageScale)"
            )
        if not torch.isfinite(image).all():
            raise InvalidInput(name, "holds NaN or infinite values; load it again (LoadImage)")
        if family.first_frame:
            if image.shape[0] != 1:
                raise InvalidInput(
                    name,
                    f"holds {image.shape[0]} images, but {family.name} starts every clip from one; pick one "
                    "(ImageFromBatch)",
                )
            references.append(ReferenceImage(name, image.float(), *(output or (width, height)), 0, first_frame=True))
            continue
        try:
            size = family.reference_size(width, height)
        except ValueError as e:
            raise InvalidInput(name, str(e)) from None
        references.append(ReferenceImage(name, image.float(), *size, image_tokens(family, *size)))
    return tuple(references)


def _check_references_linked(handle: TransformerHandle, linked: tuple[str, ...]) -> None:
    """The reference inputs linked (``linked``, by name): an edit model (or an image-to-video one) needs its
    ``image``; a model that reads none is refused one (it would be ignored), and one that reads fewer the inputs
    beyond them; they fill in order."""
    family, model = handle.family, handle.spec.model.name
    if family.needs_reference and "image" not in linked:
        does = "starts its clip from an image" if family.first_frame else "edits an image"
        what = "the clip's first frame" if family.first_frame else "the image to edit"
        raise InvalidInput(
            "image",
            f"is not linked, and {model} ({family.name}) {does}; link {what} (LoadImage) to ParallelSampler's image "
            "input",
        )
    if linked and not family.reference_images:
        if family.encoder_images:
            raise InvalidInput(
                linked[0],
                f"is linked, but {model} ({family.name}) reads its images with the prompt; unlink it and link the "
                "image to EncodeOnBalancedGPUs' image input instead",
            )
        readers = names(lambda f: f.reference_images > 0, last="or")
        raise InvalidInput(
            linked[0],
            f"is linked, but {model} ({family.name}) reads no reference image; unlink it, or load a model that "
            f"reads one ({readers}) on LoadShardedTransformer",
        )
    taken = REFERENCE_INPUTS[: family.reference_images]
    for name in linked:
        if name not in taken:
            count = f"{len(taken)} reference image{'s' if len(taken) > 1 else ''}"
            raise InvalidInput(
                name, f"is linked, but {model} ({family.name}) takes {count} ({', '.join(taken)}); unlink {name}"
            )
    free = next((name for name in taken if name not in linked), None)
    for name in linked:
        if free is not None and REFERENCE_INPUTS.index(name) > REFERENCE_INPUTS.index(free):
            raise InvalidInput(
                name,
                f"is linked but {free} is not; the reference images fill the inputs in order ({', '.join(taken)}): "
                f"link this one to {free}",
            )


def _read_sampler(handle: TransformerHandle, sampler: str, scheduler: str) -> tuple[Sampler, Scheduler]:
    """The ``sampler`` and ``scheduler`` widgets as the table's words (``samplers``), refused where the pack cannot
    run them as diffusers does."""
    try:
        chosen = Sampler(sampler)
    except ValueError:
        raise InvalidInput(
            "sampler", f"unknown sampler {sampler!r}; choose one of {', '.join(s.value for s in SAMPLERS)}"
        ) from None
    try:
        schedule = Scheduler(scheduler)
    except ValueError:
        raise InvalidInput(
            "scheduler", f"unknown scheduler {scheduler!r}; choose one of {', '.join(s.value for s in SCHEDULERS)}"
        ) from None
    family = handle.family
    if chosen not in family.samplers:
        raise InvalidInput(
            "sampler",
            f"{chosen.value} does not run {family.name} (its model folders' scheduler config is not UniPC's); choose "
            f"{' or '.join(s.value for s in family.samplers)}",
        )
    if chosen is Sampler.UNI_PC and schedule is not Scheduler.SIMPLE:
        # UniPC's karras / exponential / beta sigmas come from its beta schedule, not from the flow sigmas.
        raise InvalidInput(
            "scheduler",
            f"{schedule.value} replaces UniPC's flow sigmas with a schedule of another kind of model; choose simple "
            "with uni_pc, or euler for this schedule",
        )
    if SAMPLERS[chosen].step_noise and handle.plan.splits_batch:
        # diffusers' pipelines draw this noise for the whole batch from torch's global generator; a rank holding a
        # slice of the batch cannot draw its images' share of that stream.
        raise InvalidInput(
            "sampler",
            f"{chosen.value} draws new noise every step for the whole batch from one stream, which data_parallel's "
            "ranks (each a slice of the batch) cannot share; choose euler, or context_parallel or tensor_parallel "
            "on LoadShardedTransformer",
        )
    if schedule is Scheduler.BETA and importlib.util.find_spec("scipy") is None:
        raise InvalidInput(
            "scheduler",
            "beta needs scipy (diffusers' beta sigmas use it), which is not installed; pip install "
            "scipy in ComfyUI's Python, or choose simple, karras or exponential",
        )
    return chosen, schedule


def _check_guidance_scale_2(handle: TransformerHandle, guidance_scale_2: float, true_cfg_scale: float) -> None:
    """``guidance_scale_2`` guides a second expert (Wan 2.2 A14B) and only where CFG is on; 0 leaves it unset."""
    check_finite("guidance_scale_2", guidance_scale_2)
    if guidance_scale_2 == 0:
        return
    if len(handle.family.transformer_subfolders(handle.spec.model.path)) < 2:
        raise InvalidInput(
            "guidance_scale_2",
            f"{guidance_scale_2} guides a second expert (Wan 2.2 A14B), which {handle.spec.model.name} has not; "
            "set it to 0",
        )
    if guidance_scale_2 < 1:
        raise InvalidInput(
            "guidance_scale_2", f"{guidance_scale_2} is below 1; use 0 (the same as true_cfg_scale), 1 or more"
        )
    if true_cfg_scale <= 1:
        raise InvalidInput(
            "guidance_scale_2",
            f"{guidance_scale_2} guides the second expert's CFG, which true_cfg_scale {true_cfg_scale} turns off "
            "for both experts; raise true_cfg_scale above 1, or set guidance_scale_2 to 0",
        )


def _mask_batch(latent_image: LatentImage) -> int:
    return latent_image.noise_mask.shape[0] if latent_image.noise_mask is not None else 1


def validate_sample(
    handle: TransformerHandle,
    conditioning: Conditioning | None,
    *,
    steps: int,
    width: int,
    height: int,
    batch_size: int,
    guidance_scale: float = 3.5,
    true_cfg_scale: float = 1.0,
    prompts: int | None = 1,
    denoise: float = 1.0,
    latent_image: LatentImage | None = None,
    latent_linked: bool = False,
    latent_size: tuple[int, int] | None = None,
    sampler: str = Sampler.EULER.value,
    scheduler: str = Scheduler.SIMPLE.value,
    length: int = 1,
    guidance_scale_2: float = 0.0,
    references: tuple[ReferenceImage, ...] = (),
    references_linked: tuple[str, ...] = (),
) -> None:
    """Every check ParallelSampler can make before it runs. Without a ``conditioning`` (at validation), ``prompts``
    says how many prompts it will hold; None skips the checks that need to know. ``latent_linked``: a latent_image
    is linked whose contents only execution knows; ``latent_size`` its (width, height) in latent pixels where the
    graph says it (the size checks wait for execution otherwise). ``references``: the reference images
    (``read_reference_images``); ``references_linked``: the reference inputs linked whose sizes only execution
    knows."""
    family, plan = handle.family, handle.plan
    _read_sampler(handle, sampler, scheduler)
    linked = references_linked or tuple(reference.input for reference in references)
    _check_references_linked(handle, linked)
    if (linked or family.encoder_images) and (latent_image is not None or latent_linked):
        if family.encoder_images:
            what = "edits the images given to EncodeOnBalancedGPUs"
        else:
            what = "edits its image input" if family.needs_reference else f"takes {' and '.join(linked)}"
        raise InvalidInput(
            "latent_image",
            f"is linked, but {family.name} {what} and starts from noise then (no img2img); unlink "
            "latent_image and set the output's size with width and height"
            + ("" if family.needs_reference or family.encoder_images else ", or unlink the reference images"),
        )
    if steps < family.min_steps:
        raise InvalidInput("steps", f"{steps} steps {family.min_steps_reason}; use at least {family.min_steps}")
    check_finite("denoise", denoise)
    if not 0 <= denoise <= 1:
        raise InvalidInput("denoise", f"{denoise} is outside 0..1; use 1 to start from noise, less to keep more")
    starts_from_image = latent_image is not None or latent_linked
    if not starts_from_image and denoise < 1:
        raise InvalidInput(
            "denoise",
            f"{denoise} keeps part of an image, but no latent_image is linked; link one (VAEEncodeSingleGPU, or a "
            "first ParallelSampler for a hires fix) or set denoise to 1",
        )
    if starts_from_image and img2img_steps(steps, denoise) < 1:
        raise InvalidInput(
            "denoise",
            f"{denoise} runs none of the {steps} steps (steps × denoise, rounded up, run) and would return the "
            "latent_image as it is; raise denoise above 0",
        )
    if latent_image is not None:  # the latent's size is the image's; the widgets are ignored
        width, height = latent_image.width, latent_image.height
    elif latent_linked and latent_size is not None:
        _check_latent_size(family, *latent_size)
        width, height = (side * family.latent.downscale for side in latent_size)
    elif not latent_linked:
        _check_size("width", width, family.pixels_per_token)
        _check_size("height", height, family.pixels_per_token)
    if batch_size < 1:
        raise InvalidInput("batch_size", f"{batch_size} makes no images; use at least 1")
    check_length(family, length)
    _check_guidance_scale_2(handle, guidance_scale_2, true_cfg_scale)
    check_finite("guidance_scale", guidance_scale)
    check_finite("true_cfg_scale", true_cfg_scale)
    if family.true_cfg and true_cfg_scale < 1:
        raise InvalidInput(
            "true_cfg_scale",
            f"{true_cfg_scale} is below 1; use 1 (true CFG off: one transformer pass "
            "per step) or more (guided by the negative prompt: two passes per step)",
        )
    if conditioning is not None and family.encoder_images and not conditioning.images:
        raise InvalidInput(
            "positive",
            f"carries no image, and {handle.spec.model.name} ({family.name}) edits the images its prompt is encoded "
            "with; encode with EncodeOnBalancedGPUs and link the image to edit to its image input",
        )
    encoded_with = conditioning.model if conditioning is not None else None
    if encoded_with is not None and encoded_with.family != handle.spec.model.family:
        raise InvalidInput(
            "positive",
            f"was encoded with {encoded_with.name} ({families.family(encoded_with.family).name}) but "
            f"the transformer is {handle.spec.model.name} ({family.name}); encode with the "
            "same model as the transformer",
        )
    if (
        conditioning is not None
        and family.true_cfg
        and true_cfg_scale > 1
        and "negative_prompt_embeds" not in conditioning.tensors
    ):
        if encoded_with is None:
            raise InvalidInput(
                "negative",
                f"true_cfg_scale {true_cfg_scale} guides against a negative prompt, and ComfyUI's CONDITIONING on "
                "positive brings none; link one into negative (a CLIPTextEncode of the negative text, or "
                "ConditioningZeroOut), or set true_cfg_scale to 1",
            )
        raise InvalidInput(
            "positive",
            f"has no negative prompt for true CFG; re-encode it with "
            f"{handle.spec.model.name}, or set true_cfg_scale to 1",
        )
    if conditioning is not None and true_cfg_scale > 1 and "negative_prompt_embeds" in conditioning.tensors:
        refusal = family.cfg_refusal(handle.spec.model.path, true_cfg_scale)
        if refusal is not None:
            raise InvalidInput("true_cfg_scale", refusal)
    if plan.splits_cfg and not (family.true_cfg and true_cfg_scale > 1):
        raise InvalidInput(
            "true_cfg_scale",
            f"{true_cfg_scale} turns true CFG off, so cfg_parallel's second half of the ranks has no pass to run; "
            "raise true_cfg_scale above 1, or use context_parallel on LoadShardedTransformer",
        )
    for reference in references:
        if reference.batch > 1 and not family.reference_per_image:
            raise InvalidInput(
                reference.input,
                f"holds {reference.batch} images, but {family.name} takes one image per reference input, the same "
                f"for every image made; pick one (ImageFromBatch), one for each of "
                f"{', '.join(REFERENCE_INPUTS[: family.reference_images])}",
            )
    world = plan.ranks
    prompts = conditioning.count if conditioning is not None else prompts
    if prompts is not None:
        images = batch_size * prompts
        counts = tuple((reference.input, reference.batch) for reference in references)
        if latent_image is not None:
            counts += (("latent_image", latent_image.batch), ("noise_mask", _mask_batch(latent_image)))
        for what, count in counts:
            if count not in (1, images):
                made = f"batch_size {batch_size} × {prompts} prompts" if prompts > 1 else f"batch_size {batch_size}"
                raise InvalidInput(
                    what,
                    f"holds {count} images but the sampler makes {images} ({made}); give one for all of them, or "
                    f"set batch_size so that there is one image per latent",
                )
    if plan.splits_batch and prompts is not None and batch_size * prompts < world:
        made = f"batch_size {batch_size} × {prompts} prompts" if prompts > 1 else f"batch_size {batch_size}"
        raise InvalidInput(
            "batch_size",
            f"data_parallel gives each of the {world} ranks whole images, so it needs at "
            f"least {world} images ({made} makes {batch_size * prompts}); raise "
            "batch_size, give more prompts (one_prompt_per_line), or use "
            "context_parallel or tensor_parallel to speed up a single image",
        )
    size_known = latent_image is not None or not latent_linked or latent_size is not None
    if plan.splits_tokens and not plan.anything and size_known:
        degree = plan.cp_degree
        # The transformer splits image tokens and text tokens separately across the ranks.
        tokens = image_tokens(family, width, height, length)
        # A clip's first frame adds no tokens; an edit model's pictures (the sampler's reference images, the encoder's
        # images) ride in the sequence after the output's, checked as a whole below.
        in_sequence = [(r.input, r.width, r.height, r.tokens) for r in references if not r.first_frame]
        in_sequence += [
            (edit.name, *edit.reference, image_tokens(family, *edit.reference))
            for edit in (conditioning.images if conditioning is not None else ())
        ]
        if tokens % degree and not ((linked and not family.first_frame) or family.encoder_images):
            clip = f" × {length} frames" if length > 1 else ""
            raise InvalidInput(
                "latent_image" if latent_linked or latent_image is not None else "width",
                f"{width}×{height}{clip} makes {tokens} image tokens, which do not split over "
                f"{degree} ranks; turn on anything (Ulysses/Ring-anything) on "
                "LoadShardedTransformer, or pick a size whose token count divides",
            )
        if in_sequence:  # the pictures' tokens follow the image's in one sequence, split as a whole
            sequence = tokens + sum(count for *_, count in in_sequence)
            if sequence % degree:
                theirs = ", ".join(f"{name} {count} ({w}×{h})" for name, w, h, count in in_sequence)
                raise InvalidInput(
                    next((r.input for r in reversed(references) if not r.first_frame), "width"),
                    f"the output's {tokens} tokens ({width}×{height}) and the reference images' ({theirs}) make a "
                    f"sequence of {sequence}, which does not split over {degree} ranks; turn on anything on "
                    f"LoadShardedTransformer, or change width or height by {family.pixels_per_token}",
                )
        # Wan's _cp_plan leaves the text whole (splits_text): only the video tokens must divide.
        split_text = conditioning is not None and family.splits_text
        text_streams = _text_streams(family, conditioning, true_cfg_scale) if split_text else {}
        for source, embeds in text_streams.items():
            tokens = embeds.shape[1]
            if not tokens % degree:
                continue
            if family.pads_text:
                fix = f"set max_sequence_length to a multiple of {degree}, or turn on anything"
            else:
                fix = (
                    f"{family.name} keeps each prompt's own length, so turn on anything on LoadShardedTransformer, "
                    "or make that prompt a word longer or shorter"
                )
            raise InvalidInput(
                "positive", f"the {source} is {tokens} text tokens, which do not split over {degree} ranks; {fix}"
            )
    if conditioning is None:
        return
    _check_image_context(handle, conditioning, true_cfg_scale)
    embeds = conditioning.tensors["prompt_embeds"]
    text_width = handle.config.get("joint_attention_dim")
    if text_width and embeds.shape[-1] != text_width:
        raise InvalidInput(
            "positive",
            f"was encoded with {conditioning.source} ({embeds.shape[-1]}-wide text "
            f"embeddings) but {handle.spec.model.name}'s transformer expects {text_width}; "
            "encode with the same model as the transformer",
        )


def _check_image_context(handle: TransformerHandle, conditioning: Conditioning, true_cfg_scale: float) -> None:
    """A transformer with an image embedding (Wan 2.1 I2V) takes its cross-attention's context as the CLIP image
    tokens followed by exactly ``max_sequence_length`` text tokens, split by that count: text of another length would
    run, and be silently wrong."""
    family = handle.family
    if not handle.config.get("image_dim"):
        return
    for source, embeds in _text_streams(family, conditioning, true_cfg_scale).items():
        tokens = embeds.shape[1]
        if tokens != family.max_sequence_length:
            raise InvalidInput(
                "positive",
                f"the {source} is {tokens} text tokens, but {handle.spec.model.name}'s transformer reads its image "
                f"tokens as what precedes the last {family.max_sequence_length}; encode with max_sequence_length "
                f"{family.max_sequence_length} (EncodeOnBalancedGPUs), or a prompt of at most "
                f"{family.max_sequence_length} tokens",
            )


def sample(
    handle: TransformerHandle,
    positive: Conditioning | list,
    *,
    negative: Conditioning | list | None = None,
    seed: int,
    steps: int,
    guidance_scale: float,
    width: int,
    height: int,
    batch_size: int = 1,
    true_cfg_scale: float = 4.0,
    latent_image: dict | None = None,
    denoise: float = 1.0,
    sampler: str = Sampler.EULER.value,
    scheduler: str = Scheduler.SIMPLE.value,
    length: int = 1,
    guidance_scale_2: float = 0.0,
    image: torch.Tensor | None = None,
    image_2: torch.Tensor | None = None,
    image_3: torch.Tensor | None = None,
    on_progress: ProgressFn | None = None,
    should_cancel: Callable[[], bool] | None = None,
    on_cache_report: Callable[[CacheReport], None] | None = None,
    on_result: Callable[[DenoiseResult], None] | None = None,
    on_conditioning: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """Denoise on the backend; ComfyUI LATENT samples in the family's layout (FLUX.1 ``[B, 16, H/8, W/8]``, FLUX.2
    ``[B, 128, H/16, W/16]``, Qwen-Image ``[B, 16, 1, H/8, W/8]``). ``true_cfg_scale`` reaches only families with
    true CFG (Qwen-Image; 1 turns it off); ``guidance_scale`` is the distilled guidance of FLUX.1 / FLUX.2.
    ``batch_size`` images are made of each of the conditioning's prompts, prompt by prompt; image i of the whole
    batch uses ``seed + i`` (modulo 2^64), as diffusers' pipelines do with a list of generators.

    From a ``latent_image`` (a LATENT of the family; its size replaces width and height), img2img as diffusers'
    img2img pipelines do it at strength ``denoise`` (``steps × denoise`` steps run, rounded up), and inpainting where
    its ``noise_mask`` is 1. ``sampler`` and ``scheduler`` pick the diffusers scheduler and its sigma schedule
    (``samplers``; euler and simple are the family's own, uni_pc is Wan's). A video family makes clips of ``length``
    frames (LATENT ``[B, C, frames, h, w]``); ``guidance_scale_2`` is Wan 2.2's second expert's CFG scale (0: the
    same as ``true_cfg_scale``). With the transformer's step cache on,
    ``on_cache_report`` gets what it skipped (rank 0's passes). ``on_result`` gets the whole result: what compiling
    did, how data parallelism split the batch, the unequal devices that set the pace (``DenoiseResult.notes``).

    ``positive`` and ``negative`` are EncodeOnBalancedGPUs' Conditioning or ComfyUI's CONDITIONING (``conditioning``
    turns it into the family's inputs); ``negative`` is true CFG's negative prompt, over the encoder's. A guidance
    that came with the conditioning (FluxGuidance) replaces ``guidance_scale``. ``on_conditioning`` gets where the
    conditioning came from, in words. An edit model (FLUX.1 Kontext) edits ``image`` (ComfyUI's IMAGE, batch 1 or one
    per image); FLUX.2 takes up to three reference images (``image``, ``image_2``, ``image_3``, one each); each is
    resized as the family's pipeline does (``read_reference_images``). An image-to-video model (Wan I2V) starts every
    clip from ``image``, its first frame, resized to width × height."""
    conditioning, negative_said = with_negative(handle, read_positive(handle, positive), negative)
    if conditioning.guidance is not None:
        guidance_scale = conditioning.guidance
    if on_conditioning is not None:
        said = f"positive: {conditioning.source}"
        if conditioning.guidance is not None and not handle.family.true_cfg:
            said += " (its guidance replaces guidance_scale)"
        on_conditioning("; ".join(filter(None, (said, negative_said))))
    references = read_reference_images(
        handle, {"image": image, "image_2": image_2, "image_3": image_3}, (width, height)
    )
    image = read_latent_image(handle, latent_image) if latent_image is not None else None
    validate_sample(
        handle,
        conditioning,
        steps=steps,
        width=width,
        height=height,
        batch_size=batch_size,
        guidance_scale=guidance_scale,
        true_cfg_scale=true_cfg_scale,
        denoise=denoise,
        latent_image=image,
        sampler=sampler,
        scheduler=scheduler,
        length=length,
        guidance_scale_2=guidance_scale_2,
        references=references,
    )
    chosen, schedule = _read_sampler(handle, sampler, scheduler)
    tensors = dict(conditioning.tensors)
    tensors.update({reference.input: reference.pixels for reference in references})
    # An edit model's images, which its text encoder read, go to its transformer too (their names are the encoder's).
    tensors.update({edit.name: edit.pixels for edit in conditioning.images})
    if image is not None:
        width, height = image.width, image.height
        tensors["latent_image"] = image.samples
        if image.noise_mask is not None:
            tensors["noise_mask"] = image.noise_mask
    sampling = Sampling(
        seed=seed,
        steps=steps,
        guidance_scale=guidance_scale,
        width=width,
        height=height,
        # the backend counts images, prompt by prompt
        batch_size=batch_size * conditioning.count,
        true_cfg_scale=true_cfg_scale if handle.family.true_cfg else None,
        denoise=denoise if image is not None else 1.0,
        sampler=chosen,
        scheduler=schedule,
        frames=length,
        guidance_scale_2=guidance_scale_2 or None,
    )
    result = get_backend(handle.backend).call(
        DenoiseArgs(transformer=handle.spec, sampling=sampling),
        tensors,
        on_progress=on_progress,
        should_cancel=should_cancel,
    )
    if on_cache_report is not None and result.result.cache is not None:
        on_cache_report(result.result.cache)
    if on_result is not None:
        on_result(result.result)
    return result.tensors["samples"]
