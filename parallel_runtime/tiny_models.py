"""Tiny random-weight diffusers pipelines, built offline.

Tests, examples and the CPU mode need complete `save_pretrained` directories of FLUX.1 / FLUX.2 / Qwen-Image that
load with the real pipeline classes, yet nothing may come from the Hub. Each builder here constructs every
component from an explicit config (tokenizers from in-memory vocabularies, models with random weights), saves the
pipeline as safetensors and returns the directory.

The shapes keep what the pipelines and the parallel strategies depend on and shrink everything else:

- latent channels and packing are the real ones (16 VAE channels, 2x2 patches), so LATENT tensors have ComfyUI's
  shapes;
- the VAEs have 4 levels, because a pipeline built with `vae=None` (the staged text-encoder / transformer
  stages) assumes `vae_scale_factor=8`;
- the transformers have 4 attention heads, so 2- and 4-way Ulysses and tensor parallelism divide them.

A builder is deterministic for a given seed (weights are drawn in a fixed order from a forked RNG, so the caller's
global RNG is left untouched) and takes a few seconds on 2 CPU cores.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from tokenizers import pre_tokenizers
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel


# Words that get whole-word tokens in the tiny tokenizers; anything else still tokenizes (per character or byte),
# so every prompt is accepted. Distinct prompts give distinct token ids, which is all the tests need.
_WORDS = (
    "a", "an", "the", "of", "on", "in", "with", "and", "photo", "painting", "cat", "dog", "red", "blue",
    "green", "sky", "tree", "house", "city", "night", "sunset", "portrait", "landscape", "astronaut", "horse",
)  # fmt: skip

# FLUX.1-dev's scheduler config: resolution-dependent ("dynamic") shifting of the sigmas, so the tiny pipeline
# exercises the same `mu` computation as the real one.
_FLUX_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}

# FLUX.1's VAE normalisation constants (diffusers: `latents / scaling_factor + shift_factor` before decoding).
# Non-trivial values make a forgotten or doubled scale/shift visible in the tests.
_FLUX_VAE_SCALING_FACTOR = 0.3611
_FLUX_VAE_SHIFT_FACTOR = 0.1159


def _clip_tokenizer() -> CLIPTokenizer:
    """A byte-level BPE CLIP tokenizer with the real special tokens and a few whole-word merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # CLIP's vocabulary layout: the 256 byte symbols, the same with the end-of-word suffix, merge results, then
    # the two special tokens.
    tokens = alphabet + [symbol + "</w>" for symbol in alphabet]
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        # Merge left to right: "c a", "ca t</w>" turns ["c", "a", "t</w>"] into "cat</w>".
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        merged = symbols[0]
        for symbol in symbols[1:]:
            if (merged, symbol) not in merges:
                merges.append((merged, symbol))
                tokens.append(merged + symbol)
            merged = merged + symbol
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: index for index, token in enumerate(dict.fromkeys(tokens))}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def _t5_tokenizer() -> T5TokenizerFast:
    """A Unigram T5 tokenizer: whole words score higher than their characters, so they win the segmentation."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + word, -3.0) for word in _WORDS]
    pieces += [(chr(code), -5.0) for code in range(33, 127)]  # printable ASCII, spaces are the "▁" marker
    # No sentinel <extra_id_*> tokens: they only matter for T5's span-corruption pre-training.
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def make_tiny_flux(out_dir: str, seed: int = 0) -> str:
    """Build a tiny FLUX.1 pipeline (CLIP + T5 + Flux transformer + 16-channel VAE) and save it to `out_dir`."""
    tokenizer = _clip_tokenizer()
    tokenizer_2 = _t5_tokenizer()

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=77,
                projection_dim=32,
                hidden_act="quick_gelu",
                bos_token_id=tokenizer.bos_token_id,
                # Not 2: CLIPTextModel then pools at the first EOS token, as the real FLUX CLIP-L does.
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        text_encoder_2 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_2),
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                feed_forward_proj="gated-gelu",  # T5 v1.1, as in FLUX's text_encoder_2
                is_encoder_decoder=False,
                pad_token_id=tokenizer_2.pad_token_id,
                eos_token_id=tokenizer_2.eos_token_id,
            )
        )
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,  # 16 latent channels x 2x2 packing
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,  # T5 d_model
            pooled_projection_dim=32,  # CLIP hidden_size (FluxPipeline uses CLIP's pooler_output)
            guidance_embeds=True,  # FLUX.1-dev style distilled guidance
            axes_dims_rope=(4, 6, 6),  # must sum to attention_head_dim
        )
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 16, 16),
            layers_per_block=1,
            latent_channels=16,
            norm_num_groups=4,
            sample_size=64,
            scaling_factor=_FLUX_VAE_SCALING_FACTOR,
            shift_factor=_FLUX_VAE_SHIFT_FACTOR,
            use_quant_conv=False,  # as FLUX's VAE
            use_post_quant_conv=False,
        )

    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**_FLUX_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return os.fspath(out_dir)


TINY_MODELS: dict[str, Callable[[str, int], str]] = {
    "flux": make_tiny_flux,
}
