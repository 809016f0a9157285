"""Qwen-Image-Edit Plus (Qwen-Image-Edit-2509 and -2511): Qwen-Image that edits one to three images as the prompt says
(``QwenImageEditPlusPipeline``). Its transformer, text encoder and VAE are Qwen-Image's classes (the same ``_cp_plan``
/ ``_tp_plan``); what differs:

- the text encoder, Qwen2.5-VL, sees the images (through the folder's ``processor``), each resized to about 384²
  (``condition_size``): the images are EncodeOnBalancedGPUs' inputs, and the embeddings hold their vision tokens, so
  the positive and negative prompts' lengths differ and each depends on the images;
- the transformer reads each image's VAE latents, encoded at about 1024² whatever the output's size
  (``reference_size``), as tokens after the output's ([latents; image 1; image 2; ...]), and the output is cut back;
  -2511's transformer (``zero_cond_t`` in its config) modulates those tokens at timestep 0;
- true CFG rescales the combined prediction to the conditional one's norm, token by token.

The images travel from the encoder to the sampler with the conditioning (``jobs.Conditioning.images``) and reach the
denoise as ``image``, ``image_2``, ``image_3``; the pipeline itself resizes and VAE-encodes them there, as it does in a
one-shot call. The pipeline takes one prompt at a time (its ``batch_size`` must be 1), its images made as
``num_images_per_prompt``.

A diffusers folder is told from Qwen-Image's by ``model_index.json``'s ``_class_name``. ComfyUI's transformer files
(``qwen_image_edit_2509_*.safetensors``, ``qwen_image_edit_2511_*``) have Qwen-Image's keys and shapes (2511's
``zero_cond_t`` is a config switch, not a weight); only 2511's carries a flag, ComfyUI's empty
``__index_timestep_zero__`` tensor. So Qwen-Image's layout (``qwenimage/files.py``) converts them: into this family's
folder when the file carries that flag or its name says 2511 or 2509 (``zero_cond_t`` for 2511), and the first Edit,
which this family does not run, is refused by its name rather than run as text-to-image.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ...wire import Prompts, Sampling
from ..base import (
    OnStep,
    check_size,
    expand_batch,
    generators,
    latent_statistics,
    pil_images,
    scheduler_for,
    step_callback,
)
from ..qwenimage.adapter import QwenImage, comfy_latents, pipeline_conditioning


def _pipeline_size(area: int, width: int, height: int) -> tuple[int, int]:
    """The pipeline's ``calculate_dimensions``: ``area`` at the image's aspect ratio, sides rounded to 32."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    return calculate_dimensions(area, width / height)


class QwenImageEdit(QwenImage):
    key = "qwenimage_edit"
    name = "Qwen-Image-Edit"
    pipeline = "QwenImageEditPlusPipeline"
    encoder_images: ClassVar[int] = 3
    # ComfyUI's TextEncodeQwenImageEditPlus puts the images' latents into its CONDITIONING, which the pack does not
    # read: the images come through EncodeOnBalancedGPUs.
    comfy_text_encoder = None

    def denoise_components(self, references: bool) -> tuple[str, ...]:
        return ("vae",)  # it encodes the pictures for the transformer

    def condition_size(self, width: int, height: int) -> tuple[int, int]:
        """The size the text encoder sees a ``width`` × ``height`` image at: about 384² at its aspect ratio (the
        pipeline's ``CONDITION_IMAGE_SIZE``), sides multiples of 32."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE

        return _pipeline_size(CONDITION_IMAGE_SIZE, width, height)

    def reference_size(self, width: int, height: int) -> tuple[int, int]:
        """The size a ``width`` × ``height`` image is VAE-encoded at for the transformer: about 1024² at its aspect
        ratio (the pipeline's ``VAE_IMAGE_SIZE``) whatever the output's size, sides multiples of 32."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import VAE_IMAGE_SIZE

        return _pipeline_size(VAE_IMAGE_SIZE, width, height)

    @torch.no_grad()
    def encode(self, pipe: Any, prompts: Prompts, images: tuple[torch.Tensor, ...] = ()) -> dict[str, torch.Tensor]:
        """The prompt (and the negative one) encoded with ``images`` (IMAGEs [1, H, W, 3 or 4] in 0..1), each resized
        to ``condition_size`` as the pipeline's call does before its ``encode_prompt``."""
        if not images:
            raise ValueError(f"{self.name} edits images, and none was given to its text encoder.")
        if len(prompts.prompts) != 1:
            raise ValueError(f"{self.name}'s pipeline takes one prompt at a time, got {len(prompts.prompts)}.")
        condition = []
        for pixels in images:
            (image,) = pil_images(pixels)
            width, height = self.condition_size(*image.size)
            condition.append(pipe.image_processor.resize(image, height, width))
        return super().encode(pipe, prompts, image=condition)

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
        """LATENT samples [batch_size, 16, 1, height/8, width/8] of the images (IMAGEs [1, H, W, 3 or 4] in 0..1,
        the ones the embeddings were encoded with) edited as the prompt says: ``QwenImageEditPlusPipeline`` called
        with the same images (as the PIL images LoadImage read, so it resizes and VAE-encodes them as it does any
        loaded image), the embeddings' one prompt made ``batch_size`` times, image i from seed + i."""
        from diffusers import AutoencoderKLQwenImage, QwenImageEditPlusPipeline

        check_size(self, sampling)
        if sampling.steps < self.min_steps:
            raise ValueError(f"{self.name} needs at least {self.min_steps} steps, got {sampling.steps}.")
        images = [pixels for pixels in (image, image_2, image_3) if pixels is not None]
        if not images or latent_image is not None or noise_mask is not None:
            raise ValueError(f"{self.name} edits the images its prompt was encoded with, and takes no latent_image.")
        batch = expand_batch(embeds, sampling.batch_size)
        if any(not torch.equal(rows, rows[:1].expand_as(rows)) for rows in batch.values()):
            raise ValueError(f"{self.name}'s pipeline takes one prompt at a time; these embeddings hold several.")
        true_cfg_scale = sampling.true_cfg_scale or 1.0
        do_true_cfg = true_cfg_scale > 1 and "negative_prompt_embeds" in embeds
        mean, inverse_std = latent_statistics(AutoencoderKLQwenImage.load_config(model_dir, subfolder="vae"))
        # The pipeline VAE-encodes the resized images itself (the posterior's argmax); the VAE is small and loads
        # here, in the transformer's dtype, which is the one the pipeline hands it the pixels in.
        vae = self.load_vae(model_dir, transformer.dtype, str(transformer.device))
        pipe = QwenImageEditPlusPipeline(
            scheduler=scheduler_for(model_dir, sampling),
            vae=vae,
            text_encoder=None,
            tokenizer=None,
            processor=None,
            transformer=transformer,
        )
        pipe.set_progress_bar_config(disable=True)
        one_prompt = {name: rows[:1] for name, rows in batch.items()}
        packed = pipe(
            image=[pil_images(pixels)[0] for pixels in images],
            **pipeline_conditioning(pipe, one_prompt, do_true_cfg),
            true_cfg_scale=true_cfg_scale,
            guidance_scale=sampling.guidance_scale if transformer.config.guidance_embeds else None,
            num_inference_steps=sampling.steps,
            height=sampling.height,
            width=sampling.width,
            num_images_per_prompt=sampling.batch_size,
            generator=generators(sampling.seed, sampling.batch_size),
            output_type="latent",
            callback_on_step_end=step_callback(on_step),
        ).images
        return comfy_latents(packed, sampling, mean, inverse_std, pipe.vae_scale_factor)
