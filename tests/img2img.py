"""Img2img and inpainting at the family level (tests/README.md): the settings, the inputs and the adapter's own
img2img / inpaint that test_images holds against diffusers, and that test_samplers reuses with other schedulers."""

from __future__ import annotations

import torch
from diffusers import (
    Flux2Pipeline,
    FluxImg2ImgPipeline,
    FluxInpaintPipeline,
    QwenImageImg2ImgPipeline,
    QwenImageInpaintPipeline,
)
from diffusers.image_processor import VaeImageProcessor

from parallel_runtime.families import Placement
from parallel_runtime.wire import Prompts, Sampling

PROMPT = "a photo of a cat"
NEGATIVE = "a blue painting"
WIDTH, HEIGHT = 96, 64  # non-square: a swapped side shows up as a shape error
STEPS, DENOISE = 3, 0.6  # 2 of the 3 steps run
GUIDANCE = 3.5
CPU = Placement("cpu")

FAMILIES = {
    "flux": {"max_sequence_length": 16, "img2img": FluxImg2ImgPipeline, "inpaint": FluxInpaintPipeline},
    "flux2": {"max_sequence_length": 48},
    "qwenimage": {
        "max_sequence_length": 64,
        "img2img": QwenImageImg2ImgPipeline,
        "inpaint": QwenImageInpaintPipeline,
        "encode": {"negative_prompts": (NEGATIVE,)},
        "sampling": {"true_cfg_scale": 4.0},
    },
}


def pixels(batch: int = 1, seed: int = 3) -> torch.Tensor:
    """A ComfyUI IMAGE [B, H, W, 3] in 0..1."""
    return torch.rand((batch, HEIGHT, WIDTH, 3), generator=torch.Generator().manual_seed(seed))


def pixel_mask() -> torch.Tensor:
    """ComfyUI's noise_mask as SetLatentNoiseMask leaves it [1, 1, H, W]: repaint the right half, on token bounds."""
    mask = torch.zeros((1, 1, HEIGHT, WIDTH))
    mask[..., WIDTH // 2 :] = 1.0
    return mask


def ours(name, adapter, model_dir, stages, latent, mask=None, seed=11, batch_size=1, denoise=DENOISE, **choice):
    """The adapter's img2img / inpaint; ``choice``: ParallelSampler's sampler and scheduler (``Sampling``'s)."""
    text_pipe, transformer, _ = stages
    settings = FAMILIES[name]
    prompts = Prompts((PROMPT,), max_sequence_length=settings["max_sequence_length"], **settings.get("encode", {}))
    sampling = Sampling(
        seed=seed,
        steps=STEPS,
        guidance_scale=GUIDANCE,
        width=WIDTH,
        height=HEIGHT,
        batch_size=batch_size,
        denoise=denoise,
        **settings.get("sampling", {}),
        **choice,
    )
    embeds = adapter.encode(text_pipe, prompts)
    return adapter.denoise(model_dir, transformer, embeds, sampling, latent_image=latent, noise_mask=mask)


def posterior_mode(name: str, vae, image: torch.Tensor) -> torch.Tensor:
    """``vae.encode(x).latent_dist.mode()`` of an IMAGE, x as the pipelines' image processor makes it."""
    x = VaeImageProcessor().normalize(image.permute(0, 3, 1, 2))
    with torch.no_grad():
        return vae.encode(x.unsqueeze(2) if name == "qwenimage" else x).latent_dist.mode()


def pipeline_latents(name: str, vae, mode: torch.Tensor) -> torch.Tensor:
    """The posterior's mode normalised as the pipeline's ``_encode_vae_image`` does (FLUX.2: Flux2Pipeline's, with
    its 2x2 patches)."""
    if name == "flux":
        return (mode - vae.config.shift_factor) * vae.config.scaling_factor
    if name == "qwenimage":
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        return ((mode - mean) * (1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)))[:, :, 0]
    patches = Flux2Pipeline._patchify_latents(mode)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return (patches - vae.bn.running_mean.view(1, -1, 1, 1)) / std
