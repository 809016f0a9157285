"""The interface every model family implements (``FamilyAdapter``), and what the adapters share.

A family knows everything that differs between models: its name for users, its diffusers pipeline, the rules the
client checks widgets against, its LATENT layout in ComfyUI's convention, its stages on the ranks (load and run the
text encoders, the transformer, the VAE); its tiny test model is built by its folder's ``tiny.py``, which no adapter
imports. The client reads only the declarations (class attributes), so importing a family loads no diffusers model
code at ComfyUI's start-up; the stage methods import diffusers when a rank first calls them.

Each stage runs the family's real diffusers pipeline with the other components set to None (the staged recipe of
diffusers' distributed-inference guide), so the staged result equals the one-shot pipeline for the same seed.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..samplers import SAMPLERS, SCHEDULERS, Sampler
from ..wire import Prompts, Sampling

log = logging.getLogger(__name__)

# ParallelSampler's reference IMAGE inputs, in the order their images enter the transformer's sequence: a family takes
# the first ``reference_images`` of them.
REFERENCE_INPUTS = ("image", "image_2", "image_3")
# The images an edit model's text encoder reads (EncodeOnBalancedGPUs' inputs, only for the families with
# ``encoder_images``): to the encode stage, then with the conditioning to the denoise, whose transformer reads them too,
# under the reference inputs' names (a family reads its images from one node or the other, never both).
ENCODER_IMAGES = REFERENCE_INPUTS
# The denoise stage's image inputs, by the names they travel under beside the embeddings (and the keyword arguments
# of ``FamilyAdapter.denoise``): a LATENT of the family, a mask of where to repaint (img2img and inpainting), and the
# reference images (the sampler's for the families with ``reference_images``, the encoder's with ``encoder_images``).
IMAGE_INPUTS = ("latent_image", "noise_mask", *REFERENCE_INPUTS)

OnStep = Callable[[int, int], None]  # (step index from 0, total steps); raising stops the loop (how a cancel works)


@dataclasses.dataclass(frozen=True)
class LatentLayout:
    """A family's LATENT in ComfyUI's convention.

    Args:
        ndims: the tensor ranks accepted, the one the pack makes first (Qwen-Image: 5-D, one video frame).
        vae_channels_key: the VAE config's key for its latent channels.
        channels_per_vae_channel: LATENT channels per VAE channel (FLUX.2 stores 2x2 patches: 4).
        downscale: image pixels per LATENT pixel along each side.
        temporal_downscale: video frames per LATENT frame after the first (Wan's VAE: 4; an image family's clip is
            its one frame).
    """

    ndims: tuple[int, ...]
    vae_channels_key: str
    channels_per_vae_channel: int = 1
    downscale: int = 8
    temporal_downscale: int = 1

    def frames(self, frames: int) -> int:
        """LATENT frames of a clip of ``frames`` frames: the first frame alone, then one per ``temporal_downscale``."""
        return (frames - 1) // self.temporal_downscale + 1

    def channels(self, vae_config: dict) -> int | None:
        """LATENT channels for a VAE with this config (None when the config does not say)."""
        vae_channels = vae_config.get(self.vae_channels_key)
        return vae_channels * self.channels_per_vae_channel if vae_channels else None


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a stage's components go: onto ``device``, or spread by ``device_map`` ("balanced" for a pipeline of text
    encoders, "auto" for one model; the recipes of diffusers' guide) within ``max_memory`` per device."""

    device: str
    device_map: str | None = None
    max_memory: dict[int | str, str | int] | None = None  # sizes as "16GB" or bytes

    def from_pretrained_kwargs(self, what: str) -> dict[str, Any]:
        """``from_pretrained`` keyword arguments; empty when the component loads whole onto ``device``.

        On CPU a ``device_map`` is dropped (and logged): diffusers' pipeline-level "balanced" silently does nothing
        there, "auto" raises NotImplementedError and a GPU ``max_memory`` raises without an accelerator. Skipping it
        keeps the CPU mode on the same code path as the GPU one.
        """
        if self.device_map is None:
            return {}
        if torch.device(self.device).type == "cpu":
            log.info("%s: device_map=%r skipped on CPU; loading on the CPU.", what, self.device_map)
            return {}
        return {"device_map": self.device_map, **({"max_memory": self.max_memory} if self.max_memory else {})}


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """How tensor parallelism splits a transformer: diffusers' ``_tp_plan``, or one the pack writes for a class that
    has none (``families/<key>/tp_plan.py``, listed in ``families.TP_PLANS``), with what such a plan needs beyond it.

    Args:
        layers: diffusers' ``_tp_plan`` form: module globs (one ``*`` over a ModuleList) to "colwise" / "rowwise" (or
            diffusers' packed styles). A planned layer that a model's config leaves out (None in its block, as
            Wan T2V's image projections) is not split.
        head_norms: RMSNorms over the whole width of a colwise layer's output (all the heads): each rank normalises
            its own columns, with the mean square summed over the TP ranks (by ``worker/tp_slices.py``), so it
            equals the norm of the whole row. Without that sum each rank would divide by its own heads' mean square:
            a run that is silently wrong.
        head_counts: attention modules whose processor splits a projection into ``heads`` (``unflatten(2, (heads,
            -1))``): ``heads`` becomes the rank's share.
        widths: config keys of the widths the plan splits besides the attention heads, with the user's word for
            each ("feed-forward width"): the strategy refuses a ``tp_degree`` that does not divide one, by name,
            before anything loads.
    """

    layers: dict[str, Any]
    head_norms: tuple[str, ...] = ()
    head_counts: tuple[str, ...] = ()
    widths: dict[str, str] = dataclasses.field(default_factory=dict)

    def style_of(self, key: str) -> tuple[Any, str] | None:
        """(the plan's style, "weight" / "bias") of a model key whose layer a glob of ``layers`` names, else None."""
        module, _, name = key.rpartition(".")
        for pattern, style in self.layers.items():
            if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), module):
                return style, name
        return None

    def splits(self, key: str) -> bool:
        """Whether a rank holds only its slice of ``key``: a planned layer's weight, and its bias unless the layer is
        rowwise (a rowwise bias is added after the all-reduce, so every rank keeps it whole)."""
        found = self.style_of(key)
        if found is None:
            return False
        style, name = found
        return name == "weight" or not (style == "rowwise" or type(style).__name__ == "PackedRowwiseParallel")


class FamilyAdapter(abc.ABC):
    """One model family: declarations the client validates against, and the stages the ranks run.

    Declarations (class attributes):
        key: the registry's and the wire's name ("flux").
        name: the family's name for users ("FLUX.1").
        pipeline: the diffusers pipeline class, as ``model_index.json``'s ``_class_name`` names it.
        index_flag: a ``model_index.json`` flag that tells this family's folders from those of another family with
            the same ``pipeline`` (Wan 2.2 TI2V-5B's ``expand_timesteps``, a ``WanPipeline`` as Wan's): set, it is
            this family's folder; None where the class alone tells (``families.for_pipeline``).
        text_encoders: 2 when ``prompt_2`` feeds a second encoder.
        max_sequence_length: the longest prompt the pipeline takes, in tokens.
        pads_text: prompts are padded to ``max_sequence_length``; otherwise they keep their own length.
        true_cfg: a negative prompt and ``true_cfg_scale``: two transformer passes per step.
        splits_text: context parallelism splits the text tokens too (Wan's ``_cp_plan`` leaves them whole), so their
            count must divide over the ranks.
        takes_latent_image: the sampler can start from a ``latent_image`` (the family has img2img and inpainting).
        samplers: the ``sampler`` choices its folders' scheduler config serves (UniPC only reads Wan's).
        min_steps, min_steps_reason: the fewest steps that give an image, and why (for the error).
        latent: the LATENT layout.
        pixels_per_token: image pixels per transformer token along each side (8x VAE, 2x2 patches: 16).
        comfy_text_encoder: how ComfyUI loads and runs the family's text encoders: the loader node, its ``type``
            widget, the prompt nodes (ParallelSampler checks a CONDITIONING's loader against it, and its errors say it);
            None where the pack has not mapped them (the graph's loader is then not checked, only the shapes).
        pooled_text: the transformer also takes a pooled text embedding (``pooled_prompt_embeds``; ComfyUI's
            CONDITIONING carries it as ``pooled_output``).
        text_mask: the embeddings travel with their mask (``prompt_embeds_mask``; ComfyUI's ``attention_mask``).
        reference_images: how many reference images the sampler takes (its first ``reference_images`` of
            ``REFERENCE_INPUTS``), which the transformer reads in its sequence after the image's own tokens; 0: none.
            Such a family's ``reference_size`` gives the size the pipeline runs each at, and its ``denoise`` takes
            them by their inputs' names.
        needs_reference: the first reference (``image``) must be given: the model edits it (Kontext) or starts its
            clip from it (Wan I2V); otherwise the references are optional and the model also makes images from text
            alone (FLUX.2).
        reference_per_image: a reference input may hold one image per image made (Kontext's pipeline pairs them);
            otherwise each holds one image, the same reference for the whole batch (FLUX.2's pipeline repeats it).
        first_frame: the ``image`` is the clip's first frame (Wan I2V), not a reference in the transformer's
            sequence: one image starts every clip, resized to the output's width × height, and it adds no tokens
            (it enters through the transformer's input channels).
        encoder_images: how many images EncodeOnBalancedGPUs' image inputs (``ENCODER_IMAGES``) take, of which at
            least one must be given: the text encoder sees them (at ``condition_size``), and they travel with the
            conditioning to the denoise, whose transformer reads their VAE latents (at ``reference_size``) in its
            sequence (Qwen-Image-Edit); 0: none.
        block_lists: the transformer config's block counts and the weights' prefix of each block list (diffusers'
            DiT convention by default): the client checks them against the weights before it builds anything from
            the config (a config asking for 10,000 layers would take minutes and gigabytes to build).
        taylorseer_layers: the layers the ``taylorseer`` step cache predicts (regular expressions of module names,
            diffusers' ``cache_identifiers``); None: diffusers' defaults, which match FLUX's and Qwen-Image's
            attention modules (``transformer_blocks.N.attn``) but none of Wan's (``blocks.N.attn1``).
        decode_copies: how many of its first-level feature maps (``decoder_channels`` × one frame's pixels) the VAE's
            decode holds at its peak; None: ``estimates.VAE_COPIES``, measured on the image VAEs.
    """

    key: ClassVar[str]
    name: ClassVar[str]
    pipeline: ClassVar[str]
    index_flag: ClassVar[str | None] = None
    text_encoders: ClassVar[int] = 1
    max_sequence_length: ClassVar[int]
    pads_text: ClassVar[bool]
    true_cfg: ClassVar[bool] = False
    splits_text: ClassVar[bool] = True
    takes_latent_image: ClassVar[bool] = True
    samplers: ClassVar[tuple[Sampler, ...]] = (Sampler.EULER, Sampler.LCM)
    min_steps: ClassVar[int] = 1
    min_steps_reason: ClassVar[str] = "would not denoise anything"
    latent: ClassVar[LatentLayout]
    pixels_per_token: ClassVar[int] = 16
    comfy_text_encoder: ClassVar[tuple[str, str, str] | None] = None
    pooled_text: ClassVar[bool] = False
    text_mask: ClassVar[bool] = False
    reference_images: ClassVar[int] = 0
    needs_reference: ClassVar[bool] = False
    reference_per_image: ClassVar[bool] = False
    first_frame: ClassVar[bool] = False
    encoder_images: ClassVar[int] = 0
    block_lists: ClassVar[dict[str, str]] = {
        "num_layers": "transformer_blocks",
        "num_single_layers": "single_transformer_blocks",
    }
    taylorseer_layers: ClassVar[tuple[str, ...] | None] = None
    decode_copies: ClassVar[int | None] = None

    @classmethod
    def comfy_text_encoder_words(cls) -> str:
        """``comfy_text_encoder`` in words, for errors: "DualCLIPLoader (type flux) into CLIPTextEncode"."""
        if cls.comfy_text_encoder is None:
            return f"ComfyUI's text encoder of {cls.name}"
        loader, clip_type, prompt_nodes = cls.comfy_text_encoder
        return f"{loader} (type {clip_type}) into {prompt_nodes}"

    def takes_cfg(self, model_index: dict) -> bool:
        """Whether the model whose ``model_index.json`` this is runs true CFG (two passes a step): the family's
        ``true_cfg``, unless the checkpoint is step-distilled (FLUX.2 [klein]'s ``is_distilled``)."""
        return self.true_cfg

    def cfg_refusal(self, model_dir: str, true_cfg_scale: float) -> str | None:
        """Why the model in ``model_dir`` takes no true CFG at ``true_cfg_scale`` although its family does (a
        step-distilled checkpoint), with the fix; None when it takes it. Read from the folder's configs only, so the
        client asks before anything loads and the ranks again before they run."""
        return None

    def reference_size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) a reference image of this size runs at (families with ``reference_images``): the
        pipeline's own resizing. ValueError, with the reason and the fix, for a size the pipeline refuses."""
        raise NotImplementedError(f"{self.name} takes no reference image")

    def condition_size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) the text encoder sees an image of this size at (families with ``encoder_images``)."""
        raise NotImplementedError(f"{self.name}'s text encoder reads no image")

    def denoise_components(self, references: bool) -> tuple[str, ...]:
        """The folder's components (subfolders) the denoise loads beside the transformer, on the transformer's device,
        and lets go of after it: the VAE that encodes the reference images or a clip's start image, Wan 2.1 I2V's
        CLIP image encoder. ``references``: the run has reference images. Their weights count in the denoise's memory
        (``worker/memory.py``, the advisor); one the folder lacks (Wan 2.2 I2V's image encoder) counts nothing."""
        return ()

    # -- stages (on the ranks) --------------------------------------------------------------------------------
    @abc.abstractmethod
    def load_text_encoders(self, model_dir: str, dtype: torch.dtype, placement: Placement) -> Any:
        """The pipeline with only its tokenizers and text encoders."""

    @abc.abstractmethod
    def encode(self, pipe: Any, prompts: Prompts) -> dict[str, torch.Tensor]:
        """Embeddings on the CPU, one row per prompt (and per negative prompt, for true CFG)."""

    @abc.abstractmethod
    def transformer_class(self) -> type:
        """The diffusers transformer class (context / tensor parallel loads build it themselves)."""

    def transformer_subfolders(self, model_dir: str) -> tuple[str, ...]:
        """The folder's transformers the denoise runs, by subfolder: one, or Wan 2.2 A14B's two experts (the second
        reaches ``denoise`` as its ``transformer_2`` keyword)."""
        return ("transformer",)

    def load_transformer(
        self, model_dir: str, dtype: torch.dtype, placement: Placement, subfolder: str = "transformer"
    ) -> torch.nn.Module:
        """A transformer (``subfolder``) alone, on one device or spread with ``device_map="auto"``."""
        return load_placed(
            self.transformer_class(), model_dir, dtype, placement, f"{self.name} {subfolder}", subfolder=subfolder
        )

    @abc.abstractmethod
    def denoise(
        self,
        model_dir: str,
        transformer: torch.nn.Module,
        embeds: dict[str, torch.Tensor],
        sampling: Sampling,
        on_step: OnStep | None = None,
        *,
        latent_image: torch.Tensor | None = None,
        noise_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The denoising loop: LATENT samples in ComfyUI's convention (float32, CPU) for ``sampling.batch_size``
        images, image i from a generator seeded ``sampling.seed + i``.

        With ``latent_image`` (a LATENT of this family, batch 1 or ``batch_size``, its size ``sampling``'s), img2img
        as the family's diffusers img2img pipeline does it, ``sampling.denoise`` its strength; with ``noise_mask``
        too (``[1 or batch_size, 1, H, W]``, any size of the latent's aspect ratio), inpainting as its inpaint
        pipeline does it: binarised at 0.5, only where it is 1 is repainted."""

    def lora_state_dict(self, path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, dict | None]:
        """diffusers' reading of a LoRA file (safetensors only) for this family: its pipeline's ``lora_state_dict``,
        which converts the layouts LoRAs are published in to diffusers' keys. ``(state dict, network alphas, adapter
        metadata)``; families whose pipeline bakes the alphas into the weights give None for them."""
        import diffusers

        pipeline = getattr(diffusers, self.pipeline)
        state_dict, metadata = pipeline.lora_state_dict(path, use_safetensors=True, return_lora_metadata=True)
        return state_dict, None, metadata

    @abc.abstractmethod
    def load_vae(self, model_dir: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
        """The VAE on one device (it is small; the guide never splits it)."""

    @abc.abstractmethod
    def decode(self, vae: torch.nn.Module, samples: torch.Tensor) -> torch.Tensor:
        """LATENT samples to an IMAGE [B, H, W, 3] float32 in 0..1 on the CPU."""

    @abc.abstractmethod
    def encode_image(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """An IMAGE [B, H, W, 3] in 0..1 (sides multiples of ``pixels_per_token``) to LATENT samples in ComfyUI's
        convention (float32, CPU): the posterior's mode, so the same image always gives the same latent."""

    def decoder_channels(self, vae_config: dict) -> int:
        """Channels of the VAE decoder's first-level (full-resolution) feature maps, for the memory estimate."""
        return vae_config["block_out_channels"][0]


# -- what the adapters share -------------------------------------------------------------------------------------
def load_placed(cls: Any, model_dir: str, dtype: torch.dtype, placement: Placement, what: str, **kwargs: Any) -> Any:
    """``cls.from_pretrained(model_dir, dtype=dtype, **kwargs)`` placed as ``placement`` says: spread by its
    ``device_map``, or moved whole to its ``device``. Safetensors only: a pickle file beside them is never read."""
    placed = placement.from_pretrained_kwargs(what)
    loaded = cls.from_pretrained(model_dir, dtype=dtype, use_safetensors=True, **kwargs, **placed)
    if "device_map" not in placed:
        loaded.to(placement.device)
    return loaded


def expand_batch(embeds: dict[str, torch.Tensor], batch_size: int) -> dict[str, torch.Tensor]:
    """One row per image: every conditioning tensor holds one row per prompt, repeated here for that prompt's
    ``batch_size / prompts`` images, prompt by prompt (the order of the pipelines' ``num_images_per_prompt``)."""
    prompts = next(iter(embeds.values())).shape[0]
    if batch_size % prompts:
        raise ValueError(f"batch_size {batch_size} is not a multiple of the number of prompts {prompts}.")
    return {name: tensor.repeat_interleave(batch_size // prompts, dim=0) for name, tensor in embeds.items()}


def scheduler_for(model_dir: str, sampling: Sampling) -> Any:
    """The diffusers scheduler of ParallelSampler's ``sampler`` with its ``scheduler`` schedule (``samplers``),
    configured as the model folder's own (its shift and dynamic shifting), for the family's pipeline to run.

    A sampler with ``step_noise`` seeds torch's global generator with the seed: the pipelines draw that noise from it,
    so every rank of a split image draws the same noise, a run repeats, and it equals diffusers' pipeline run after
    ``torch.manual_seed(seed)``."""
    import diffusers

    choice = SAMPLERS[sampling.sampler]
    scheduler_class = getattr(diffusers, choice.scheduler_class)
    config = scheduler_class.load_config(model_dir, subfolder="scheduler")
    # The folder's scheduler config is FlowMatchEulerDiscreteScheduler's (Wan's: UniPC's); another class takes what it
    # knows of it.
    known = inspect.signature(scheduler_class.__init__).parameters
    if "flow_shift" in config and "shift" in known:
        config["shift"] = config["flow_shift"]  # Wan's UniPC config names the flow-match shift flow_shift
    config = {name: value for name, value in config.items() if name in known}
    if choice.step_noise:
        torch.manual_seed(sampling.seed)
    return scheduler_class.from_config(config, **SCHEDULERS[sampling.scheduler].config)


def generators(seed: int, batch_size: int) -> list[torch.Generator]:
    """Image ``i`` draws its noise from its own CPU generator seeded ``seed + i`` (modulo 2^64, the generator's range):
    the same noise on every device and rank, and an image that does not depend on how a batch is split."""
    return [torch.Generator("cpu").manual_seed((seed + i) % 2**64) for i in range(batch_size)]


def step_callback(on_step: OnStep | None) -> Callable[..., dict]:
    """A pipeline's ``callback_on_step_end`` that calls ``on_step(step_index, total)`` after each step; an exception
    raised from ``on_step`` stops the loop, which is how a caller cancels."""

    def step_end(pipeline: Any, step_index: int, timestep: torch.Tensor, callback_kwargs: dict) -> dict:
        if on_step is not None:
            on_step(step_index, pipeline.num_timesteps)
        return {}

    return step_end


@dataclasses.dataclass(frozen=True)
class LaterExpert:
    """A model's later expert when the rank holds its experts one at a time (they do not fit together): the family's
    ``denoise`` takes it in the expert's place and calls ``load(steps_done)`` once the steps reach that expert, which
    frees the expert before it and returns this one, ready to run."""

    load: Callable[[int], torch.nn.Module]


def comfy_image(decoded: torch.Tensor) -> torch.Tensor:
    """A VAE's [B, 3, H, W] output in [-1, 1] as a ComfyUI IMAGE [B, H, W, 3] float32 in 0..1 on the CPU: the
    pipelines' own post-processing (clamped); only the layout is ComfyUI's."""
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor().postprocess(decoded, output_type="pt").permute(0, 2, 3, 1).float().cpu()


def img2img_steps(steps: int, denoise: float) -> int:
    """How many of a ``steps``-step schedule an img2img run at strength ``denoise`` makes: the count diffusers'
    img2img pipelines' ``get_timesteps`` gives: ``steps × denoise`` rounded up (up to float error), 0 only at 0."""
    return steps - int(max(steps - min(steps * denoise, steps), 0))


def image_pipeline(
    pipelines: tuple[type, type, type], image: torch.Tensor | None, noise_mask: torch.Tensor | None, denoise: float
) -> tuple[type, dict[str, Any]]:
    """Which of a family's (text-to-image, img2img, inpaint) pipelines a denoise runs, and the image arguments it
    takes: none without an image; the latent, normalised as the pipeline's ``_encode_vae_image`` normalises (a tensor
    of the VAE's latent channels is taken as it is), with ``strength`` = denoise; and the mask. The masked image's
    latents only feed Fill-style extra channels, which these pipelines do not have; given, the pipeline does not try
    to mask the latent-sized image with the pixel-sized mask."""
    text_to_image, img2img, inpaint = pipelines
    if image is None:
        return text_to_image, {}
    inputs = {"image": image, "strength": denoise}
    if noise_mask is None:
        return img2img, inputs
    return inpaint, {**inputs, "mask_image": noise_mask.float(), "masked_image_latents": image}


def vae_pixels(pixels: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """An IMAGE [B, H, W, 3] in 0..1 as a VAE's input [B, 3, H, W] in [-1, 1]: what the pipelines' image processor
    makes of a tensor image (``VaeImageProcessor.normalize``)."""
    return (pixels[..., :3].permute(0, 3, 1, 2) * 2.0 - 1.0).to(device=device, dtype=dtype)


def image_tokens(family: FamilyAdapter, width: int, height: int, frames: int = 1) -> int:
    """The transformer's image tokens for one clip (an image: one frame): LATENT frames × tokens per frame."""
    per_frame = (width // family.pixels_per_token) * (height // family.pixels_per_token)
    return family.latent.frames(frames) * per_frame


def reference_tokens(family: FamilyAdapter, width: int, height: int) -> int:
    """The transformer's tokens of a reference image given at ``width`` × ``height``: those of the size the family's
    pipeline runs it at (``FamilyAdapter.reference_size``); none for a clip's first frame, which enters through the
    transformer's input channels."""
    if family.first_frame:
        return 0
    return image_tokens(family, *family.reference_size(width, height))


def image_context_tokens(family: FamilyAdapter, image_encoder_config: dict | None) -> int:
    """Tokens the denoise's image encoder (one of ``denoise_components``; its ``config.json``, None where the folder
    has none) puts beside the text in the cross-attention's context: every position of a CLIP vision encoder's hidden
    states, the patches and the class token (Wan 2.1 I2V's ViT-H/14 at 224²: 257)."""
    if image_encoder_config is None or "image_encoder" not in family.denoise_components(True):
        return 0
    return (image_encoder_config["image_size"] // image_encoder_config["patch_size"]) ** 2 + 1


def pil_images(image: torch.Tensor) -> list[Any]:
    """An IMAGE [B, H, W, 3 or 4] in 0..1 as the 8-bit RGB PIL images it was loaded from (LoadImage divides by 255,
    so rounding gives the file's pixels back): what the edit pipelines take, so that they resize it as they do any
    loaded image."""
    from PIL import Image

    pixels = (image[..., :3].clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    return [Image.fromarray(row, mode="RGB") for row in pixels]


def latent_statistics(vae_config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A Wan 2.1-style video VAE's per-channel ``latents_mean`` and ``1 / latents_std`` as [1, C, 1, 1, 1], in the
    pipelines' own arithmetic: ComfyUI's LATENT for these VAEs is un-normalised (``latent_formats.Wan21`` normalises
    inside the model), the pipelines' latents are normalised."""
    channels = vae_config["z_dim"]
    mean = torch.tensor(vae_config["latents_mean"]).view(1, channels, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(vae_config["latents_std"]).view(1, channels, 1, 1, 1)
    return mean, inverse_std


def check_size(family: FamilyAdapter, sampling: Sampling) -> None:
    """With vae=None a pipeline assumes an 8x VAE and rounds a size down to its patches instead of failing, giving a
    latent of the wrong shape: refuse sizes that are not whole tokens."""
    step = family.pixels_per_token
    if sampling.height % step or sampling.width % step:
        raise ValueError(
            f"{family.name} needs width and height divisible by {step}, got {sampling.width}x{sampling.height}."
        )
