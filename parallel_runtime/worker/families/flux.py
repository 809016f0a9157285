"""FLUX.1 family adapter: the staged recipe of diffusers' distributed-inference guide, one stage per function.

    load_text_encoders -> encode       (CLIP + T5 only; `device_map="balanced"` across GPUs)
    load_transformer   -> denoise      (transformer + scheduler only; `device_map="auto"`, or CP / TP by the caller)
    load_vae           -> decode       (VAE only, one device)

Each stage runs the real `FluxPipeline` with the other components set to None, so the staged result equals the
one-shot pipeline for the same seed. Between stages travel ComfyUI types:

- embeddings: `prompt_embeds` [B, T, 4096] (T5) and `pooled_prompt_embeds` [B, 768] (CLIP), on the CPU;
- LATENT samples: [B, 16, H/8, W/8] in un-normalised VAE space with diffusers' 2x2 packing undone, which is what
  ComfyUI's KSampler produces for Flux and what its VAEDecode consumes;
- IMAGE: [B, H, W, 3] float32 in 0..1, on the CPU.
"""

from __future__ import annotations

from typing import Callable

import torch

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

from . import Placement, comfy_image, expand_batch, generators, load_placed, step_callback


def load_text_encoders(model_dir: str, dtype: torch.dtype, placement: Placement) -> FluxPipeline:
    """The pipeline with only its tokenizers and text encoders (transformer=None, vae=None)."""
    return load_placed(FluxPipeline, model_dir, dtype, placement, "FLUX.1 text encoders", transformer=None, vae=None)


@torch.no_grad()
def encode(
    pipe: FluxPipeline, prompt: list[str], prompt_2: list[str] | None, max_sequence_length: int
) -> dict[str, torch.Tensor]:
    """Encode prompts with CLIP (pooled) and T5 (`prompt_2`, defaulting to `prompt`); one row per prompt."""
    prompt_embeds, pooled_prompt_embeds, _text_ids = pipe.encode_prompt(
        prompt=prompt, prompt_2=prompt_2, max_sequence_length=max_sequence_length
    )
    # `_text_ids` is all zeros of the sequence length; the denoise stage rebuilds it.
    return {"prompt_embeds": prompt_embeds.cpu(), "pooled_prompt_embeds": pooled_prompt_embeds.cpu()}


def load_transformer(model_dir: str, dtype: torch.dtype, placement: Placement) -> FluxTransformer2DModel:
    """The transformer alone, on one device or spread with `device_map="auto"`."""
    return load_placed(FluxTransformer2DModel, model_dir, dtype, placement, "FLUX.1 transformer",
                       subfolder="transformer")


@torch.no_grad()
def denoise(
    model_dir: str,
    transformer: FluxTransformer2DModel,
    embeds: dict[str, torch.Tensor],
    *,
    seed: int,
    steps: int,
    guidance_scale: float,
    width: int,
    height: int,
    batch_size: int,
    on_step: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """Run the denoising loop and return ComfyUI LATENT samples [batch_size, 16, height/8, width/8] (float32, CPU).

    `embeds` comes from `encode`; with fewer prompts than `batch_size`, each prompt is repeated as the pipeline's
    `num_images_per_prompt` does. Image `i` draws its noise from its own generator seeded `seed + i`, so an image
    does not depend on how a batch is split (data parallelism gives each rank a slice of consecutive seeds), and
    the result equals the one-shot pipeline called with that list of generators.
    `on_step(step_index, total)` is called after each step (`step_index` counts from 0); an exception raised from
    it stops the loop, which is how a caller cancels.
    """
    # With vae=None the pipeline assumes an 8x VAE; the 2x2 packing then needs multiples of 16. The pipeline would
    # silently round down instead, giving a latent that is not height/8 x width/8.
    if height % 16 or width % 16:
        raise ValueError(f"FLUX.1 needs width and height divisible by 16, got {width}x{height}.")

    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir, subfolder="scheduler"),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    device = pipe._execution_device

    # Passed-in embeddings are used as given (the pipeline repeats only the ones it encodes itself), and their dtype
    # sets the latents' dtype.
    batch = expand_batch(embeds, batch_size)
    packed = pipe(
        prompt_embeds=batch["prompt_embeds"].to(device=device, dtype=transformer.dtype),
        pooled_prompt_embeds=batch["pooled_prompt_embeds"].to(device=device, dtype=transformer.dtype),
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        height=height,
        width=width,
        generator=generators(seed, batch_size),
        output_type="latent",
        callback_on_step_end=step_callback(on_step),
    ).images

    # What FluxPipeline does before `vae.decode` (output_type != "latent"), without needing the VAE's weights.
    vae_config = AutoencoderKL.load_config(model_dir, subfolder="vae")
    # In float32 (ComfyUI's LATENT dtype) even for a bf16 transformer, so the scale and shift add no rounding.
    latents = FluxPipeline._unpack_latents(packed.float(), height, width, pipe.vae_scale_factor)
    latents = latents / vae_config["scaling_factor"] + vae_config["shift_factor"]
    return latents.cpu()


def load_vae(model_dir: str, dtype: torch.dtype, device: str) -> AutoencoderKL:
    """The VAE on one device (it is small; the guide never splits it)."""
    return AutoencoderKL.from_pretrained(model_dir, subfolder="vae", dtype=dtype).to(device)


@torch.no_grad()
def decode(vae: AutoencoderKL, samples: torch.Tensor) -> torch.Tensor:
    """Decode LATENT samples (un-normalised, unpacked) to an IMAGE [B, H, W, 3] float32 in 0..1 on the CPU."""
    return comfy_image(vae.decode(samples.to(device=vae.device, dtype=vae.dtype), return_dict=False)[0])
