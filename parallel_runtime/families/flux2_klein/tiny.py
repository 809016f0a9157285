"""FLUX.2 [klein]'s tiny builders: a random-weight Flux2KleinPipeline folder (``make_tiny_model``) and the same kind of
model written as ComfyUI distributes [klein] (``make_tiny_klein_files``).

The tiny pipeline: a Qwen3 text encoder of 28 layers (the pipeline stacks hidden states 9, 18 and 27, the last of
them before the final norm as in the real 36-layer model), tokenized by a byte-level BPE Qwen2 tokenizer whose
whole-word tokens cover the chat template, and FLUX.2's tiny transformer (without the guidance embedding) and VAE
(``flux2/tiny.py``). ComfyUI's files: the transformer and the VAE in Black Forest Labs' layouts (FLUX.2's inverse
mappings), Qwen3 in transformers' names without a language head, as ``qwen_3_4b.safetensors``.
"""

from __future__ import annotations

import os
import re

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
from tokenizers import pre_tokenizers
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

from ..flux.tiny import SCHEDULER_CONFIG
from ..flux2 import files as flux2_files
from ..flux2.tiny import (
    BFL_LORA_LAYERS,
    LORA_LAYERS,
    files_transformer,
    files_vae,
    tiny_transformer,
    tiny_vae,
    write_files,
)
from ..tiny import FORMATS, WORDS, learn_bpe_merges, pre_tokenize
from . import files as klein_files

# The tiny LoRAs' layers and BFL's names for them: FLUX.2's (the same tiny transformer, ``families/tiny.py`` reads them
# by the family's key).
__all__ = ["BFL_LORA_LAYERS", "LORA_LAYERS", "make_tiny_klein_files", "make_tiny_model"]

# Qwen's special tokens the chat template uses (the first is also the padding).
_QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _qwen3_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE Qwen2 tokenizer (Qwen3's class) with Qwen3's chat template, whose whole-word tokens cover the
    template's text, so that a short ``max_sequence_length`` still leaves room for the prompt."""
    template = Qwen2Tokenizer(chat_template=klein_files.CHAT_TEMPLATE).apply_chat_template(
        [{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    texts = re.split("|".join(re.escape(token) for token in _QWEN_SPECIAL_TOKENS), template)
    # Each word both at the start of the prompt and after a space ("Ġword"): byte-level BPE tells them apart.
    texts += [" ".join(WORDS), " " + " ".join(WORDS)]
    merges = learn_bpe_merges([list(word) for word in pre_tokenize(Qwen2Tokenizer().backend_tokenizer, texts)])
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in merges] + list(_QWEN_SPECIAL_TOKENS)
    vocab = {token: index for index, token in enumerate(dict.fromkeys(tokens))}
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        extra_special_tokens=list(_QWEN_SPECIAL_TOKENS[1:]),
        chat_template=klein_files.CHAT_TEMPLATE,
    )


def _qwen3(tokenizer: Qwen2Tokenizer) -> Qwen3ForCausalLM:
    """A 16-wide Qwen3 of 28 layers (random weights from torch's generator) for ``tokenizer``, its embeddings tied to
    its head as Qwen3-4B's (ComfyUI's file carries no head)."""
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=klein_files.HIDDEN_STATES_LAYERS[-1] + 1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=klein_files.QWEN3_MAX_POSITIONS,
            rms_norm_eps=klein_files.QWEN3_RMS_NORM_EPS,
            rope_parameters={"rope_type": "default", "rope_theta": klein_files.QWEN3_ROPE_THETA},
            tie_word_embeddings=True,
            bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        )
    )


def make_tiny_model(out_dir: str, seed: int = 0, distilled: bool = True) -> str:
    """Build a tiny FLUX.2 [klein] pipeline (Qwen3 + Flux2 transformer without guidance + FLUX.2's VAE) in `out_dir`;
    ``distilled``: as [klein] 4B / 9B (guidance off), else as their base models (CFG)."""
    tokenizer = _qwen3_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = _qwen3(tokenizer)
        transformer = tiny_transformer(guidance_embeds=False)
        vae = tiny_vae()
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=distilled,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return os.fspath(out_dir)


def make_tiny_klein_files(
    models_dir: str,
    reference_root: str,
    comfy_dir: str,
    *,
    seed: int = 0,
    formats: tuple[str, ...] = FORMATS,
    base: bool = False,
) -> dict[str, tuple[dict[str, str], str]]:
    """Write a tiny FLUX.2 [klein] as ComfyUI's files under ``models_dir`` (one transformer file per format in
    ``formats``, named as ComfyUI's, with ``-base-`` for a ``base`` model) and for each a diffusers folder below
    ``reference_root`` with the same weights, laid out as black-forest-labs/FLUX.2-klein-4B's (Qwen3ForCausalLM) with
    ComfyUI's Qwen tokenizer (``comfy_dir``'s) and Qwen3's chat template. Returns, per format, the widgets' values and
    the reference folder.

    What the files do not carry the conversion takes from FLUX.2 and Qwen3 themselves, so the tiny model keeps those
    values: heads 128 wide with the rotary axes (32, 32, 32, 32), 32 VAE norm groups, Qwen3's RoPE and norms."""
    if not formats or set(formats) - set(FORMATS):
        raise ValueError(f"formats must be some of {FORMATS}")
    tokenizer = Qwen2Tokenizer.from_pretrained(
        os.path.join(comfy_dir, *klein_files.TOKENIZER.source.split("/")), chat_template=klein_files.CHAT_TEMPLATE
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = _qwen3(tokenizer)
        transformer, vae = files_transformer(guidance_embeds=False), files_vae()
    # The dtypes ComfyUI distributes them in: the text encoder and the transformer in bf16 (or fp8), the VAE fp32.
    text_encoder.to(torch.bfloat16)
    weights = transformer.state_dict()
    transformer.to(torch.bfloat16)
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            **{k: v for k, v in flux2_files.SCHEDULER.items() if not k.startswith("_")}
        ),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=not base,
    )
    names = {
        "text_encoder": "tiny_qwen_3_4b.safetensors",
        "text_encoder_2": "none",
        "vae": "tiny_flux2-vae.safetensors",
    }
    language = {k: v for k, v in text_encoder.state_dict().items() if k.startswith("model.")}  # no (tied) head
    stem = "tiny-flux-2-klein-base-4b" if base else "tiny-flux-2-klein-4b"
    return write_files(
        models_dir, reference_root, stem, pipe, names, {names["text_encoder"]: language}, weights, formats
    )
