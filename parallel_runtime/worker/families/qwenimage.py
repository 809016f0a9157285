"""Qwen-Image family adapter: the staged recipe of diffusers' distributed-inference guide, one stage per function.

    load_text_encoders -> encode       (the Qwen2.5-VL text encoder only; `device_map="balanced"` across GPUs)
    load_transformer   -> denoise      (transformer + scheduler only; `device_map="auto"`, or CP / TP by the caller)
    load_vae           -> decode       (VAE only, one device)

Each stage runs the real `QwenImagePipeline` with the other components set to None, so the staged result equals the
one-shot pipeline for the same seed. Between stages travel ComfyUI types:

- embeddings: `prompt_embeds` [B, T, hidden] and `prompt_embeds_mask` [B, T] (int64; 0 marks padding when prompts of
  different lengths share a batch), on the CPU. T is the prompt's own token count after the chat template's prefix,
  cut at max_sequence_length; it is not padded up to it. Qwen-Image uses true classifier-free guidance, so `encode`
  also makes `negative_prompt_embeds` / `negative_prompt_embeds_mask` (a length of their own) when asked to;
- LATENT samples: [B, 16, 1, H/8, W/8], the VAE's own (un-normalised) latents with diffusers' 2x2 packing undone.
  That is ComfyUI's convention for Qwen-Image: its VAE is Wan 2.1's video VAE, so the latent is 5-D with one frame
  (`latent_formats.Wan21`, `latent_dimensions = 3`), and the per-channel `latents_mean` / `latents_std`
  normalisation lives in the model, not in the LATENT;
- IMAGE: [B, H, W, 3] float32 in 0..1, on the CPU.
"""

from __future__ import annotations

from typing import Callable

import torch

from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)

from . import Placement, comfy_image, expand_batch, generators, load_placed, step_callback


def load_text_encoders(model_dir: str, dtype: torch.dtype, placement: Placement) -> QwenImagePipeline:
    """The pipeline with only its tokenizer and text encoder (transformer=None, vae=None)."""
    return load_placed(QwenImagePipeline, model_dir, dtype, placement, "Qwen-Image text encoder",
                       transformer=None, vae=None)


def _encode(pipe: QwenImagePipeline, prompt: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    embeds, mask = pipe.encode_prompt(prompt=prompt, max_sequence_length=max_sequence_length)
    # The pipeline drops an all-ones mask (None); keep one so every conditioning has the same tensors. Passed back in,
    # the pipeline drops it again, so the transformer sees exactly what the one-shot call gives it.
    if mask is None:
        mask = torch.ones(embeds.shape[:2], dtype=torch.long)
    return embeds.cpu(), mask.to(device="cpu", dtype=torch.long)


@torch.no_grad()
def encode(
    pipe: QwenImagePipeline,
    prompt: list[str],
    prompt_2: list[str] | None,
    max_sequence_length: int,
    *,
    negative_prompt: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Encode prompts (one row per prompt) and, for true CFG, `negative_prompt` (one per prompt; "" is a valid,
    empty negative prompt). Each list is encoded on its own, as the pipeline does, so their lengths may differ."""
    if prompt_2 is not None:
        raise ValueError("Qwen-Image has one text encoder; prompt_2 has nothing to feed.")
    embeds, mask = _encode(pipe, prompt, max_sequence_length)
    out = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
    if negative_prompt is not None:
        if len(negative_prompt) != len(prompt):
            raise ValueError(f"{len(negative_prompt)} negative prompts for {len(prompt)} prompts; give one per prompt.")
        out["negative_prompt_embeds"], out["negative_prompt_embeds_mask"] = _encode(
            pipe, negative_prompt, max_sequence_length
        )
    return out


def load_transformer(model_dir: str, dtype: torch.dtype, placement: Placement) -> QwenImageTransformer2DModel:
    """The transformer alone, on one device or spread with `device_map="auto"`."""
    return load_placed(QwenImageTransformer2DModel, model_dir, dtype, placement, "Qwen-Image transformer",
                       subfolder="transformer")


@torch.no_grad()
def denoise(
    model_dir: str,
    transformer: QwenImageTransformer2DModel,
    embeds: dict[str, torch.Tensor],
    *,
    seed: int,
    steps: int,
    guidance_scale: float,
    width: int,
    height: int,
    batch_size: int,
    true_cfg_scale: float = 1.0,
    on_step: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """Run the denoising loop and return ComfyUI LATENT samples [batch_size, 16, 1, height/8, width/8] (float32, CPU).

    `embeds` comes from `encode`; with fewer prompts than `batch_size`, each prompt is repeated as the pipeline's
    `num_images_per_prompt` does. Image `i` draws its noise from its own generator seeded `seed + i`, so an image
    does not depend on how a batch is split (data parallelism gives each rank a slice of consecutive seeds), and
    the result equals the one-shot pipeline called with that list of generators.
    True CFG runs when `true_cfg_scale > 1` and `embeds` hold negative embeddings (the pipeline's rule): two
    transformer passes per step. `guidance_scale` only reaches guidance-distilled checkpoints
    (`guidance_embeds`); Qwen-Image itself has none.
    `on_step(step_index, total)` is called after each step (`step_index` counts from 0); an exception raised from
    it stops the loop, which is how a caller cancels.
    """
    # With vae=None the pipeline assumes an 8x VAE; the 2x2 packing then needs multiples of 16. The pipeline would
    # silently round down instead, giving a latent that is not height/8 x width/8.
    if height % 16 or width % 16:
        raise ValueError(f"Qwen-Image needs width and height divisible by 16, got {width}x{height}.")
    # The scheduler's `shift_terminal` stretch divides by (1 - last sigma), which is 0 on a one-step schedule: NaN.
    if steps < 2:
        raise ValueError(f"Qwen-Image needs at least 2 steps, got {steps}.")
    do_true_cfg = true_cfg_scale > 1 and "negative_prompt_embeds" in embeds

    pipe = QwenImagePipeline(
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
    batch = expand_batch(embeds, batch_size)
    conditioning = {
        "prompt_embeds": batch["prompt_embeds"].to(device=device, dtype=transformer.dtype),
        "prompt_embeds_mask": batch["prompt_embeds_mask"].to(device=device, dtype=torch.long),
    }
    # Negative embeddings only with true CFG on: the pipeline would warn about an unused negative prompt otherwise.
    if do_true_cfg:
        conditioning["negative_prompt_embeds"] = batch["negative_prompt_embeds"].to(device=device,
                                                                                   dtype=transformer.dtype)
        conditioning["negative_prompt_embeds_mask"] = batch["negative_prompt_embeds_mask"].to(device=device,
                                                                                             dtype=torch.long)

    packed = pipe(
        **conditioning,
        true_cfg_scale=true_cfg_scale,
        # Passing a scale to a model without guidance embedding only earns a warning; None is the pipeline's "unset".
        guidance_scale=guidance_scale if transformer.config.guidance_embeds else None,
        num_inference_steps=steps,
        height=height,
        width=width,
        # The embeddings were already cut at encode time; the pipeline cuts again at its default (512) otherwise.
        max_sequence_length=pipe.tokenizer_max_length,
        generator=generators(seed, batch_size),
        output_type="latent",
        callback_on_step_end=step_callback(on_step),
    ).images

    # What QwenImagePipeline does before `vae.decode` (output_type != "latent"), without needing the VAE's weights:
    # unpack to [B, C, 1, h, w] and undo the per-channel normalisation, in the pipeline's own arithmetic. In float32
    # (ComfyUI's LATENT dtype) even for a bf16 transformer, so the statistics add no rounding.
    vae_config = AutoencoderKLQwenImage.load_config(model_dir, subfolder="vae")
    latents = QwenImagePipeline._unpack_latents(packed.float(), height, width, pipe.vae_scale_factor)
    channels = vae_config["z_dim"]
    latents_mean = torch.tensor(vae_config["latents_mean"]).view(1, channels, 1, 1, 1).to(latents.device, latents.dtype)
    latents_std = 1.0 / torch.tensor(vae_config["latents_std"]).view(1, channels, 1, 1, 1).to(latents.device, latents.dtype)
    latents = latents / latents_std + latents_mean
    return latents.cpu()


def load_vae(model_dir: str, dtype: torch.dtype, device: str) -> AutoencoderKLQwenImage:
    """The VAE on one device (it is small; the guide never splits it)."""
    return AutoencoderKLQwenImage.from_pretrained(model_dir, subfolder="vae", dtype=dtype).to(device)


@torch.no_grad()
def decode(vae: AutoencoderKLQwenImage, samples: torch.Tensor) -> torch.Tensor:
    """Decode LATENT samples (un-normalised, [B, C, 1, h, w]; a 4-D [B, C, h, w] is taken as one frame) to an IMAGE
    [B, H, W, 3] float32 in 0..1 on the CPU."""
    if samples.ndim == 4:
        samples = samples.unsqueeze(2)
    if samples.shape[2] != 1:
        raise ValueError(f"Qwen-Image LATENTs hold one frame; got {samples.shape[2]} in {list(samples.shape)}.")
    return comfy_image(vae.decode(samples.to(device=vae.device, dtype=vae.dtype), return_dict=False)[0][:, :, 0])
