"""ParallelSampler's ``positive`` and ``negative``: the pack's own conditioning (EncodeOnBalancedGPUs) or ComfyUI's
CONDITIONING from its text-encode nodes, checked against the transformer and turned into the family's diffusers
inputs. Only tensors go on to the backend; nothing of ComfyUI's text-encoder models does.

ComfyUI's CONDITIONING is a list of ``[embeddings, {"pooled_output": ..., "guidance": ..., "attention_mask": ...}]``
entries. What each family's pipeline takes of it:

- FLUX.1: ``prompt_embeds`` (T5) and ``pooled_prompt_embeds`` (CLIP's ``pooled_output``); FluxGuidance's /
  CLIPTextEncodeFlux's ``guidance`` replaces the sampler's guidance_scale.
- FLUX.2: ``prompt_embeds`` (Mistral's three hidden states, stacked); ``guidance`` as for FLUX.1. ComfyUI keeps the
  prompt's own length (padded on the left) where diffusers pads to max_sequence_length: the same prompt gives other
  embeddings, so another image than EncodeOnBalancedGPUs'.
- Qwen-Image: ``prompt_embeds`` and ``prompt_embeds_mask`` (``attention_mask``; ComfyUI drops it when nothing is
  masked: all ones then). ComfyUI drops the chat template's system turn and the user turn's opening as diffusers does
  (diffusers cuts a fixed 34 tokens, ComfyUI finds the turn's start in the tokens): the same tokens remain.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import InvalidInput
from ..families import FamilyAdapter
from .encode import Conditioning
from .transformer import TransformerHandle

# The keys of a CONDITIONING entry's dict that the pack reads; any other (an area, a mask, a timestep range, reference
# latents, a ControlNet, ...) asks for something diffusers' pipeline does not do, and is refused by name.
READ_KEYS = ("pooled_output", "guidance", "attention_mask")


def _entry(name: str, value: Any) -> tuple[torch.Tensor, dict]:
    """The one ``[embeddings, extras]`` entry of ComfyUI's CONDITIONING."""
    if not isinstance(value, list) or not value:
        raise InvalidInput(name, "is neither ComfyUI's CONDITIONING nor EncodeOnBalancedGPUs' output; link one")
    if len(value) > 1:
        raise InvalidInput(
            name,
            f"holds {len(value)} conditionings (ConditioningCombine, areas or timestep ranges), which diffusers' "
            "pipeline cannot mix; link the output of one text-encode node",
        )
    entry = value[0]
    if not (
        isinstance(entry, (list, tuple))
        and len(entry) == 2
        and isinstance(entry[0], torch.Tensor)
        and isinstance(entry[1], dict)
    ):
        raise InvalidInput(name, "is not a CONDITIONING of ComfyUI's form [embeddings, {...}]; link a text-encode node")
    embeds, extras = entry
    unread = sorted(key for key, extra in extras.items() if key not in READ_KEYS and extra is not None)
    if unread:
        raise InvalidInput(
            name,
            f"carries {', '.join(unread)}, which ParallelSampler does not apply (it runs the family's diffusers "
            "pipeline on the prompt's embeddings alone); remove the node that set it",
        )
    if embeds.ndim != 3 or embeds.shape[0] < 1 or embeds.shape[1] < 1:
        raise InvalidInput(name, f"holds embeddings of shape {list(embeds.shape)}, not [prompts, tokens, width]")
    if not embeds.is_floating_point() or not torch.isfinite(embeds).all():
        raise InvalidInput(name, "holds NaN, infinite or non-float embeddings; encode the prompt again")
    return embeds, extras


def _refuse_other(name: str, handle: TransformerHandle, what: str, fits: str) -> InvalidInput:
    family = handle.family
    return InvalidInput(
        name,
        f"ComfyUI's CONDITIONING {what}, but {handle.spec.model.name}'s transformer ({family.name}) takes {fits}; it "
        f"was encoded for another model: encode with {family.name}'s text encoder: {family.comfy_text_encoder_words()}",
    )


def _comfy_tensors(name: str, handle: TransformerHandle, value: list) -> tuple[dict[str, torch.Tensor], float | None]:
    """ComfyUI's CONDITIONING as the family's diffusers inputs (``prompt_embeds``, ...), and its ``guidance``."""
    family: FamilyAdapter = handle.family
    embeds, extras = _entry(name, value)
    rows, tokens, width = embeds.shape
    text_width = handle.config.get("joint_attention_dim")
    pooled = extras.get("pooled_output")
    fits = f"{text_width}-wide text embeddings" + (" with a pooled embedding" if family.pooled_text else "")
    if text_width and width != text_width:
        with_pooled = " with a pooled_output" if pooled is not None else ""
        raise _refuse_other(name, handle, f"holds {width}-wide text embeddings{with_pooled}", fits)
    # Float32 as ComfyUI's own samplers hand them on; the ranks cast to the transformer's dtype.
    out = {"prompt_embeds": embeds.detach().to("cpu", torch.float32).contiguous()}
    if family.pooled_text:
        pooled_width = handle.config.get("pooled_projection_dim")
        if not isinstance(pooled, torch.Tensor):
            raise _refuse_other(name, handle, "has no pooled_output", fits)
        if pooled.shape != (rows, pooled_width):
            raise _refuse_other(name, handle, f"has a pooled_output of shape {list(pooled.shape)}", fits)
        out["pooled_prompt_embeds"] = pooled.detach().to("cpu", torch.float32).contiguous()
    elif pooled is not None:
        raise _refuse_other(name, handle, "has a pooled_output (CLIP's, as FLUX.1's and SD3's encoders make)", fits)
    if family.text_mask:
        mask = extras.get("attention_mask")
        if mask is None:  # ComfyUI drops a mask that masks nothing
            mask = torch.ones(rows, tokens, dtype=torch.int64)
        elif not isinstance(mask, torch.Tensor) or mask.shape != (rows, tokens):
            shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise InvalidInput(name, f"has an attention_mask of shape {shape} for {rows}×{tokens} tokens")
        out["prompt_embeds_mask"] = mask.detach().to("cpu", torch.int64).contiguous()
    guidance = extras.get("guidance")
    if guidance is not None and (
        isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not math.isfinite(guidance)
    ):
        raise InvalidInput(name, f"has a guidance of {guidance!r}, not a finite number; set it again (FluxGuidance)")
    return out, None if guidance is None else float(guidance)


def _describe_comfy(tensors: dict[str, torch.Tensor], guidance: float | None) -> str:
    rows, tokens, width = tensors["prompt_embeds"].shape
    parts = [f"ComfyUI's CONDITIONING ({tokens} tokens × {width}" + (f", {rows} prompts" if rows > 1 else "") + ")"]
    if guidance is not None:
        parts.append(f"guidance {guidance:g}")
    return ", ".join(parts)


def read_positive(handle: TransformerHandle, positive: Any) -> Conditioning:
    """ParallelSampler's ``positive``: the pack's Conditioning as it is, or ComfyUI's CONDITIONING turned into one
    (no model: its shapes are checked here against the transformer, by name)."""
    if isinstance(positive, Conditioning):
        return positive
    tensors, guidance = _comfy_tensors("positive", handle, positive)
    return Conditioning(
        model=None, prompts=(), tensors=tensors, source=_describe_comfy(tensors, guidance), guidance=guidance
    )


def with_negative(handle: TransformerHandle, conditioning: Conditioning, negative: Any) -> tuple[Conditioning, str]:
    """The conditioning with ParallelSampler's ``negative`` as true CFG's negative prompt, and what to say about it on
    the node. The ``negative`` input wins over a negative prompt on EncodeOnBalancedGPUs; families without true CFG
    ignore it (as they ignore true_cfg_scale)."""
    family = handle.family
    if negative is None:
        if "negative_prompt_embeds" in conditioning.tensors:
            return conditioning, "negative: EncodeOnBalancedGPUs' negative_prompt"
        return conditioning, ""
    if not family.true_cfg:
        return conditioning, f"negative: ignored ({family.name} has no true CFG)"
    if isinstance(negative, Conditioning):
        if negative.model is not None and negative.model.family != handle.spec.model.family:
            raise InvalidInput(
                "negative",
                f"was encoded with {negative.model.name} but the transformer is {handle.spec.model.name} "
                f"({family.name}); encode it with the same model as the transformer",
            )
        tensors = {name: tensor for name, tensor in negative.tensors.items() if not name.startswith("negative_")}
        said = negative.source
    else:
        tensors, _guidance = _comfy_tensors("negative", handle, negative)
        said = _describe_comfy(tensors, None)
    rows = tensors["prompt_embeds"].shape[0]
    if rows not in (1, conditioning.count):
        raise InvalidInput(
            "negative",
            f"holds {rows} prompts but positive holds {conditioning.count}; give one negative for all of them, or one "
            "per prompt",
        )
    # One negative row per prompt, as EncodeOnBalancedGPUs makes them.
    negatives = {
        f"negative_{name}": tensor.expand(conditioning.count, *tensor.shape[1:]).contiguous()
        for name, tensor in tensors.items()
    }
    positives = {name: tensor for name, tensor in conditioning.tensors.items() if not name.startswith("negative_")}
    overrides = (
        " (instead of EncodeOnBalancedGPUs' negative_prompt)"
        if "negative_prompt_embeds" in conditioning.tensors
        else ""
    )
    merged = Conditioning(
        model=conditioning.model,
        prompts=conditioning.prompts,
        tensors={**positives, **negatives},
        source=conditioning.source,
        guidance=conditioning.guidance,
        images=conditioning.images,
    )
    return merged, f"negative: {said}{overrides}"
