"""FLUX.2 [klein] 4B / 9B: FLUX.2 with a Qwen3 text encoder (``Flux2KleinPipeline``). Its transformer and VAE are
FLUX.2's classes (the same ``_cp_plan`` / ``_tp_plan``), without the guidance embedding; its LATENT is FLUX.2's
(ComfyUI's ``latent_formats.Flux2``), so the decode, the image encode and the LoRA reading are FLUX.2's.

What differs from FLUX.2-dev:

- the text encoder: Qwen3 (4B for [klein] 4B, 8B for 9B), its hidden states 9, 18 and 27 stacked, the prompt in
  Qwen3's chat template with thinking off, padded to 512 tokens;
- guidance: the distilled models ([klein] 4B / 9B, ``is_distilled`` in ``model_index.json``: 4 steps, no guidance)
  take none; the base models ([klein] base 4B / 9B: about 50 steps) guide by classifier-free guidance against a
  negative prompt (the pipeline's ``guidance_scale``, 4 by default), which the pack calls true CFG (``true_cfg_scale``,
  the negative prompt encoded beside the prompt), so cfg_parallel splits its two passes;
- the pipeline hands back the latent de-normalised and unpatchified, which needs the VAE's batch-norm statistics: the
  denoise loads the (small) VAE beside the transformer, and keeps the last step's packed latents, ComfyUI's LATENT.

A diffusers folder is told from FLUX.2-dev's by ``model_index.json``'s ``_class_name``; ComfyUI's files by the
transformer's missing guidance embedding and the Qwen3 text encoder (``files.py``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ...wire import Prompts, Sampling
from ..base import OnStep, Placement, check_size, expand_batch, generators, load_placed, scheduler_for, step_callback
from ..flux2.adapter import Flux2, comfy_latent, from_image


class Flux2Klein(Flux2):
    key = "flux2_klein"
    name = "FLUX.2 [klein]"
    pipeline = "Flux2KleinPipeline"
    # Flux2KleinPipeline's tokenizer_max_length, the chat template included.
    max_sequence_length = 512
    true_cfg = True

    def load_text_encoders(self, model_dir: str, dtype: torch.dtype, placement: Placement) -> Any:
        from diffusers import Flux2KleinPipeline

        return load_placed(
            Flux2KleinPipeline, model_dir, dtype, placement, f"{self.name} text encoder", transformer=None, vae=None
        )

    @torch.no_grad()
    def encode(self, pipe: Any, prompts: Prompts) -> dict[str, torch.Tensor]:
        """Qwen3, one row per prompt and, for the base models' CFG, per negative prompt (the pipeline's own negative
        is ""). ``max_sequence_length`` counts the chat template too: the pipeline pads / cuts the whole text to it."""
        if prompts.prompts_2 is not None:
            raise ValueError(f"{self.name} has one text encoder; prompt_2 has nothing to feed.")
        out = {"prompt_embeds": _encode(pipe, prompts.prompts, prompts.max_sequence_length)}
        if prompts.negative_prompts is not None:
            out["negative_prompt_embeds"] = _encode(pipe, prompts.negative_prompts, prompts.max_sequence_length)
        return out

    def denoise_components(self, references: bool) -> tuple[str, ...]:
        return ("vae",)  # also without references: its pipeline reads the VAE's batch-norm statistics

    def takes_cfg(self, model_index: dict) -> bool:
        return not _is_distilled(model_index)

    def cfg_refusal(self, model_dir: str, true_cfg_scale: float) -> str | None:
        if not _distilled(model_dir):
            return None
        return (
            f"{true_cfg_scale} asks for CFG, but this {self.name} is step-distilled (model_index.json's is_distilled) "
            "and takes no guidance; set true_cfg_scale to 1, or use a [klein] base model"
        )

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
        """LATENT samples [batch_size, 4 x VAE channels, height/16, width/16], FLUX.2's. CFG (two transformer passes
        per step) when ``true_cfg_scale`` > 1 and the embeddings hold negative ones, as the pipeline's
        ``guidance_scale``; a distilled model refuses it. ``guidance_scale`` (FLUX.2-dev's embedded guidance) has no
        layer to reach. Given a latent image, the tail of the schedule from the noised image, as FLUX.2's
        (``from_image``). ``image``, ``image_2``, ``image_3``: reference IMAGEs, which ``Flux2KleinPipeline`` resizes
        and places in the sequence as ``Flux2Pipeline`` does (FLUX.2-dev's ``reference_size`` holds)."""
        from diffusers import Flux2KleinPipeline

        check_size(self, sampling)
        references = self.reference_pictures(latent_image, image, image_2, image_3)
        distilled = _distilled(model_dir)
        cfg_scale = sampling.true_cfg_scale or 1.0
        cfg = cfg_scale > 1 and "negative_prompt_embeds" in embeds
        if cfg and distilled:
            raise ValueError(f"true_cfg_scale: {self.cfg_refusal(model_dir, cfg_scale)}")
        scheduler = scheduler_for(model_dir, sampling)
        # The pipeline de-normalises its result with the VAE's batch-norm statistics, even for output_type="latent".
        vae = self.load_vae(model_dir, transformer.dtype, str(transformer.device))
        pipe = Flux2KleinPipeline(
            scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer,
            is_distilled=distilled,
        )  # fmt: skip
        pipe.set_progress_bar_config(disable=True)
        device = pipe._execution_device
        # Passed-in embeddings are used as given (the pipeline repeats only what it encodes itself), and their dtype
        # sets the latents' dtype.
        batch = {
            name: tensor.to(device=device, dtype=transformer.dtype)
            for name, tensor in expand_batch(embeds, sampling.batch_size).items()
        }
        schedule: dict[str, Any] = {"num_inference_steps": sampling.steps}
        on_step_end = step_callback(on_step)
        if latent_image is not None:
            pipe.scheduler, schedule, on_step_end = from_image(
                scheduler, sampling, latent_image, noise_mask, batch["prompt_embeds"].dtype, device, on_step_end
            )
        last: dict[str, torch.Tensor] = {}

        def keep_last(pipeline: Any, step_index: int, timestep: torch.Tensor, callback_kwargs: dict) -> dict:
            # The packed latents after each step (as a blend puts them back): after the last, ComfyUI's LATENT.
            outputs = on_step_end(pipeline, step_index, timestep, callback_kwargs)
            last["latents"] = outputs.get("latents", callback_kwargs["latents"])
            return outputs

        pipe(
            prompt_embeds=batch["prompt_embeds"],
            negative_prompt_embeds=batch["negative_prompt_embeds"] if cfg else None,
            guidance_scale=cfg_scale if cfg else 1.0,
            height=sampling.height,
            width=sampling.width,
            generator=generators(sampling.seed, sampling.batch_size),
            output_type="latent",
            callback_on_step_end=keep_last,
            **({"image": references} if references else {}),
            **schedule,
        )
        return comfy_latent(last["latents"], sampling)


def _encode(pipe: Any, prompts: tuple[str, ...], max_sequence_length: int) -> torch.Tensor:
    prompt_embeds, _text_ids = pipe.encode_prompt(prompt=list(prompts), max_sequence_length=max_sequence_length)
    # `_text_ids` are position ids derived from the sequence length; the denoise stage rebuilds them.
    return prompt_embeds.cpu()


def _distilled(model_dir: str) -> bool:
    """The folder's ``is_distilled`` (``Flux2KleinPipeline``'s flag: a step-distilled model takes no guidance)."""
    with open(os.path.join(model_dir, "model_index.json")) as f:
        return _is_distilled(json.load(f))


def _is_distilled(model_index: dict) -> bool:
    return bool(model_index.get("is_distilled", False))
