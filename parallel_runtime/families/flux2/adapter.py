"""FLUX.2: ``Flux2Pipeline``, a Mistral 3 text encoder, a 32-channel VAE with batch-norm statistics.

Between the stages travel ComfyUI's types:

- embeddings: ``prompt_embeds`` [B, T, 3 x hidden] (three Mistral hidden states stacked; T = max_sequence_length,
  system prompt included), on the CPU. FLUX.2 has one text encoder, no pooled embedding and no true CFG;
- LATENT samples: [B, 128, H/16, W/16] for the real 32-channel VAE: the VAE's latents in 2x2 patches and normalised
  with the VAE's batch-norm statistics. That is ComfyUI's convention for FLUX.2 (``latent_formats.Flux2``: 128
  channels, 16x downscale, no scale / shift, because ComfyUI's FLUX.2 VAE patchifies and applies the batch-norm
  itself), and it is also the pipeline's own latent space, so nothing is converted on the way out of the denoiser;
- IMAGE: [B, H, W, 3] float32 in 0..1, on the CPU.

FLUX.2-dev also takes reference images (``Flux2Pipeline(image=[...])``): each VAE-encoded, its tokens after the
image's in the transformer's sequence, reference i at the ids' time coordinate T = 10 + 10·i; the output is cut back
to the image's tokens. They are optional: without them FLUX.2 makes images from text alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch

from ...wire import Prompts, Sampling
from ..base import (
    FamilyAdapter,
    LatentLayout,
    OnStep,
    Placement,
    check_size,
    comfy_image,
    expand_batch,
    generators,
    img2img_steps,
    load_placed,
    pil_images,
    scheduler_for,
    step_callback,
    vae_pixels,
)


class Flux2(FamilyAdapter):
    key = "flux2"
    name = "FLUX.2"
    pipeline = "Flux2Pipeline"
    # Flux2Pipeline's tokenizer_max_length, the chat template's system message included.
    max_sequence_length = 512
    pads_text = True
    latent = LatentLayout(ndims=(4,), vae_channels_key="latent_channels", channels_per_vae_channel=4, downscale=16)
    comfy_text_encoder = ("CLIPLoader", "flux2", "CLIPTextEncode")
    # diffusers takes any number; three inputs on the sampler cover the usual subject, style and scene, and each
    # reference of up to a megapixel adds up to 4096 tokens (a 1024² output's count): three already make a 1024²
    # image's sequence four times as long, its attention about sixteen times the work.
    reference_images: ClassVar[int] = 3

    def denoise_components(self, references: bool) -> tuple[str, ...]:
        return ("vae",) if references else ()  # it encodes the references

    def reference_size(self, width: int, height: int) -> tuple[int, int]:
        """What ``Flux2Pipeline`` makes of a reference image: refused under 64 pixels a side or beyond 8:1
        (``Flux2ImageProcessor.check_image_input``), scaled down to a megapixel when larger (its sides truncated),
        then center-cropped to whole 16-pixel tokens."""
        if min(width, height) < _REFERENCE_MIN_SIDE:
            raise ValueError(
                f"is {width}×{height}; {self.name}'s pipeline takes reference images of at least "
                f"{_REFERENCE_MIN_SIDE} pixels a side: scale it up (ImageScale)"
            )
        if max(width, height) > _REFERENCE_MAX_ASPECT * min(width, height):
            raise ValueError(
                f"is {width}×{height}, more than {_REFERENCE_MAX_ASPECT}:1, which {self.name}'s pipeline refuses; "
                "crop it (ImageCrop)"
            )
        if width * height > _REFERENCE_MAX_AREA:
            scale = math.sqrt(_REFERENCE_MAX_AREA / (width * height))
            width, height = int(width * scale), int(height * scale)
        multiple = self.pixels_per_token
        return width // multiple * multiple, height // multiple * multiple

    def load_text_encoders(self, model_dir: str, dtype: torch.dtype, placement: Placement) -> Any:
        from diffusers import Flux2Pipeline

        return load_placed(
            Flux2Pipeline, model_dir, dtype, placement, "FLUX.2 text encoder", transformer=None, vae=None
        )

    @torch.no_grad()
    def encode(self, pipe: Any, prompts: Prompts) -> dict[str, torch.Tensor]:
        """Mistral 3, one row per prompt. ``max_sequence_length`` counts the chat template's system message too: the
        pipeline pads / cuts the whole conversation to it."""
        if prompts.prompts_2 is not None:
            raise ValueError("FLUX.2 has one text encoder; prompt_2 has nothing to feed.")
        prompt_embeds, _text_ids = pipe.encode_prompt(
            prompt=list(prompts.prompts), max_sequence_length=prompts.max_sequence_length
        )
        # `_text_ids` are position ids derived from the sequence length; the denoise stage rebuilds them.
        return {"prompt_embeds": prompt_embeds.cpu()}

    def transformer_class(self) -> type:
        from diffusers import Flux2Transformer2DModel

        return Flux2Transformer2DModel

    @torch.no_grad()
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
        image: torch.Tensor | None = None,
        image_2: torch.Tensor | None = None,
        image_3: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """LATENT samples [batch_size, 4 x VAE channels, height/16, width/16]. ``guidance_scale`` is FLUX.2-dev's
        distilled guidance (an embedding, not CFG). diffusers has no FLUX.2-dev img2img pipeline: given a latent
        image, ``Flux2Pipeline`` runs the tail of its schedule from the noised image (``from_image``).

        ``image``, ``image_2``, ``image_3``: reference IMAGEs [1, H, W, 3] in 0..1, the same for every image made,
        handed to ``Flux2Pipeline`` in that order as the PIL images ComfyUI's LoadImage read, so that it resizes
        them as it does any loaded image (``reference_size``)."""
        from diffusers import Flux2Pipeline

        check_size(self, sampling)
        references = self.reference_pictures(latent_image, image, image_2, image_3)
        scheduler = scheduler_for(model_dir, sampling)
        # The pipeline encodes the references itself (the posterior's argmax); the VAE is small and loads here, in
        # the transformer's dtype, which is the one the pipeline hands it the pixels in.
        vae = self.load_vae(model_dir, transformer.dtype, str(transformer.device)) if references else None
        pipe = Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer)
        pipe.set_progress_bar_config(disable=True)
        device = pipe._execution_device
        # Passed-in embeddings are used as given (the pipeline repeats only what it encodes itself), and their dtype
        # sets the latents' dtype.
        prompt_embeds = expand_batch(embeds, sampling.batch_size)["prompt_embeds"].to(
            device=device, dtype=transformer.dtype
        )
        schedule: dict[str, Any] = {"num_inference_steps": sampling.steps}
        on_step_end = step_callback(on_step)
        if latent_image is not None:
            pipe.scheduler, schedule, on_step_end = from_image(
                scheduler, sampling, latent_image, noise_mask, prompt_embeds.dtype, device, on_step_end
            )
        packed = pipe(
            prompt_embeds=prompt_embeds,
            guidance_scale=sampling.guidance_scale,
            height=sampling.height,
            width=sampling.width,
            generator=generators(sampling.seed, sampling.batch_size),
            output_type="latent",
            callback_on_step_end=on_step_end,
            **({"image": references} if references else {}),
            **schedule,
        ).images
        return comfy_latent(packed, sampling)

    def reference_pictures(self, latent_image: torch.Tensor | None, *images: torch.Tensor | None) -> list[Any]:
        """The reference IMAGEs given, in order, as the PIL images the pipelines take (``pil_images``); refused beside
        a latent image, which the pipelines have no img2img for."""
        references = [pil_images(pixels)[0] for pixels in images if pixels is not None]
        if references and latent_image is not None:
            raise ValueError(f"{self.name} starts from noise beside reference images (no img2img with them).")
        return references

    def lora_state_dict(self, path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, dict | None]:
        """Flux2Pipeline's reading, with one correction: diffusers 0.42.1 maps a BFL-layout (``diffusion_model.``)
        ``final_layer.adaLN_modulation.1`` to ``norm_out.linear`` without swapping its halves, although BFL's final
        layer puts shift before scale and diffusers' after (its converter of the base checkpoint swaps them)."""
        from safetensors import safe_open

        state_dict, alphas, metadata = super().lora_state_dict(path)
        converted = "transformer.norm_out.linear.lora_B.weight"
        with safe_open(path, framework="pt") as f:
            if converted in state_dict and "diffusion_model.final_layer.adaLN_modulation.1.lora_B.weight" in f.keys():
                shift, scale = state_dict[converted].chunk(2, dim=0)
                state_dict[converted] = torch.cat([scale, shift])
        return state_dict, alphas, metadata

    def load_vae(self, model_dir: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
        from diffusers import AutoencoderKLFlux2

        return load_placed(AutoencoderKLFlux2, model_dir, dtype, Placement(device), "FLUX.2 VAE", subfolder="vae")

    @torch.no_grad()
    def decode(self, vae: torch.nn.Module, samples: torch.Tensor) -> torch.Tensor:
        """LATENT samples (normalised 2x2 patches, ComfyUI's FLUX.2 convention) to an IMAGE."""
        from diffusers import Flux2Pipeline

        # What Flux2Pipeline does before `vae.decode`, in float32 so the statistics add no rounding of their own.
        latents = samples.to(device=vae.device, dtype=torch.float32)
        bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        variance = vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps
        bn_std = torch.sqrt(variance).to(latents.device, latents.dtype)
        latents = Flux2Pipeline._unpatchify_latents(latents * bn_std + bn_mean)
        return comfy_image(vae.decode(latents.to(vae.dtype), return_dict=False)[0])

    @torch.no_grad()
    def encode_image(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """The posterior's mode in 2x2 patches, normalised with the VAE's batch-norm statistics (ComfyUI's FLUX.2
        LATENT): what ``Flux2Pipeline._encode_vae_image`` makes of an image, in float32."""
        from diffusers import Flux2Pipeline

        posterior = vae.encode(vae_pixels(pixels, vae.device, vae.dtype)).latent_dist
        latents = Flux2Pipeline._patchify_latents(posterior.mode().float())
        bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
            latents.device, latents.dtype
        )
        return ((latents - bn_mean) / bn_std).cpu()


# Flux2Pipeline's limits on a reference image: Flux2ImageProcessor.check_image_input's defaults, and the area
# __call__ scales a larger one down to.
_REFERENCE_MIN_SIDE, _REFERENCE_MAX_ASPECT, _REFERENCE_MAX_AREA = 64, 8, 1024 * 1024


def comfy_latent(packed: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The denoiser's packed latents [B, h*w, C] as ComfyUI's FLUX.2 LATENT [B, C, h, w]: `_pack_latents` undone
    (tokens in raster order; the pipelines' `_unpack_latents_with_ids` scatters by position ids to the same place). No
    batch-norm de-normalisation: ComfyUI's FLUX.2 LATENT is the normalised, patchified latent and its VAE applies the
    statistics when decoding. In float32, ComfyUI's LATENT dtype, even for a bf16 transformer."""
    packed = packed.float()
    latent_height, latent_width = sampling.height // 16, sampling.width // 16
    return packed.permute(0, 2, 1).reshape(packed.shape[0], packed.shape[2], latent_height, latent_width).cpu()


def from_image(
    scheduler: Any,
    sampling: Sampling,
    latent_image: torch.Tensor,
    noise_mask: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
    on_step_end: Callable[..., dict],
) -> tuple[Any, dict[str, Any], Callable[..., dict]]:
    """Img2img (and inpainting) on ``Flux2Pipeline`` (and [klein]'s ``Flux2KleinPipeline``), with the mechanics of
    diffusers' img2img pipelines and of its FLUX.2 inpaint pipeline (``Flux2KleinInpaintPipeline``, whose
    reference-image conditioning is Klein's own):

    - the ``steps``-step schedule Flux2Pipeline would set (its ``mu`` depends on the step count), cut where the
      strength says (``get_timesteps``); the pipeline runs that tail, through a scheduler that takes the already
      shifted sigmas as they are;
    - the noise the pipeline would draw, scaled into the image at the tail's first sigma (``scale_noise``), as the
      pipeline's starting latents;
    - with a mask, after every step the unmasked area is put back to the image noised to the next step's sigma (the
      clean image after the last), the mask binarised at 0.5 and resized bilinearly to the token grid, as the inpaint
      pipeline does.

    The pipeline's scheduler, its schedule arguments and its step callback."""
    from diffusers import Flux2Pipeline
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps
    from diffusers.utils.torch_utils import randn_tensor

    steps, batch_size = sampling.steps, sampling.batch_size
    latent_height, latent_width = sampling.height // 16, sampling.width // 16
    sigmas = np.linspace(1.0, 1 / steps, steps)
    mu = compute_empirical_mu(image_seq_len=latent_height * latent_width, num_steps=steps)
    timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
    t_start = steps - img2img_steps(steps, sampling.denoise)
    image = latent_image.to(device=device, dtype=dtype)
    image = torch.cat([image] * (batch_size // image.shape[0]))  # a latent of batch 1 serves every image
    noise = randn_tensor(
        (batch_size, image.shape[1], latent_height, latent_width),
        generator=generators(sampling.seed, sampling.batch_size),
        device=device,
        dtype=dtype,
    )
    scheduler.set_begin_index(t_start)
    start = scheduler.scale_noise(image, timesteps[t_start : t_start + 1].repeat(batch_size), noise)
    # Every transform of the sigmas off: the tail is already shifted (and stretched, were it configured).
    tail = type(scheduler).from_config(
        scheduler.config,
        use_dynamic_shifting=False,
        shift=1.0,
        shift_terminal=None,
        use_karras_sigmas=False,
        use_exponential_sigmas=False,
        use_beta_sigmas=False,
    )
    schedule = {"latents": start, "sigmas": scheduler.sigmas[t_start:-1].tolist()}
    if noise_mask is None:
        return tail, schedule, on_step_end

    processor = Flux2ImageProcessor(vae_scale_factor=16, do_normalize=False, do_binarize=True, do_convert_rgb=False,
                                    do_convert_grayscale=True)  # fmt: skip
    mask = processor.preprocess(noise_mask.float(), height=sampling.height, width=sampling.width)
    mask = torch.nn.functional.interpolate(mask, size=(latent_height, latent_width), mode="bilinear")
    mask = mask.to(device=device, dtype=dtype)
    mask = Flux2Pipeline._pack_latents(mask.repeat(batch_size // mask.shape[0], 1, 1, 1))
    packed_image, packed_noise = Flux2Pipeline._pack_latents(image), Flux2Pipeline._pack_latents(noise)

    def blend(pipeline: Any, step_index: int, timestep: torch.Tensor, callback_kwargs: dict) -> dict:
        proper = packed_image
        if step_index < len(pipeline.scheduler.timesteps) - 1:
            next_timestep = pipeline.scheduler.timesteps[step_index + 1]
            proper = pipeline.scheduler.scale_noise(packed_image, torch.tensor([next_timestep]), packed_noise)
        latents = (1 - mask) * proper + mask * callback_kwargs["latents"]
        on_step_end(pipeline, step_index, timestep, callback_kwargs)
        return {"latents": latents}

    return tail, schedule, blend
