"""ParallelSampler's step: check steps, sizes and the conditioning against the transformer's family and strategy,
then denoise on the transformer's backend."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..client import ProgressFn, get_backend
from ..errors import InvalidInput
from ..families import FamilyAdapter
from ..strategy import Strategy
from ..wire import CacheReport, DenoiseArgs, Sampling
from .encode import Conditioning
from .transformer import TransformerHandle
from .widgets import check_finite


def _check_size(widget: str, value: int, multiple: int) -> None:
    if value < multiple or value % multiple:
        lower, upper = max(multiple, value // multiple * multiple), (value // multiple + 1) * multiple
        raise InvalidInput(
            widget,
            f"{value} is not a multiple of {multiple} (the VAE downscales 8× and the "
            f"transformer packs 2×2 patches); use {lower} or {upper}",
        )


def _text_streams(family: FamilyAdapter, conditioning: Conditioning, true_cfg_scale: float) -> dict[str, torch.Tensor]:
    """The text embeddings the transformer will see, by the prompt they come from."""
    streams = {"prompt": conditioning.tensors["prompt_embeds"]}
    if family.true_cfg and true_cfg_scale > 1:
        streams["negative prompt"] = conditioning.tensors["negative_prompt_embeds"]
    return streams


def validate_sample(
    handle: TransformerHandle,
    conditioning: Conditioning | None,
    *,
    steps: int,
    width: int,
    height: int,
    batch_size: int,
    guidance_scale: float = 3.5,
    true_cfg_scale: float = 1.0,
    prompts: int | None = 1,
) -> None:
    """Every check ParallelSampler can make before it runs. Without a ``conditioning`` (at validation), ``prompts``
    says how many prompts it will hold; None skips the checks that need to know."""
    family, plan = handle.family, handle.plan
    if steps < family.min_steps:
        raise InvalidInput("steps", f"{steps} steps {family.min_steps_reason}; use at least {family.min_steps}")
    _check_size("width", width, family.pixels_per_token)
    _check_size("height", height, family.pixels_per_token)
    if batch_size < 1:
        raise InvalidInput("batch_size", f"{batch_size} makes no images; use at least 1")
    check_finite("guidance_scale", guidance_scale)
    check_finite("true_cfg_scale", true_cfg_scale)
    if family.true_cfg and true_cfg_scale < 1:
        raise InvalidInput(
            "true_cfg_scale",
            f"{true_cfg_scale} is below 1; use 1 (true CFG off: one transformer pass "
            "per step) or more (guided by the negative prompt: two passes per step)",
        )
    if conditioning is not None and conditioning.model.family != handle.spec.model.family:
        raise InvalidInput(
            "positive",
            f"was encoded with {conditioning.model.name} ({conditioning.family.name}) but "
            f"the transformer is {handle.spec.model.name} ({family.name}); encode with the "
            "same model as the transformer",
        )
    if (
        conditioning is not None
        and family.true_cfg
        and true_cfg_scale > 1
        and "negative_prompt_embeds" not in conditioning.tensors
    ):
        raise InvalidInput(
            "positive",
            f"has no negative prompt for true CFG; re-encode it with "
            f"{handle.spec.model.name}, or set true_cfg_scale to 1",
        )
    if plan.kind is Strategy.CFG_PARALLEL and not (family.true_cfg and true_cfg_scale > 1):
        raise InvalidInput(
            "true_cfg_scale",
            f"{true_cfg_scale} turns true CFG off, so cfg_parallel's second half of the ranks has no pass to run; "
            "raise true_cfg_scale above 1, or use context_parallel on LoadShardedTransformer",
        )
    world = plan.ranks
    prompts = len(conditioning.prompts) if conditioning is not None else prompts
    if plan.splits_batch and prompts is not None and batch_size * prompts < world:
        made = f"batch_size {batch_size} × {prompts} prompts" if prompts > 1 else f"batch_size {batch_size}"
        raise InvalidInput(
            "batch_size",
            f"data_parallel gives each of the {world} ranks whole images, so it needs at "
            f"least {world} images ({made} makes {batch_size * prompts}); raise "
            "batch_size, give more prompts (one_prompt_per_line), or use "
            "context_parallel or tensor_parallel to speed up a single image",
        )
    if plan.splits_tokens and not plan.anything:
        degree = plan.cp_degree
        # The transformer splits image tokens and text tokens separately across the ranks.
        image_tokens = (width // family.pixels_per_token) * (height // family.pixels_per_token)
        if image_tokens % degree:
            raise InvalidInput(
                "width",
                f"{width}×{height} makes {image_tokens} image tokens, which do not split over "
                f"{degree} ranks; turn on anything (Ulysses/Ring-anything) on "
                "LoadShardedTransformer, or pick a size whose token count divides",
            )
        for source, embeds in (_text_streams(family, conditioning, true_cfg_scale) if conditioning else {}).items():
            tokens = embeds.shape[1]
            if not tokens % degree:
                continue
            if family.pads_text:
                fix = f"set max_sequence_length to a multiple of {degree}, or turn on anything"
            else:
                fix = (
                    f"{family.name} keeps each prompt's own length, so turn on anything on LoadShardedTransformer, "
                    "or make that prompt a word longer or shorter"
                )
            raise InvalidInput(
                "positive", f"the {source} is {tokens} text tokens, which do not split over {degree} ranks; {fix}"
            )
    if conditioning is None:
        return
    embeds = conditioning.tensors["prompt_embeds"]
    text_width = handle.config.get("joint_attention_dim")
    if text_width and embeds.shape[-1] != text_width:
        raise InvalidInput(
            "positive",
            f"was encoded with {conditioning.model.name} ({embeds.shape[-1]}-wide text "
            f"embeddings) but {handle.spec.model.name}'s transformer expects {text_width}; "
            "encode with the same model as the transformer",
        )


def sample(
    handle: TransformerHandle,
    conditioning: Conditioning,
    *,
    seed: int,
    steps: int,
    guidance_scale: float,
    width: int,
    height: int,
    batch_size: int = 1,
    true_cfg_scale: float = 4.0,
    on_progress: ProgressFn | None = None,
    should_cancel: Callable[[], bool] | None = None,
    on_cache_report: Callable[[CacheReport], None] | None = None,
) -> torch.Tensor:
    """Denoise on the backend; ComfyUI LATENT samples in the family's layout (FLUX.1 ``[B, 16, H/8, W/8]``, FLUX.2
    ``[B, 128, H/16, W/16]``, Qwen-Image ``[B, 16, 1, H/8, W/8]``). ``true_cfg_scale`` reaches only families with
    true CFG (Qwen-Image; 1 turns it off); ``guidance_scale`` is the distilled guidance of FLUX.1 / FLUX.2.
    ``batch_size`` images are made of each of the conditioning's prompts, prompt by prompt; image i of the whole
    batch uses ``seed + i`` (modulo 2^64), as diffusers' pipelines do with a list of generators. With the
    transformer's step cache on, ``on_cache_report`` gets what it skipped (rank 0's passes)."""
    validate_sample(
        handle,
        conditioning,
        steps=steps,
        width=width,
        height=height,
        batch_size=batch_size,
        guidance_scale=guidance_scale,
        true_cfg_scale=true_cfg_scale,
    )
    sampling = Sampling(
        seed=seed,
        steps=steps,
        guidance_scale=guidance_scale,
        width=width,
        height=height,
        # the backend counts images, prompt by prompt
        batch_size=batch_size * len(conditioning.prompts),
        true_cfg_scale=true_cfg_scale if handle.family.true_cfg else None,
    )
    result = get_backend(handle.backend).call(
        DenoiseArgs(transformer=handle.spec, sampling=sampling),
        conditioning.tensors,
        on_progress=on_progress,
        should_cancel=should_cancel,
    )
    if on_cache_report is not None and result.result.cache is not None:
        on_cache_report(result.result.cache)
    return result.tensors["samples"]
