"""FLUX.2 family adapter: the staged recipe of diffusers' distributed-inference guide, one stage per function.

    load_text_encoders -> encode       (the Mistral 3 text encoder only; `device_map="balanced"` across GPUs)
    load_transformer   -> denoise      (transformer + scheduler only; `device_map="auto"`, or CP / TP by the caller)
    load_vae           -> decode       (VAE only, one device)

Each stage runs the real `Flux2Pipeline` with the other components set to None, so the staged result equals the
one-shot pipeline for the same seed. Between stages travel ComfyUI types:

- embeddings: `prompt_embeds` [B, T, 3 x hidden] (three Mistral hidden states stacked; T = max_sequence_length,
  system prompt included), on the CPU. FLUX.2 has one text encoder, no pooled embedding and no true CFG;
- LATENT samples: [B, 128, H/16, W/16] for the real 32-channel VAE: the VAE's latents in 2x2 patches and normalised
  with the VAE's batch-norm statistics. That is ComfyUI's convention for FLUX.2 (`latent_formats.Flux2`: 128 channels,
  16x downscale, no scale / shift, because ComfyUI's FLUX.2 VAE patchifies and applies the batch-norm itself), and
  it is also the pipeline's own latent space, so nothing is converted on the way out of the denoiser;
- IMAGE: [B, H, W, 3] float32 in 0..1, on the CPU.
"""

from __future__ import annotations

from typing import Callable

import torch

from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel

from . import Placement, comfy_image, expand_batch, generators, load_placed, step_callback


def load_text_encoders(model_dir: str, dtype: torch.dtype, placement: Placement) -> Flux2Pipeline:
    """The pipeline with only its processor and text encoder (transformer=None, vae=None)."""
    return load_placed(Flux2Pipeline, model_dir, dtype, placement, "FLUX.2 text encoder", transformer=None, vae=None)


@torch.no_grad()
def encode(
    pipe: Flux2Pipeline, prompt: list[str], prompt_2: list[str] | None, max_sequence_length: int
) -> dict[str, torch.Tensor]:
    """Encode prompts with Mistral 3 (one row per prompt). `max_sequence_length` counts the chat template's system
    message too: the pipeline pads / cuts the whole conversation to it."""
    if prompt_2 is not None:
        raise ValueError("FLUX.2 has one text encoder; prompt_2 has nothing to feed.")
    prompt_embeds, _text_ids = pipe.encode_prompt(prompt=prompt, max_sequence_length=max_sequence_length)
    # `_text_ids` are position ids derived from the sequence length; the denoise stage rebuilds them.
    return {"prompt_embeds": prompt_embeds.cpu()}


def load_transformer(model_dir: str, dtype: torch.dtype, placement: Placement) -> Flux2Transformer2DModel:
    """The transformer alone, on one device or spread with `device_map="auto"`."""
    return load_placed(Flux2Transformer2DModel, model_dir, dtype, placement, "FLUX.2 transformer",
                       subfolder="transformer")


@torch.no_grad()
def denoise(
    model_dir: str,
    transformer: Flux2Transformer2DModel,
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
    """Run the denoising loop and return ComfyUI LATENT samples [batch_size, 4 x VAE channels, height/16, width/16]
    (float32, CPU).

    `embeds` comes from `encode`; with fewer prompts than `batch_size`, each prompt is repeated as the pipeline's
    `num_images_per_prompt` does. Image `i` draws its noise from its own generator seeded `seed + i`, so an image
    does not depend on how a batch is split (data parallelism gives each rank a slice of consecutive seeds), and
    the result equals the one-shot pipeline called with that list of generators. `guidance_scale` is FLUX.2-dev's
    distilled guidance (an embedding, not CFG).
    `on_step(step_index, total)` is called after each step (`step_index` counts from 0); an exception raised from
    it stops the loop, which is how a caller cancels.
    """
    # With vae=None the pipeline assumes an 8x VAE; the 2x2 patches then need multiples of 16. The pipeline would
    # silently round down instead, giving a latent that is not height/16 x width/16.
    if height % 16 or width % 16:
        raise ValueError(f"FLUX.2 needs width and height divisible by 16, got {width}x{height}.")

    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir, subfolder="scheduler"),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    device = pipe._execution_device

    # Passed-in embeddings are used as given (the pipeline repeats only what it encodes itself), and their dtype sets
    # the latents' dtype.
    prompt_embeds = expand_batch(embeds, batch_size)["prompt_embeds"]
    packed = pipe(
        prompt_embeds=prompt_embeds.to(device=device, dtype=transformer.dtype),
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        height=height,
        width=width,
        generator=generators(seed, batch_size),
        output_type="latent",
        callback_on_step_end=step_callback(on_step),
    ).images

    # Undo `Flux2Pipeline._pack_latents` ([B, C, h, w] -> [B, h*w, C], tokens in raster order; the pipeline's
    # `_unpack_latents_with_ids` scatters by position ids to the same place). No batch-norm de-normalisation: ComfyUI's
    # FLUX.2 LATENT is the normalised, patchified latent and its VAE applies the statistics when decoding.
    packed = packed.float()  # ComfyUI's LATENT dtype, even for a bf16 transformer
    latent_height, latent_width = height // 16, width // 16
    latents = packed.permute(0, 2, 1).reshape(packed.shape[0], packed.shape[2], latent_height, latent_width)
    return latents.cpu()


def load_vae(model_dir: str, dtype: torch.dtype, device: str) -> AutoencoderKLFlux2:
    """The VAE on one device (it is small; the guide never splits it)."""
    return AutoencoderKLFlux2.from_pretrained(model_dir, subfolder="vae", dtype=dtype).to(device)


@torch.no_grad()
def decode(vae: AutoencoderKLFlux2, samples: torch.Tensor) -> torch.Tensor:
    """Decode LATENT samples (normalised 2x2 patches, ComfyUI's FLUX.2 convention) to an IMAGE [B, H, W, 3] float32
    in 0..1 on the CPU."""
    # What Flux2Pipeline does before `vae.decode`, in float32 so the statistics add no rounding of their own.
    latents = samples.to(device=vae.device, dtype=torch.float32)
    bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device, latents.dtype)
    latents = Flux2Pipeline._unpatchify_latents(latents * bn_std + bn_mean)
    return comfy_image(vae.decode(latents.to(vae.dtype), return_dict=False)[0])
