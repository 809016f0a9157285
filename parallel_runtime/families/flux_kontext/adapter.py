"""FLUX.1 Kontext [dev]: FLUX.1 that edits a reference image (``FluxKontextPipeline``). Its transformer, text encoders
and VAE are FLUX.1's classes (the same ``_cp_plan`` / ``_tp_plan``); only the denoise differs: the reference image's
VAE latents ride in the transformer's sequence after the image's own ([latents; reference], their ids' channel 0 = 1)
and the output is cut back to the image's tokens.

A diffusers folder is told from FLUX.1's by ``model_index.json``'s ``_class_name``. ComfyUI's single file
(``flux1-dev-kontext_fp8_scaled.safetensors``) has FLUX.1-dev's keys and shapes, so nothing in its weights tells the
two apart: FLUX.1's layout (``flux/files.py``) refuses a file so named, and converts a renamed one as FLUX.1-dev (a
later issue: an explicit choice of the variant on Model from ComfyUI Files).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ...wire import Sampling
from ..base import OnStep, check_size, pil_images
from ..flux.adapter import Flux1


class FluxKontext(Flux1):
    key = "flux_kontext"
    name = "FLUX.1 Kontext"
    pipeline = "FluxKontextPipeline"
    reference_images: ClassVar[int] = 1
    needs_reference: ClassVar[bool] = True
    reference_per_image: ClassVar[bool] = True

    def denoise_components(self, references: bool) -> tuple[str, ...]:
        return ("vae",)  # it encodes the picture to edit

    def reference_size(self, width: int, height: int) -> tuple[int, int]:
        """The size a ``width`` × ``height`` reference image is resized to before its VAE encode: the pipeline's
        ``_auto_resize``, Kontext's trained resolution nearest its aspect ratio (each about a megapixel), in whole
        tokens."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        multiple = self.pixels_per_token
        # As the pipeline's image processor reads the image's size: floored to whole tokens first.
        aspect = (width // multiple * multiple) / (height // multiple * multiple)
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        return width // multiple * multiple, height // multiple * multiple

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
    ) -> torch.Tensor:
        """LATENT samples [batch_size, 16, height/8, width/8] of ``image`` (an IMAGE [1 or batch_size, H, W, 3] in
        0..1) edited as the prompt says: ``FluxKontextPipeline`` called with the same image (as the PIL images
        ComfyUI's LoadImage read, so the pipeline resizes them as it does any loaded image), the generators seeded
        seed + i, and ``max_area`` the widgets' width × height, so that the result is the size asked for."""
        from diffusers import AutoencoderKL, FluxKontextPipeline

        check_size(self, sampling)
        if image is None or latent_image is not None or noise_mask is not None:
            raise ValueError(f"{self.name} edits a reference image (image), and takes no latent_image or noise_mask.")
        vae_config = AutoencoderKL.load_config(model_dir, subfolder="vae")
        # The pipeline encodes the resized reference itself (the posterior's argmax); the VAE is small and loads here,
        # in the transformer's dtype, which is the one the pipeline hands it the pixels in.
        vae = self.load_vae(model_dir, transformer.dtype, str(transformer.device))
        pipe = self.pipeline_around(FluxKontextPipeline, model_dir, sampling, transformer, vae)
        return self.run_pipeline(
            pipe,
            transformer,
            embeds,
            sampling,
            vae_config,
            on_step,
            image=pil_images(image),
            max_area=sampling.width * sampling.height,
        )
