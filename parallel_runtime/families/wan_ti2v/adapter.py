"""Wan 2.2 TI2V-5B (``Wan-AI/Wan2.2-TI2V-5B-Diffusers``): one transformer of 48 input and output channels, Wan 2.2's
48-channel VAE (16× spatially: 8× in its convolutions, then 2 × 2 patches; 4× in time), and one folder that makes
clips from text (``WanPipeline``) and, given a start image (ParallelSampler's ``image``, optional here), from the
image (``WanImageToVideoPipeline`` on the same components). Its text encoder, transformer class and stages are
Wan's (``wan/adapter.py``); what differs:

- ``model_index.json``'s ``expand_timesteps``: the transformer takes a timestep per token (``[B, tokens]``, which
  Wan's ``_cp_plan`` splits with the tokens). Its folder is a ``WanPipeline``, as Wan's; that flag tells it
  (``index_flag``);
- with a start image, no CLIP image encoder and no extra input channels: the image is resized to the clip's size and
  VAE-encoded into the first latent frame, whose tokens keep timestep 0 while the others denoise, and the LATENT's
  first frame is that encoding (ComfyUI's ``Wan22ImageToVideoLatent`` does the same with a noise mask);
- LATENT samples [B, 48, (frames - 1) / 4 + 1, H/16, W/16], un-normalised (ComfyUI's ``latent_formats.Wan22``
  normalises inside the model); a token is 32 × 32 pixels, so width and height are multiples of 32.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..base import LatentLayout, pil_images
from ..wan.adapter import Wan


class WanTI2V(Wan):
    key = "wan_ti2v"
    name = "Wan 2.2 TI2V"
    index_flag: ClassVar[str | None] = "expand_timesteps"
    latent = LatentLayout(ndims=(5,), vae_channels_key="z_dim", downscale=16, temporal_downscale=4)
    pixels_per_token = 32  # the VAE's 16×, the transformer's 2 × 2 patches
    reference_images: ClassVar[int] = 1
    first_frame: ClassVar[bool] = True  # optional (needs_reference stays False): without it, text-to-video
    # Wan 2.2's VAE decodes 2 × 2 patches, its last level at half the size: measured on random ones (decoder_base_dim
    # 64 and 128, 512², 9 frames), 24 to 25 maps of decoder_base_dim at one frame's size (Wan 2.1's: 76).
    decode_copies = 26

    def denoise_components(self, references: bool) -> tuple[str, ...]:
        return ("vae",) if references else ()  # it encodes the start image, when there is one (start_image)

    def start_image(
        self, model_dir: str, transformer: torch.nn.Module, image: torch.Tensor | None
    ) -> tuple[type, dict[str, Any], dict[str, Any]]:
        """Without a start image, Wan's text-to-video; with one, ``WanImageToVideoPipeline`` with the folder's VAE
        (loaded beside the transformer, in its dtype, to encode the image) and the image as the PIL image ComfyUI's
        LoadImage read, which the pipeline resizes to width × height."""
        if image is None:
            return super().start_image(model_dir, transformer, image)
        if image.shape[0] != 1:
            raise ValueError(f"{self.name} starts every clip from one image (image); got {image.shape[0]}.")
        from diffusers import WanImageToVideoPipeline

        vae = self.load_vae(model_dir, transformer.dtype, str(transformer.device))
        return WanImageToVideoPipeline, {"vae": vae}, {"image": pil_images(image)[0]}

    def decoder_channels(self, vae_config: dict) -> int:
        return vae_config.get("decoder_base_dim") or vae_config["base_dim"]  # Wan 2.2's decoder is wider (256)
