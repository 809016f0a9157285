"""Tiny random-weight diffusers pipelines, built offline.

Tests, examples and the CPU mode need complete `save_pretrained` directories of FLUX.1 / FLUX.2 / Qwen-Image that
load with the real pipeline classes, yet nothing may come from the Hub. Each builder here constructs every
component from an explicit config (tokenizers from in-memory vocabularies, models with random weights), saves the
pipeline as safetensors and returns the directory.

The shapes keep what the pipelines and the parallel strategies depend on and shrink everything else:

- latent channels and packing are the real ones (16 channels for FLUX.1 and Qwen-Image, 32 for FLUX.2; 2x2
  patches), so LATENT tensors have ComfyUI's shapes;
- the VAEs downsample 8x (4 levels), because a pipeline built with `vae=None` (the staged text-encoder /
  transformer stages) assumes `vae_scale_factor=8`;
- VAE normalisations are non-trivial (FLUX.1's scale / shift, FLUX.2's batch-norm statistics, Qwen-Image's
  per-channel mean / std), so a forgotten or doubled one shows up in tests;
- the transformers have 4 attention heads, so 2- and 4-way Ulysses and tensor parallelism divide them;
- prompt templates tokenize to the token counts the pipelines expect.

A builder is deterministic for a given seed (weights are drawn in a fixed order from a forked RNG, so the caller's
global RNG is left untouched) and takes a few seconds on 2 CPU cores.
"""

from __future__ import annotations

import itertools
import os
import re
from collections import Counter

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PixtralImageProcessor,
    PixtralProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from ..families.flux import files as flux_files
from ..families.flux2 import files as flux2_files
from ..families.qwenimage import files as qwenimage_files

# Words that get whole-word tokens in the tiny tokenizers; anything else still tokenizes (per character or byte),
# so every prompt is accepted. Distinct prompts give distinct token ids, which is all the tests need.
_WORDS = (
    "a", "an", "the", "of", "on", "in", "with", "and", "photo", "painting", "cat", "dog", "red", "blue",
    "green", "sky", "tree", "house", "city", "night", "sunset", "portrait", "landscape", "astronaut", "horse",
)  # fmt: skip

# FLUX.1-dev's scheduler config (families.flux_files holds it, for pipelines built from ComfyUI's files):
# resolution-dependent ("dynamic") shifting of the sigmas, so the tiny pipeline exercises the same `mu` computation as
# the real one.
_FLUX_SCHEDULER_CONFIG = {k: v for k, v in flux_files.SCHEDULER_DEV.items() if not k.startswith("_")}

# Mistral's special tokens as FLUX.2's chat template and PixtralProcessor use them.
_MISTRAL_SPECIAL_TOKENS = (
    "<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
    "[IMG_BREAK]", "[IMG_END]",
)  # fmt: skip

# The shape of Mistral's chat template for what Flux2Pipeline sends (a system message, then user text or images; the
# real one also handles tools and assistant turns): families.flux2_files holds it, for pipelines built from ComfyUI's
# files.
_MISTRAL_CHAT_TEMPLATE = flux2_files.CHAT_TEMPLATE

# Qwen-Image's scheduler config (one home: families.qwenimage_files, which ComfyUI's files are converted with).
_QWENIMAGE_SCHEDULER_CONFIG = {k: v for k, v in qwenimage_files.SCHEDULER.items() if not k.startswith("_")}

# Qwen2.5-VL's special tokens; the chat template uses the first three, the vision ones only matter with images.
_QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
)  # fmt: skip

# FLUX.1's VAE normalisation constants (diffusers: `latents / scaling_factor + shift_factor` before decoding).
# Non-trivial values make a forgotten or doubled scale/shift visible in the tests.
_FLUX_VAE_SCALING_FACTOR = flux_files.VAE_SCALING_FACTOR
_FLUX_VAE_SHIFT_FACTOR = flux_files.VAE_SHIFT_FACTOR


def _learn_bpe_merges(words: list[list[str]]) -> list[tuple[str, str]]:
    """Byte-pair encoding learned on `words` (each a list of initial symbols): repeatedly merge the most frequent
    adjacent pair, ties broken by the pair itself, until every word is a single symbol.

    A hand-written learner because the `tokenizers` trainer numbers its vocabulary differently from run to run. With
    these merges every corpus word encodes to exactly one token, which keeps prompt templates at the token counts
    the pipelines expect.
    """
    counts = Counter(tuple(word) for word in words)
    merges = []
    while True:
        pairs = Counter()
        for symbols, count in counts.items():
            for pair in itertools.pairwise(symbols):
                pairs[pair] += count
        if not pairs:
            return merges
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        merged = Counter()
        for symbols, count in counts.items():
            out, i = [], 0
            while i < len(symbols):
                if symbols[i : i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] += count
        counts = merged


def _pre_tokenize(backend: Tokenizer, texts: list[str]) -> list[str]:
    """The words a tokenizer's normalizer and pre-tokenizer cut `texts` into (byte-level symbols)."""
    normalize = backend.normalizer.normalize_str if backend.normalizer else (lambda text: text)
    return [word for text in texts for word, _ in backend.pre_tokenizer.pre_tokenize_str(normalize(text))]


def _clip_tokenizer() -> CLIPTokenizer:
    """A byte-level BPE CLIP tokenizer with CLIP's special tokens and whole-word tokens for `_WORDS`."""
    words = _pre_tokenize(CLIPTokenizer().backend_tokenizer, [" ".join(_WORDS)])
    # CLIP marks the end of a word on its last symbol.
    merges = _learn_bpe_merges([list(word[:-1]) + [word[-1] + "</w>"] for word in words])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # CLIP's vocabulary layout: byte symbols, the same with the end-of-word suffix, merge results, special tokens.
    tokens = alphabet + [symbol + "</w>" for symbol in alphabet] + [a + b for a, b in merges]
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


def _mistral_processor() -> PixtralProcessor:
    """FLUX.2's "tokenizer": a PixtralProcessor around a byte-level BPE tokenizer and a Mistral-style chat template.

    The tokenizer has whole-word tokens for Flux2Pipeline's system message, so a short `max_sequence_length` still
    leaves room for the prompt.
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    texts = [SYSTEM_MESSAGE, " ".join(_WORDS), " " + " ".join(_WORDS)]
    merges = _learn_bpe_merges([list(word) for word in _pre_tokenize(backend, texts)])
    tokens = list(_MISTRAL_SPECIAL_TOKENS) + sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in merges]
    backend.model = models.BPE(vocab={token: index for index, token in enumerate(dict.fromkeys(tokens))}, merges=merges)
    backend.add_special_tokens(list(_MISTRAL_SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    return PixtralProcessor(
        image_processor=PixtralImageProcessor(patch_size=16),
        tokenizer=tokenizer,
        patch_size=16,
        spatial_merge_size=2,
        chat_template=_MISTRAL_CHAT_TEMPLATE,
    )


def make_tiny_flux2(out_dir: str, seed: int = 0) -> str:
    """Build a tiny FLUX.2 pipeline (Mistral3 + Flux2 transformer + 32-channel VAE with batch-norm) in `out_dir`."""
    processor = _mistral_processor()
    tokenizer = processor.tokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Mistral3ForConditionalGeneration(
            Mistral3Config(
                text_config={
                    "model_type": "mistral",
                    "vocab_size": len(tokenizer),
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    # Flux2Pipeline stacks hidden states 10, 20 and 30 (`text_encoder_out_layers`): 30 layers at least.
                    "num_hidden_layers": 30,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "head_dim": 8,
                    "max_position_embeddings": 2048,
                    "bos_token_id": tokenizer.bos_token_id,
                    "eos_token_id": tokenizer.eos_token_id,
                    "pad_token_id": tokenizer.pad_token_id,
                },
                vision_config={
                    "model_type": "pixtral",
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "image_size": 64,
                    "patch_size": 16,
                },
                image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
                spatial_merge_size=2,
            )
        )
        transformer = Flux2Transformer2DModel(
            patch_size=1,
            in_channels=128,  # 32 latent channels x 2x2 patchification
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=48,  # 3 stacked Mistral hidden states x 16
            timestep_guidance_channels=32,
            mlp_ratio=3.0,
            axes_dims_rope=(4, 4, 4, 4),  # must sum to attention_head_dim
            guidance_embeds=True,
        )
        vae = AutoencoderKLFlux2(
            block_out_channels=(8, 8, 16, 16),
            layers_per_block=1,
            latent_channels=32,
            norm_num_groups=4,
            sample_size=64,
        )
        # FLUX.2 normalises latents with the VAE's batch-norm statistics (`vae.bn.running_mean / running_var`); a
        # fresh BatchNorm has mean 0 / var 1, which would hide a forgotten normalisation.
        vae.bn.running_mean.copy_(0.5 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(0.5 + torch.rand_like(vae.bn.running_var))

    pipe = Flux2Pipeline(
        # Flux2Pipeline computes the shift `mu` itself (`compute_empirical_mu`); the scheduler only needs dynamic
        # shifting enabled to accept it.
        scheduler=FlowMatchEulerDiscreteScheduler(**_FLUX_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=processor,
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return os.fspath(out_dir)


def _qwen2_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE Qwen2 tokenizer whose whole-word tokens cover QwenImagePipeline's prompt template.

    QwenImagePipeline drops the first `prompt_template_encode_start_idx` (34) hidden states, the template's prefix
    as the real tokenizer cuts it; one token per template word reproduces exactly that count.
    """
    # The template is set in the pipeline's __init__; an empty pipeline is the cheapest way to read it.
    empty = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    template = empty.prompt_template_encode.format("")
    texts = re.split("|".join(re.escape(token) for token in _QWEN_SPECIAL_TOKENS), template)
    # Each word both at the start of the prompt and after a space ("Ġword"): byte-level BPE tells them apart.
    texts += [" ".join(_WORDS), " " + " ".join(_WORDS)]
    merges = _learn_bpe_merges([list(word) for word in _pre_tokenize(Qwen2Tokenizer().backend_tokenizer, texts)])
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in merges] + list(_QWEN_SPECIAL_TOKENS)
    vocab = {token: index for index, token in enumerate(dict.fromkeys(tokens))}
    return Qwen2Tokenizer(vocab=vocab, merges=merges, extra_special_tokens=list(_QWEN_SPECIAL_TOKENS[1:]))


def make_tiny_qwenimage(out_dir: str, seed: int = 0) -> str:
    """Build a tiny Qwen-Image pipeline (Qwen2.5-VL + QwenImage transformer + Qwen-Image VAE) in `out_dir`."""
    tokenizer = _qwen2_tokenizer()
    special_id = tokenizer.convert_tokens_to_ids

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config={
                    "vocab_size": len(tokenizer),
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "max_position_embeddings": 1024,
                    # Multimodal RoPE: the (temporal, height, width) sections sum to head_dim / 2 = 4.
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
                    "bos_token_id": special_id("<|endoftext|>"),
                    "eos_token_id": special_id("<|im_end|>"),
                    "pad_token_id": special_id("<|endoftext|>"),
                },
                vision_config={
                    "depth": 1,
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_heads": 2,
                    "out_hidden_size": 32,  # the text hidden size
                    "fullatt_block_indexes": [0],
                },
                image_token_id=special_id("<|image_pad|>"),
                video_token_id=special_id("<|video_pad|>"),
                vision_start_token_id=special_id("<|vision_start|>"),
                vision_end_token_id=special_id("<|vision_end|>"),
            )
        )
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,  # 16 latent channels x 2x2 packing
            out_channels=16,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,  # the text hidden size
            axes_dims_rope=(4, 6, 6),  # must sum to attention_head_dim
        )
        # The real per-channel latents_mean / latents_std (the defaults): a normalisation as non-trivial as FLUX's.
        vae = AutoencoderKLQwenImage(
            base_dim=4,
            z_dim=16,
            dim_mult=[1, 2, 4, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],  # 3 downsamplings: vae_scale_factor 8
        )

    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**_QWENIMAGE_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return os.fspath(out_dir)
