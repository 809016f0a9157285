"""Qwen-Image: ``QwenImagePipeline``, a Qwen2.5-VL text encoder, true classifier-free guidance, Wan 2.1's video VAE.

Between the stages travel ComfyUI's types:

- embeddings: ``prompt_embeds`` [B, T, hidden] and ``prompt_embeds_mask`` [B, T] (int64; 0 marks padding when prompts
  of different lengths share a batch), on the CPU. T is the prompt's own token count after the chat template's
  prefix, cut at max_sequence_length; it is not padded up to it. True CFG also needs ``negative_prompt_embeds`` /
  ``negative_prompt_embeds_mask`` (a length of their own);
- LATENT samples: [B, 16, 1, H/8, W/8], the VAE's own (un-normalised) latents with diffusers' 2x2 packing undone.
  That is ComfyUI's convention for Qwen-Image: its VAE is Wan 2.1's video VAE, so the latent is 5-D with one frame
  (``latent_formats.Wan21``, ``latent_dimensions = 3``), and the per-channel ``latents_mean`` / ``latents_std``
  normalisation lives in the model, not in the LATENT;
- IMAGE: [B, H, W, 3] float32 in 0..1, on the CPU.
"""

from __future__ import annotations

from typing import Any

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
    image_pipeline,
    latent_statistics,
    load_placed,
    scheduler_for,
    step_callback,
    vae_pixels,
)


def _encode(
    pipe: Any, prompts: tuple[str, ...], max_sequence_length: int, **inputs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    embeds, mask = pipe.encode_prompt(prompt=list(prompts), max_sequence_length=max_sequence_length, **inputs)
    # The pipeline drops an all-ones mask (None); keep one so every conditioning has the same tensors. Passed back in,
    # the pipeline drops it again, so the transformer sees exactly what the one-shot call gives it.
    if mask is None:
        mask = torch.ones(embeds.shape[:2], dtype=torch.long)
    return embeds.cpu(), mask.to(device="cpu", dtype=torch.long)


class QwenImage(FamilyAdapter):
    key = "qwenimage"
    name = "Qwen-Image"
    pipeline = "QwenImagePipeline"
    max_sequence_length = 1024  # QwenImagePipeline refuses more, and does not pad
    pads_text = False
    true_cfg = True
    # The scheduler's `shift_terminal` stretch divides by (1 - last sigma), which is 0 on a one-step schedule.
    min_steps = 2
    min_steps_reason = (
        "are too few for Qwen-Image: its scheduler's shift_terminal divides by zero on a one-step "
        "schedule and the image comes out NaN"
    )
    # A one-frame video latent [B, C, 1, h, w] (ComfyUI's Wan 2.1 format); a 4-D one is taken as that frame.
    latent = LatentLayout(ndims=(5, 4), vae_channels_key="z_dim")
    # ComfyUI has no Qwen-Image-only prompt node: TextEncodeQwenImageEdit without an image encodes as CLIPTextEncode.
    comfy_text_encoder = ("CLIPLoader", "qwen_image", "CLIPTextEncode")
    text_mask = True

    def load_text_encoders(self, model_dir: str, dtype: torch.dtype, placement: Placement) -> Any:
        import diffusers

        pipeline = getattr(diffusers, self.pipeline)  # an edit variant's also loads its processor
        return load_placed(
            pipeline, model_dir, dtype, placement, f"{self.name} text encoder", transformer=None, vae=None
        )

    @torch.no_grad()
    def encode(self, pipe: Any, prompts: Prompts, **inputs: Any) -> dict[str, torch.Tensor]:
        """The prompts and, for true CFG, the negative prompts ("" is a valid, empty one). Each list is encoded on its
        own, as the pipeline does, so their lengths may differ. ``inputs`` go to the pipeline's ``encode_prompt``
        with both (an edit pipeline's images)."""
        if prompts.prompts_2 is not None:
            raise ValueError(f"{self.name} has one text encoder; prompt_2 has nothing to feed.")
        embeds, mask = _encode(pipe, prompts.prompts, prompts.max_sequence_length, **inputs)
        out = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        negative = prompts.negative_prompts
        if negative is not None:
            if len(negative) != len(prompts.prompts):
                raise ValueError(
                    f"{len(negative)} negative prompts for {len(prompts.prompts)} prompts; give one per prompt."
                )
            out["negative_prompt_embeds"], out["negative_prompt_embeds_mask"] = _encode(
                pipe, negative, prompts.max_sequence_length, **inputs
            )
        return out

    def transformer_class(self) -> type:
        from diffusers import QwenImageTransformer2DModel

        return QwenImageTransformer2DModel

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
    ) -> torch.Tensor:
        """LATENT samples [batch_size, 16, 1, height/8, width/8]. True CFG runs when ``true_cfg_scale`` > 1 and the
        embeddings hold negative ones (the pipeline's rule): two transformer passes per step. ``guidance_scale`` only
        reaches guidance-distilled checkpoints (``guidance_embeds``); Qwen-Image itself has none. Given a latent image,
        ``QwenImageImg2ImgPipeline`` / ``QwenImageInpaintPipeline`` run instead."""
        import diffusers
        from diffusers import AutoencoderKLQwenImage, QwenImagePipeline

        check_size(self, sampling)
        if sampling.steps < self.min_steps:
            raise ValueError(f"Qwen-Image needs at least {self.min_steps} steps, got {sampling.steps}.")
        true_cfg_scale = sampling.true_cfg_scale or 1.0
        do_true_cfg = true_cfg_scale > 1 and "negative_prompt_embeds" in embeds
        mean, inverse_std = latent_statistics(AutoencoderKLQwenImage.load_config(model_dir, subfolder="vae"))
        image = None
        if latent_image is not None:
            # Normalised (ComfyUI's LATENT is not) and 4-D, the frame dropped: the pipelines' image processor passes
            # only a 4-D latent through untouched.
            frames = latent_image.float() if latent_image.ndim == 5 else latent_image.float().unsqueeze(2)
            image = ((frames - mean) * inverse_std)[:, :, 0]
        pipelines = (QwenImagePipeline, diffusers.QwenImageImg2ImgPipeline, diffusers.QwenImageInpaintPipeline)
        pipeline_class, image_inputs = image_pipeline(pipelines, image, noise_mask, sampling.denoise)
        pipe = pipeline_class(
            scheduler=scheduler_for(model_dir, sampling),
            vae=None,
            text_encoder=None,
            tokenizer=None,
            transformer=transformer,
        )
        pipe.set_progress_bar_config(disable=True)
        # Passed-in embeddings are used as given (the pipeline repeats only what it encodes itself), and their dtype
        # sets the latents' dtype.
        conditioning = pipeline_conditioning(pipe, expand_batch(embeds, sampling.batch_size), do_true_cfg)
        packed = pipe(
            **conditioning,
            true_cfg_scale=true_cfg_scale,
            # Passing a scale to a model without guidance embedding only earns a warning; None is the pipeline's unset.
            guidance_scale=sampling.guidance_scale if transformer.config.guidance_embeds else None,
            num_inference_steps=sampling.steps,
            height=sampling.height,
            width=sampling.width,
            # The embeddings were already cut at encode time; the pipeline cuts again at its default (512) otherwise.
            max_sequence_length=pipe.tokenizer_max_length,
            generator=generators(sampling.seed, sampling.batch_size),
            output_type="latent",
            callback_on_step_end=step_callback(on_step),
            **image_inputs,
        ).images
        return comfy_latents(packed, sampling, mean, inverse_std, pipe.vae_scale_factor)

    def load_vae(self, model_dir: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
        from diffusers import AutoencoderKLQwenImage

        return load_placed(
            AutoencoderKLQwenImage, model_dir, dtype, Placement(device), "Qwen-Image VAE", subfolder="vae"
        )

    @torch.no_grad()
    def decode(self, vae: torch.nn.Module, samples: torch.Tensor) -> torch.Tensor:
        """LATENT samples (un-normalised, [B, C, 1, h, w]; a 4-D [B, C, h, w] is taken as one frame) to an IMAGE."""
        if samples.ndim == 4:
            samples = samples.unsqueeze(2)
        if samples.shape[2] != 1:
            raise ValueError(f"Qwen-Image LATENTs hold one frame; got {samples.shape[2]} in {list(samples.shape)}.")
        return comfy_image(vae.decode(samples.to(device=vae.device, dtype=vae.dtype), return_dict=False)[0][:, :, 0])

    @torch.no_grad()
    def encode_image(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """The posterior's mode [B, 16, 1, h, w], un-normalised (ComfyUI's Qwen-Image LATENT): the image as a
        one-frame video, as the pipelines give it to the VAE."""
        posterior = vae.encode(vae_pixels(pixels, vae.device, vae.dtype).unsqueeze(2)).latent_dist
        return posterior.mode().float().cpu()

    def decoder_channels(self, vae_config: dict) -> int:
        return vae_config["base_dim"]  # Wan 2.1's VAE: base_dim × dim_mult per level, the first level at × 1


def pipeline_conditioning(pipe: Any, batch: dict[str, torch.Tensor], true_cfg: bool) -> dict[str, torch.Tensor]:
    """The embeddings as a Qwen-Image pipeline takes them: on its device, masks as int64, the rest in the
    transformer's dtype; the negative ones only with true CFG on (the pipeline warns of an unused negative prompt)."""
    names = ["prompt_embeds", "prompt_embeds_mask"]
    if true_cfg:
        names += ["negative_prompt_embeds", "negative_prompt_embeds_mask"]
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    return {
        name: batch[name].to(device=device, dtype=torch.long if name.endswith("_mask") else dtype) for name in names
    }


def comfy_latents(
    packed: torch.Tensor, sampling: Sampling, mean: torch.Tensor, inverse_std: torch.Tensor, vae_scale_factor: int
) -> torch.Tensor:
    """A Qwen-Image pipeline's packed latents as ComfyUI's LATENT: what the pipelines do before ``vae.decode``
    (output_type != "latent"), without needing the VAE's weights: unpacked to [B, C, 1, h, w], the per-channel
    normalisation undone, in the pipeline's own arithmetic. In float32 (ComfyUI's LATENT dtype) even for a bf16
    transformer, so the statistics add no rounding."""
    from diffusers import QwenImagePipeline

    latents = QwenImagePipeline._unpack_latents(packed.float(), sampling.height, sampling.width, vae_scale_factor)
    return (latents.cpu() / inverse_std + mean).cpu()
