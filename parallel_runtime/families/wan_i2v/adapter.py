"""Wan image-to-video (``WanImageToVideoPipeline``): Wan 2.1 I2V (one transformer, and a CLIP vision encoder whose
257 image tokens go in front of the text in every cross-attention) and Wan 2.2 A14B I2V (two experts, no image
encoder). Its text encoder, transformer class and VAE are Wan's (``wan/adapter.py``); only the denoise differs: the
start image (ParallelSampler's ``image``) is resized to the output's size and VAE-encoded, as the clip's first frame
followed by zeros, into the 20 channels the transformer reads beside the noise (a 4-channel mask of the known frame
and the 16 latent channels), and Wan 2.1 I2V's CLIP encoder reads it too.

A folder is told from Wan T2V's by ``model_index.json``'s ``_class_name``; ComfyUI's files by the transformer's 36
input channels (``wan/files.py``).

Where the start image is encoded: in the denoise, on every rank, by the pipeline itself (its VAE and image encoder
load there, in the transformer's dtype, as FLUX.1 Kontext's VAE does). The image enters at the sampler, not at the
text encoders' node, and ComfyUI's own CONDITIONING never passes the pack's encode stage; the pipeline's own encode
makes the clip diffusers' by construction. What it costs: loading the VAE and (Wan 2.1) CLIP ViT-H, 0.6B parameters,
for each run — small beside a 14B transformer's 81-frame steps; the memory check and the advisor count them
(``denoise_components``), and CLIP's 257 tokens beside the text.

Wan 2.1 I2V's transformer takes the image tokens as what precedes the last 512 of its cross-attention's context, so
its text must be exactly 512 tokens (``jobs/sample.py`` refuses another length before anything loads): a shorter
``max_sequence_length`` would run and be silently wrong.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..base import Placement, load_placed, pil_images
from ..wan.adapter import Wan


class WanI2V(Wan):
    key = "wan_i2v"
    name = "Wan I2V"
    pipeline = "WanImageToVideoPipeline"
    reference_images: ClassVar[int] = 1
    needs_reference: ClassVar[bool] = True
    first_frame: ClassVar[bool] = True
    not_text: ClassVar[tuple[str, ...]] = (*Wan.not_text, "image_encoder", "image_processor")

    def denoise_components(self, references: bool) -> tuple[str, ...]:
        return ("vae", "image_encoder")  # they read the start image (start_image); Wan 2.2 I2V has no image encoder

    def start_image(
        self, model_dir: str, transformer: torch.nn.Module, image: torch.Tensor | None
    ) -> tuple[type, dict[str, Any], dict[str, Any]]:
        """The VAE and (Wan 2.1 I2V) the CLIP image encoder and its processor, loaded beside the transformer, and the
        start image as the PIL image ComfyUI's LoadImage read (so the pipeline resizes it to width × height as it
        resizes any loaded image)."""
        if image is None or image.shape[0] != 1:
            raise ValueError(f"{self.name} starts every clip from one image (image); got {_count(image)}.")
        parts = load_placed(
            self.pipeline_class(),
            model_dir,
            transformer.dtype,
            Placement(str(transformer.device)),
            f"{self.name} VAE and image encoder",
            tokenizer=None,
            text_encoder=None,
            transformer=None,
            transformer_2=None,
        )
        components = {name: getattr(parts, name) for name in ("vae", "image_encoder", "image_processor")}
        return self.pipeline_class(), components, {"image": pil_images(image)[0]}


def _count(image: torch.Tensor | None) -> str:
    return "none" if image is None else f"{image.shape[0]}"
