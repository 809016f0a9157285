"""Wan: ``WanPipeline`` text-to-video — Wan 2.1 (one transformer) and Wan 2.2 A14B (two experts: ``transformer`` for
high noise, ``transformer_2`` for low noise, switched per step at ``boundary_ratio`` × 1000) — with a UMT5 text
encoder and Wan 2.1's video VAE (``AutoencoderKLWan``).

Between the stages travel ComfyUI's types:

- embeddings: ``prompt_embeds`` [B, max_sequence_length, hidden], and ``negative_prompt_embeds`` for CFG, on the CPU.
  Wan has no text mask: the pipeline zero-pads every prompt to ``max_sequence_length`` and the transformer attends to
  the padding, so the video depends on that length; the embeddings are padded exactly as the pipeline pads them;
- LATENT samples: [B, 16, T, H/8, W/8] with T = (frames - 1) / 4 + 1, the VAE's own (un-normalised) latents:
  ComfyUI's ``latent_formats.Wan21`` normalises inside the model, not in the LATENT;
- IMAGE: a clip's frames, [B·frames, H, W, 3] float32 in 0..1 (clip by clip), which ComfyUI's video nodes take.

Image-to-video (``WanImageToVideoPipeline``) is this adapter with the start image's denoise: ``families/wan_i2v``;
Wan 2.2 TI2V-5B (``expand_timesteps``: a timestep per token, a 48-channel 16× VAE), with or without a start image,
is ``families/wan_ti2v``.

Wan's CFG is real classifier-free guidance (two transformer passes per step against the negative prompt): the pack's
true CFG, so ParallelSampler's ``true_cfg_scale`` is the pipeline's ``guidance_scale`` and ``cfg_parallel`` splits its
passes; Wan 2.2's ``guidance_scale_2`` guides the second expert.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ...samplers import Sampler
from ...wire import Prompts, Sampling
from ..base import (
    FamilyAdapter,
    LatentLayout,
    LaterExpert,
    OnStep,
    Placement,
    check_size,
    comfy_image,
    expand_batch,
    generators,
    latent_statistics,
    load_placed,
    scheduler_for,
    step_callback,
)

SECOND_EXPERT = "transformer_2"  # Wan 2.2 A14B's low-noise expert: its subfolder and the pipeline's argument


def pipeline_config(model_dir: str) -> dict:
    """The folder's ``model_index.json``: its components and the pipeline's config (``boundary_ratio``, ...)."""
    with open(os.path.join(model_dir, "model_index.json")) as f:
        return json.load(f)


def has_second_expert(config: dict) -> bool:
    """``model_index.json`` names a second expert (Wan 2.2 A14B), whose ``boundary_ratio`` switches to it."""
    return config.get("boundary_ratio") is not None or (config.get(SECOND_EXPERT) or [None])[0] is not None


class Wan(FamilyAdapter):
    key = "wan"
    name = "Wan"
    pipeline = "WanPipeline"
    max_sequence_length = 512  # WanPipeline's default; it pads every prompt to the length it is given
    pads_text = True
    true_cfg = True
    splits_text = False  # Wan's _cp_plan splits only the video tokens; the text stays whole on every rank
    takes_latent_image = False  # text-to-video only (WanVideoToVideoPipeline is not wired)
    latent = LatentLayout(ndims=(5,), vae_channels_key="z_dim", temporal_downscale=4)
    # uni_pc is the pipeline's own (what a video equal to WanPipeline's needs); euler and lcm run with the folder's
    # flow_shift as their shift.
    samplers = (Sampler.UNI_PC, Sampler.EULER, Sampler.LCM)
    block_lists: ClassVar[dict[str, str]] = {"num_layers": "blocks"}
    taylorseer_layers = (r"blocks\.\d+\.attn[12]",)  # both attentions of every block, as FLUX's defaults hook
    # A clip's decode holds far more than an image VAE's 8 maps: the causal decoder upsamples each latent frame into 4
    # frames at full resolution and caches the frames before. Measured on random AutoencoderKLWan (Wan 2.1's layout,
    # base_dim 32 and 64, 256² to 512², 3 to 21 latent frames; the peak resident set over the weights): 60 to 79
    # maps of base_dim at one frame's size (tests/test_wan.py keeps it), 29 for a single frame.
    decode_copies = 76
    # The pipeline's components that the text stage leaves out (Wan I2V's pipeline adds its image encoder's).
    not_text: ClassVar[tuple[str, ...]] = ("transformer", "transformer_2", "vae")

    def pipeline_class(self) -> type:
        """The family's diffusers pipeline class (``pipeline``)."""
        import diffusers

        return getattr(diffusers, self.pipeline)

    def load_text_encoders(self, model_dir: str, dtype: torch.dtype, placement: Placement) -> Any:
        return load_placed(
            self.pipeline_class(),
            model_dir,
            dtype,
            placement,
            f"{self.name} text encoder",
            **dict.fromkeys(self.not_text),
        )

    @torch.no_grad()
    def encode(self, pipe: Any, prompts: Prompts) -> dict[str, torch.Tensor]:
        """The prompts and, for CFG, the negative prompts ("" is a valid, empty one), each padded with zeros to
        ``max_sequence_length`` as the pipeline pads them."""
        if prompts.prompts_2 is not None:
            raise ValueError("Wan has one text encoder; prompt_2 has nothing to feed.")

        def encoded(texts: tuple[str, ...]) -> torch.Tensor:
            embeds, _ = pipe.encode_prompt(
                prompt=list(texts), do_classifier_free_guidance=False, max_sequence_length=prompts.max_sequence_length
            )
            return embeds.cpu()

        out = {"prompt_embeds": encoded(prompts.prompts)}
        negative = prompts.negative_prompts
        if negative is not None:
            if len(negative) != len(prompts.prompts):
                raise ValueError(
                    f"{len(negative)} negative prompts for {len(prompts.prompts)} prompts; give one per prompt."
                )
            out["negative_prompt_embeds"] = encoded(negative)
        return out

    def transformer_class(self) -> type:
        from diffusers import WanTransformer3DModel

        return WanTransformer3DModel

    def lora_state_dict(self, path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, dict | None]:
        """diffusers' reading (the diffusers / PEFT layout, musubi-tuner's ``lora_unet_…``, ComfyUI's
        ``diffusion_model.…``), checked for what step-distillation LoRAs (lightx2v's) carry beside their pairs:
        ``.diff_b`` (a layer's bias change) and ``.diff`` (a weight change) keys, which ComfyUI adds to the layers.
        diffusers reads a linear layer's ``diff_b`` as PEFT's ``lora_B.bias`` (applied with the pair) and
        ``head.head.diff`` as a pair, and drops the rest unnoticed (the norms', the modulations'): where what it
        drops is zero (as lightx2v's norms' are) that changes nothing; a non-zero one is refused by name."""
        from safetensors import safe_open

        from ..lora import LoraError

        with safe_open(path, framework="pt") as f:
            diffs = {key: f.get_tensor(key) for key in f.keys() if key.endswith((".diff", ".diff_b"))}
        state_dict, alphas, metadata = super().lora_state_dict(path)
        kept = list(state_dict.values())
        dropped = [
            key
            for key, value in diffs.items()
            if value.count_nonzero() and not any(k.shape == value.shape and torch.equal(k, value) for k in kept)
        ]
        if dropped:
            raise LoraError(
                f"holds {len(dropped)} weight or bias changes that diffusers leaves out ({dropped[0]}"
                f"{', …' if len(dropped) > 1 else ''}: diff / diff_b keys beside the pairs, as step-distillation "
                "LoRAs carry) and that are not zero, so the LoRA would not be the one its authors made; use "
                "ComfyUI's own Wan nodes and LoraLoaderModelOnly for this file, or a release without them"
            )
        return state_dict, alphas, metadata

    def transformer_subfolders(self, model_dir: str) -> tuple[str, ...]:
        return ("transformer", SECOND_EXPERT) if has_second_expert(pipeline_config(model_dir)) else ("transformer",)

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
        transformer_2: torch.nn.Module | LaterExpert | None = None,
        image: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """LATENT samples [batch_size, 16, (frames - 1) / 4 + 1, height/8, width/8] (Wan 2.2 TI2V-5B: 48 channels,
        /16, its ``latent``). CFG runs when ``true_cfg_scale`` > 1 and the embeddings hold negative ones: two passes
        per step, at ``true_cfg_scale`` for the first expert and ``guidance_scale_2`` (default: the same) for Wan 2.2's
        second, ``transformer_2``, which a Wan 2.2 A14B folder needs (a ``LaterExpert``: loaded at the boundary, in the
        first's place). ``guidance_scale`` (FLUX's distilled guidance) is not Wan's. ``image``: the clip's first
        frame, for Wan I2V and Wan 2.2 TI2V only (``start_image``)."""
        from diffusers import AutoencoderKLWan

        if latent_image is not None or noise_mask is not None:
            raise ValueError(f"{self.name} takes no latent_image (no video-to-video).")
        check_size(self, sampling)
        config = pipeline_config(model_dir)
        boundary_ratio = config.get("boundary_ratio")
        if has_second_expert(config) and transformer_2 is None:
            raise ValueError(f"{model_dir} is Wan 2.2 A14B, whose second expert ({SECOND_EXPERT}) was not loaded.")
        cfg_scale = sampling.true_cfg_scale or 1.0
        do_cfg = cfg_scale > 1 and "negative_prompt_embeds" in embeds
        pipeline, components, image_arguments = self.start_image(model_dir, transformer, image)
        pipe = pipeline(
            tokenizer=None,
            text_encoder=None,
            scheduler=scheduler_for(model_dir, sampling),
            transformer=transformer,
            transformer_2=None if isinstance(transformer_2, LaterExpert) else transformer_2,
            boundary_ratio=boundary_ratio,
            expand_timesteps=bool(config.get("expand_timesteps")),
            **components,
        )
        if pipe.vae is None:  # without a VAE the pipeline takes Wan 2.1's 8× one; Wan 2.2 TI2V-5B's is 16×
            pipe.vae_scale_factor_spatial = self.latent.downscale
        pipe.set_progress_bar_config(disable=True)
        device = pipe._execution_device
        batch = expand_batch(embeds, sampling.batch_size)
        names = ["prompt_embeds", "negative_prompt_embeds"] if do_cfg else ["prompt_embeds"]
        conditioning = {name: batch[name].to(device=device, dtype=transformer.dtype) for name in names}
        second = {}
        if boundary_ratio is not None:
            second["guidance_scale_2"] = sampling.guidance_scale_2 if do_cfg else None
        latents = pipe(
            **conditioning,
            **image_arguments,
            # CFG off is the pipeline's guidance_scale 1 (> 1 would make it encode a negative prompt itself).
            guidance_scale=cfg_scale if do_cfg else 1.0,
            **second,
            num_inference_steps=sampling.steps,
            height=sampling.height,
            width=sampling.width,
            num_frames=sampling.frames,
            max_sequence_length=batch["prompt_embeds"].shape[1],
            generator=generators(sampling.seed, sampling.batch_size),
            output_type="latent",
            callback_on_step_end=_swapping(step_callback(on_step), transformer_2, boundary_ratio),
        ).frames
        # What WanPipeline does before `vae.decode`, without the VAE's weights: undo the per-channel normalisation,
        # in float32 (ComfyUI's LATENT dtype) even for a bf16 transformer.
        mean, inverse_std = latent_statistics(AutoencoderKLWan.load_config(model_dir, subfolder="vae"))
        return latents.float().cpu() / inverse_std + mean

    def start_image(
        self, model_dir: str, transformer: torch.nn.Module, image: torch.Tensor | None
    ) -> tuple[type, dict[str, Any], dict[str, Any]]:
        """The pipeline class that makes the clip, its components and its call arguments for the clip's start image:
        text-to-video has none (and no VAE in the denoise)."""
        if image is not None:
            raise ValueError(f"{self.name} makes clips from text; it takes no start image.")
        return self.pipeline_class(), {"vae": None}, {}

    def load_vae(self, model_dir: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
        from diffusers import AutoencoderKLWan

        return load_placed(AutoencoderKLWan, model_dir, dtype, Placement(device), "Wan VAE", subfolder="vae")

    @torch.no_grad()
    def decode(self, vae: torch.nn.Module, samples: torch.Tensor) -> torch.Tensor:
        """LATENT samples [B, C, T, h, w] (un-normalised) to the clips' frames, an IMAGE [B·frames, H, W, 3]."""
        if samples.ndim != 5:
            raise ValueError(f"Wan LATENTs are [B, C, frames, h, w]; got {list(samples.shape)}.")
        video = vae.decode(samples.to(device=vae.device, dtype=vae.dtype), return_dict=False)[0]
        return comfy_image(video.transpose(1, 2).flatten(0, 1))

    @torch.no_grad()
    def encode_image(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        raise ValueError("Wan runs text-to-video only; VAEEncodeSingleGPU has no Wan latent to make yet.")

    def decoder_channels(self, vae_config: dict) -> int:
        return vae_config["base_dim"]  # Wan 2.1's VAE: base_dim × dim_mult per level, the first level at × 1


def _swapping(step_end: Callable[..., dict], later: object, boundary_ratio: float | None) -> Callable[..., dict]:
    """The pipeline's step callback, which, when the second expert comes ``later``, loads it in the first one's place
    after the last step before the boundary: the pipeline reads ``transformer_2`` at each step, and its scheduler (with
    UniPC's history of the earlier steps) runs on untouched, so the clip is the one both experts resident make."""
    if not isinstance(later, LaterExpert) or boundary_ratio is None:  # no boundary: the first expert runs every step
        return step_end

    def swapped(pipeline: Any, step_index: int, timestep: torch.Tensor, callback_kwargs: dict) -> dict:
        out = step_end(pipeline, step_index, timestep, callback_kwargs)
        timesteps = pipeline.scheduler.timesteps
        following = step_index + 1
        boundary = boundary_ratio * pipeline.scheduler.config.num_train_timesteps
        if pipeline.transformer_2 is None and following < len(timesteps) and timesteps[following] < boundary:
            pipeline.transformer = None
            pipeline.transformer_2 = later.load(following)
        return out

    return swapped
