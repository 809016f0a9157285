"""FLUX.1 (dev and schnell): ``FluxPipeline``, CLIP + T5 text encoders, one 16-channel 8x VAE.

Between the stages travel ComfyUI's types:

- embeddings: ``prompt_embeds`` [B, T, 4096] (T5) and ``pooled_prompt_embeds`` [B, 768] (CLIP), on the CPU;
- LATENT samples: [B, 16, H/8, W/8] in un-normalised VAE space with diffusers' 2x2 packing undone, which is what
  ComfyUI's KSampler produces for Flux and what its VAEDecode consumes;
- IMAGE: [B, H, W, 3] float32 in 0..1, on the CPU.
"""

from __future__ import annotations

import os
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
    load_placed,
    scheduler_for,
    step_callback,
    vae_pixels,
)


class Flux1(FamilyAdapter):
    key = "flux"
    name = "FLUX.1"
    pipeline = "FluxPipeline"
    text_encoders = 2  # CLIP, and T5 (which prompt_2 feeds)
    max_sequence_length = 512  # T5 is trained on at most 512 tokens and FluxPipeline refuses more
    pads_text = True
    latent = LatentLayout(ndims=(4,), vae_channels_key="latent_channels")
    comfy_text_encoder = ("DualCLIPLoader", "flux", "CLIPTextEncode or CLIPTextEncodeFlux")
    pooled_text = True

    def load_text_encoders(self, model_dir: str, dtype: torch.dtype, placement: Placement) -> Any:
        from diffusers import FluxPipeline

        return load_placed(
            FluxPipeline, model_dir, dtype, placement, "FLUX.1 text encoders", transformer=None, vae=None
        )

    @torch.no_grad()
    def encode(self, pipe: Any, prompts: Prompts) -> dict[str, torch.Tensor]:
        """CLIP (pooled) and T5 (``prompts_2``, defaulting to the prompts)."""
        prompt_embeds, pooled_prompt_embeds, _text_ids = pipe.encode_prompt(
            prompt=list(prompts.prompts),
            prompt_2=list(prompts.prompts_2) if prompts.prompts_2 else None,
            max_sequence_length=prompts.max_sequence_length,
        )
        # `_text_ids` is all zeros of the sequence length; the denoise stage rebuilds it.
        return {"prompt_embeds": prompt_embeds.cpu(), "pooled_prompt_embeds": pooled_prompt_embeds.cpu()}

    def transformer_class(self) -> type:
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel

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
        """LATENT samples [batch_size, 16, height/8, width/8]. With fewer prompts than images each prompt is repeated,
        as the pipeline's ``num_images_per_prompt`` does; the result equals the one-shot pipeline called with the list
        of generators seeded seed + i (``FluxImg2ImgPipeline`` / ``FluxInpaintPipeline`` given the latent image)."""
        import diffusers
        from diffusers import AutoencoderKL, FluxPipeline

        check_size(self, sampling)
        vae_config = AutoencoderKL.load_config(model_dir, subfolder="vae")
        image = None
        if latent_image is not None:  # ComfyUI's LATENT is un-normalised
            image = (latent_image.float() - vae_config["shift_factor"]) * vae_config["scaling_factor"]
        pipelines = (FluxPipeline, diffusers.FluxImg2ImgPipeline, diffusers.FluxInpaintPipeline)
        pipeline_class, image_inputs = image_pipeline(pipelines, image, noise_mask, sampling.denoise)
        pipe = self.pipeline_around(pipeline_class, model_dir, sampling, transformer)
        if image is not None:
            _latent_channels_of_the_vae(pipe, vae_config["latent_channels"], model_dir, masked=noise_mask is not None)
        return self.run_pipeline(pipe, transformer, embeds, sampling, vae_config, on_step, **image_inputs)

    def pipeline_around(
        self, pipeline_class: type, model_dir: str, sampling: Sampling, transformer: torch.nn.Module, vae: Any = None
    ) -> Any:
        """A FLUX.1 pipeline (FluxPipeline or a variant's) around ``transformer`` with the sampler's scheduler and no
        text encoders; without a VAE unless it encodes an image itself (Kontext's reference)."""
        return pipeline_class(
            scheduler=scheduler_for(model_dir, sampling),
            vae=vae,
            text_encoder=None,
            tokenizer=None,
            text_encoder_2=None,
            tokenizer_2=None,
            transformer=transformer,
        )

    def run_pipeline(
        self,
        pipe: Any,
        transformer: torch.nn.Module,
        embeds: dict[str, torch.Tensor],
        sampling: Sampling,
        vae_config: dict,
        on_step: OnStep | None,
        **inputs: Any,
    ) -> torch.Tensor:
        """Run a FLUX.1 pipeline built around ``transformer`` (FluxPipeline or a variant's, which take the same
        arguments and ``inputs`` besides) to LATENT samples [batch_size, 16, height/8, width/8] in ComfyUI's
        convention."""
        from diffusers import FluxPipeline

        pipe.set_progress_bar_config(disable=True)
        device = pipe._execution_device
        # Passed-in embeddings are used as given (the pipeline repeats only the ones it encodes itself), and their
        # dtype sets the latents' dtype.
        batch = expand_batch(embeds, sampling.batch_size)
        packed = pipe(
            prompt_embeds=batch["prompt_embeds"].to(device=device, dtype=transformer.dtype),
            pooled_prompt_embeds=batch["pooled_prompt_embeds"].to(device=device, dtype=transformer.dtype),
            num_inference_steps=sampling.steps,
            guidance_scale=sampling.guidance_scale,
            height=sampling.height,
            width=sampling.width,
            generator=generators(sampling.seed, sampling.batch_size),
            output_type="latent",
            callback_on_step_end=step_callback(on_step),
            **inputs,
        ).images
        # What FluxPipeline does before `vae.decode` (output_type != "latent"), without needing the VAE's weights.
        # In float32 (ComfyUI's LATENT dtype) even for a bf16 transformer, so the scale and shift add no rounding.
        latents = FluxPipeline._unpack_latents(packed.float(), sampling.height, sampling.width, pipe.vae_scale_factor)
        latents = latents / vae_config["scaling_factor"] + vae_config["shift_factor"]
        return latents.cpu()

    def lora_state_dict(self, path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, dict | None]:
        """FluxPipeline also returns the alphas of diffusers-layout files that carry them (``<module>.alpha``).

        diffusers 0.42.1 converts a kohya / ComfyUI file's ``final_layer`` (``proj_out``, ``norm_out.linear``)
        without its alpha (and without the ``transformer.`` prefix, which is how its ``load_lora_weights`` comes to
        drop it, see ``families/lora.py``): the alpha / rank scale is applied here, to lora_A as its converter does
        for every other layer."""
        from diffusers import FluxPipeline
        from safetensors import safe_open

        state_dict, alphas, metadata = FluxPipeline.lora_state_dict(
            path, use_safetensors=True, return_alphas=True, return_lora_metadata=True
        )
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            final_layer = (("final_layer.linear", "proj_out"), ("final_layer.adaLN_modulation.1", "norm_out.linear"))
            for bfl, module in final_layer:
                for name in (f"lora_unet_{bfl.replace('.', '_')}", f"diffusion_model.{bfl}"):
                    converted = f"{module}.lora_A.weight"
                    if f"{name}.alpha" in keys and f"{name}.lora_down.weight" in keys and converted in state_dict:
                        rank = f.get_slice(f"{name}.lora_down.weight").get_shape()[0]
                        state_dict[converted] = state_dict[converted] * (f.get_tensor(f"{name}.alpha").item() / rank)
        return state_dict, alphas, metadata

    def load_vae(self, model_dir: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
        from diffusers import AutoencoderKL

        return load_placed(AutoencoderKL, model_dir, dtype, Placement(device), "FLUX.1 VAE", subfolder="vae")

    @torch.no_grad()
    def decode(self, vae: torch.nn.Module, samples: torch.Tensor) -> torch.Tensor:
        """LATENT samples (un-normalised, unpacked) to an IMAGE."""
        return comfy_image(vae.decode(samples.to(device=vae.device, dtype=vae.dtype), return_dict=False)[0])

    @torch.no_grad()
    def encode_image(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """The posterior's mode, un-normalised (ComfyUI's FLUX.1 LATENT; the pipelines scale and shift it)."""
        posterior = vae.encode(vae_pixels(pixels, vae.device, vae.dtype)).latent_dist
        return posterior.mode().float().cpu()


def _latent_channels_of_the_vae(pipe: Any, channels: int, model_dir: str, masked: bool) -> None:
    """Built without a VAE, FLUX.1's img2img and inpaint pipelines take 16 latent channels for granted and treat any
    other latent as pixels to encode (with the VAE they do not have). Tell the img2img pipeline the model's own; the
    inpaint pipeline takes only 16-channel latents however it is built, so a model with other ones is refused."""
    from diffusers.image_processor import VaeImageProcessor

    if channels == pipe.latent_channels:
        return
    if masked:
        raise ValueError(
            f"the model {os.path.basename(os.path.normpath(model_dir))!r} has a VAE of {channels} latent channels, and "
            "diffusers' FLUX.1 inpainting takes only 16: use it without a noise mask (img2img), or pick a FLUX.1 "
            "model with FLUX.1's VAE"
        )
    pipe.latent_channels = channels
    pipe.image_processor = VaeImageProcessor(vae_scale_factor=pipe.vae_scale_factor * 2, vae_latent_channels=channels)
