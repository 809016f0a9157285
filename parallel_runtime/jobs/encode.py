"""EncodeOnBalancedGPUs' step: check the prompt widgets against the model's family, then encode on the backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .. import families, model_folders
from ..client import ProgressFn, get_backend
from ..errors import InvalidInput
from ..spec import BackendSpec
from ..wire import EncodeArgs, ModelRef, Prompts
from .widgets import parse_max_memory, prompt_list, resolve_dtype

# The widget's limit: the longest any family takes (each family checks its own).
MAX_SEQUENCE_LENGTH = max(adapter.max_sequence_length for adapter in families.REGISTRY)


@dataclasses.dataclass(frozen=True)
class Conditioning:
    """Encoded prompts on the CPU, one row per prompt: ``prompt_embeds`` and what the family adds (FLUX.1:
    ``pooled_prompt_embeds``; Qwen-Image: ``prompt_embeds_mask`` and the negative prompt's ``negative_prompt_embeds``
    / ``negative_prompt_embeds_mask``).

    Args:
        model: the model whose text encoders made them (EncodeOnBalancedGPUs); None for ComfyUI's CONDITIONING,
            which says only its shapes (``jobs.conditioning`` checks those against the transformer).
        prompts: the prompts' texts where known (EncodeOnBalancedGPUs).
        source: where they came from, as the sampler's node says it.
        guidance: FLUX's distilled guidance that came with them (ComfyUI's FluxGuidance / CLIPTextEncodeFlux);
            it replaces the sampler's guidance_scale.
    """

    model: ModelRef | None
    prompts: tuple[str, ...]
    tensors: dict[str, torch.Tensor] = dataclasses.field(compare=False)
    negative_prompts: tuple[str, ...] = ()
    source: str = ""
    guidance: float | None = None

    @property
    def count(self) -> int:
        """How many prompts (embedding rows) it holds."""
        return self.tensors["prompt_embeds"].shape[0]


def count_prompts(prompt: str, one_prompt_per_line: bool) -> int:
    """How many prompts EncodeOnBalancedGPUs makes of its ``prompt`` widget."""
    return len(prompt_list("prompt", prompt, one_prompt_per_line))


@dataclasses.dataclass(frozen=True)
class EncodeRequest:
    """EncodeOnBalancedGPUs' widgets, checked: what the encode op needs, minus the backend and the dtype."""

    model: ModelRef
    prompts: Prompts
    max_memory: dict[str, str] | None


def validate_encode(
    *,
    model: str,
    prompt: str,
    prompt_2: str = "",
    negative_prompt: str = "",
    max_sequence_length: int = 512,
    max_memory: str = "",
    one_prompt_per_line: bool = False,
) -> EncodeRequest:
    """Every check EncodeOnBalancedGPUs can make before it runs (also its VALIDATE_INPUTS)."""
    ref = model_folders.resolve(model)
    family = families.family(ref.family)
    prompts = prompt_list("prompt", prompt, one_prompt_per_line)
    if not prompt.strip():
        raise InvalidInput("prompt", "the prompt is empty; describe the image to generate")
    if prompt_2.strip() and family.text_encoders < 2:
        raise InvalidInput(
            "prompt_2",
            f"{family.name} has one text encoder, so prompt_2 has nothing to feed; leave "
            "it empty and put everything in prompt",
        )
    prompts_2 = prompt_list("prompt_2", prompt_2, one_prompt_per_line) if prompt_2.strip() else None
    if prompts_2 is not None and len(prompts_2) != len(prompts):
        raise InvalidInput(
            "prompt_2",
            f"one_prompt_per_line is on: prompt has {len(prompts)} lines but prompt_2 has "
            f"{len(prompts_2)}; give prompt_2 one line per prompt, or leave it empty",
        )
    if not 1 <= max_sequence_length <= family.max_sequence_length:
        raise InvalidInput(
            "max_sequence_length",
            f"{max_sequence_length} is out of range for {family.name}; use 1..{family.max_sequence_length}",
        )
    negative = None
    if family.true_cfg:
        # The same negative prompt for every prompt, empty or not, as ComfyUI encodes an empty negative: whether it
        # is used is the sampler's true_cfg_scale.
        prompt_list("negative_prompt", negative_prompt, False)
        negative = (negative_prompt,) * len(prompts)
    return EncodeRequest(
        ref,
        Prompts(tuple(prompts), tuple(prompts_2) if prompts_2 else None, negative, max_sequence_length),
        parse_max_memory(max_memory),
    )


def encode_prompt(
    spec: BackendSpec,
    *,
    model: str,
    prompt: str,
    prompt_2: str = "",
    negative_prompt: str = "",
    max_sequence_length: int = 512,
    max_memory: str = "",
    dtype: str = "auto",
    one_prompt_per_line: bool = False,
    on_progress: ProgressFn | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> Conditioning:
    """Encode ``prompt`` with the model's text encoders placed ``device_map="balanced"`` across the GPUs.

    With ``one_prompt_per_line`` every non-empty line is a prompt of its own (one embedding row each; the sampler
    makes ``batch_size`` images of each, and data parallelism spreads them over the ranks); ``prompt_2`` then holds
    one line per prompt too, or nothing. Families with true CFG (Qwen-Image) also encode ``negative_prompt``; other
    families ignore it.
    """
    request = validate_encode(
        model=model,
        prompt=prompt,
        prompt_2=prompt_2,
        negative_prompt=negative_prompt,
        max_sequence_length=max_sequence_length,
        max_memory=max_memory,
        one_prompt_per_line=one_prompt_per_line,
    )
    args = EncodeArgs(
        model=request.model, dtype=resolve_dtype(dtype, spec), prompts=request.prompts, max_memory=request.max_memory
    )
    result = get_backend(spec).call(args, on_progress=on_progress, should_cancel=should_cancel)
    return Conditioning(
        model=request.model,
        prompts=request.prompts.prompts,
        tensors=result.tensors,
        negative_prompts=request.prompts.negative_prompts or (),
        source=f"EncodeOnBalancedGPUs ({request.model.name})",
    )
