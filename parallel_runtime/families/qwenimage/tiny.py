"""Qwen-Image's tiny builders: a random-weight QwenImagePipeline folder (``make_tiny_model``), the same kind of
model written as ComfyUI distributes Qwen-Image (``make_tiny_qwenimage_files``), and what its tiny LoRAs change and
the layouts they are published in.

The tiny pipeline: a Qwen2.5-VL text encoder whose tokenizer cuts QwenImagePipeline's prompt template as the real one
does, a transformer with 4 heads, the Qwen-Image VAE with its real per-channel latents mean / std. ComfyUI's files: the
transformer in diffusers' keys (fp8 ones behind ComfyUI's prefix), Qwen2.5-VL in its published layout without lm_head,
the VAE in Wan 2.1's original layout (``wan_vae``).
"""

from __future__ import annotations

import os
import re

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from safetensors.torch import save_file
from tokenizers import pre_tokenizers
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from ..tiny import FORMATS, WORDS, TinyLora, learn_bpe_merges, pre_tokenize, quantized, write_formats
from . import files as qwenimage_files

# Qwen-Image's scheduler config (one home: files.py, which ComfyUI's files are converted with).
_QWENIMAGE_SCHEDULER_CONFIG = {k: v for k, v in qwenimage_files.SCHEDULER.items() if not k.startswith("_")}


# Qwen2.5-VL's special tokens; the chat template uses the first three, the vision ones only matter with images.
_QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
)  # fmt: skip


def qwen2_tokenizer(template: str | None = None) -> Qwen2Tokenizer:
    """A byte-level BPE Qwen2 tokenizer whose whole-word tokens cover a pipeline's prompt ``template`` (by default
    QwenImagePipeline's).

    QwenImagePipeline drops the first `prompt_template_encode_start_idx` (34) hidden states, the template's prefix
    as the real tokenizer cuts it; one token per template word reproduces exactly that count (and the 64 of
    QwenImageEditPlusPipeline's template).
    """
    if template is None:
        # The template is set in the pipeline's __init__; an empty pipeline is the cheapest way to read it.
        empty = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
        template = empty.prompt_template_encode.format("")
    texts = re.split("|".join(re.escape(token) for token in _QWEN_SPECIAL_TOKENS), template)
    # Each word both at the start of the prompt and after a space ("Ġword"): byte-level BPE tells them apart.
    texts += [" ".join(WORDS), " " + " ".join(WORDS)]
    merges = learn_bpe_merges([list(word) for word in pre_tokenize(Qwen2Tokenizer().backend_tokenizer, texts)])
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in merges] + list(_QWEN_SPECIAL_TOKENS)
    vocab = {token: index for index, token in enumerate(dict.fromkeys(tokens))}
    return Qwen2Tokenizer(vocab=vocab, merges=merges, extra_special_tokens=list(_QWEN_SPECIAL_TOKENS[1:]))


def make_tiny_model(out_dir: str, seed: int = 0, tokenizer: Qwen2Tokenizer | None = None) -> str:
    """Build a tiny Qwen-Image pipeline (Qwen2.5-VL + QwenImage transformer + Qwen-Image VAE) in `out_dir`, with
    ``tokenizer`` (by default ``qwen2_tokenizer()``)."""
    tokenizer = tokenizer or qwen2_tokenizer()
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


# -- ComfyUI's files ---------------------------------------------------------------------------------------------------
def wan_vae(sd: dict[str, torch.Tensor], res_blocks: int = 2) -> dict[str, torch.Tensor]:
    """diffusers' AutoencoderKLQwenImage state dict in Wan 2.1's original layout (ComfyUI's ``comfy/ldm/wan/vae.py``):
    each residual block a Sequential (norm 0, conv 2, norm 3, conv 6) with a ``shortcut``, the encoder's and decoder's
    blocks one flat Sequential each (a decoder level: its ``res_blocks + 1`` residual blocks, then its upsampling),
    the middle a (residual, attention, residual) Sequential, the output norm and conv a ``head``."""
    residual = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma": "residual.3.gamma"}
    residual |= {"conv2": "residual.6", "conv_shortcut": "shortcut"}

    def inner(rest: str) -> str:
        for name, original in residual.items():
            if rest == name or rest.startswith(name + "."):
                return original + rest[len(name) :]
        return rest  # resample.1.*, time_conv.*, an attention's norm / to_qkv / proj

    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        side, _, rest = key.partition(".")
        if side in ("quant_conv", "post_quant_conv"):
            out[("conv1." if side == "quant_conv" else "conv2.") + rest] = value
            continue
        block, _, rest = rest.partition(".")
        if block == "conv_in":
            new = f"conv1.{rest}"
        elif block == "norm_out":
            new = f"head.0.{rest}"
        elif block == "conv_out":
            new = f"head.2.{rest}"
        elif block == "mid_block":
            kind, index, rest = rest.split(".", 2)
            new = f"middle.{1 if kind == 'attentions' else 2 * int(index)}.{inner(rest)}"
        elif block == "down_blocks":
            index, rest = rest.split(".", 1)
            new = f"downsamples.{index}.{inner(rest)}"
        else:  # up_blocks.{level}.resnets.{j} / .upsamplers.0
            level, kind, index, rest = rest.split(".", 3)
            position = int(level) * (res_blocks + 2) + (int(index) if kind == "resnets" else res_blocks + 1)
            new = f"upsamples.{position}.{inner(rest)}"
        out[f"{side}.{new}"] = value
    return out


def published_qwen_layout(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's Qwen2_5_VLForConditionalGeneration state dict in the layout Qwen2.5-VL was published in (and
    ComfyUI's qwen_2.5_vl_7b files keep): ``model.language_model.X`` is ``model.X``, ``model.visual`` is ``visual``;
    without ``lm_head``, which ComfyUI does not use."""
    out = {}
    for key, value in sd.items():
        if key == "lm_head.weight":
            continue
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        elif key.startswith("model.visual."):
            key = key.removeprefix("model.")
        out[key] = value
    return out


def make_tiny_qwenimage_files(
    models_dir: str, reference_root: str, comfy_dir: str, *, seed: int = 0, formats: tuple[str, ...] = FORMATS
) -> dict[str, tuple[dict[str, str], str]]:
    """Write a tiny Qwen-Image as ComfyUI's files under ``models_dir`` (one transformer file per format in ``formats``),
    and for each a diffusers folder below ``reference_root`` with the same weights (as make_tiny_flux_files does).

    What ComfyUI's files do not carry is Qwen-Image's own: transformer heads 128 wide with the rotary axes (16, 56,
    56), Qwen2.5-VL's 128-wide heads, multimodal RoPE sections (16, 24, 24) and special tokens, an 80-wide vision
    head, Wan 2.1's VAE shape (two residual blocks a level) and ComfyUI's real tokenizer (hence the real vocabulary):
    still small, two layers of each. Returns, per format, the widgets' values and the reference folder."""
    if not formats or set(formats) - set(FORMATS):
        raise ValueError(f"formats must be some of {FORMATS}")
    tokenizer = Qwen2Tokenizer.from_pretrained(os.path.join(comfy_dir, "text_encoders", "qwen25_tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config={
                    "vocab_size": 152064,
                    "hidden_size": 128,  # one head 128 wide, as Qwen2.5-VL's
                    "intermediate_size": 128,
                    "num_hidden_layers": 2,
                    "max_window_layers": 2,
                    "num_attention_heads": 1,
                    "num_key_value_heads": 1,
                    "max_position_embeddings": 128000,
                    "rms_norm_eps": 1e-06,
                    "sliding_window": 32768,
                    "use_sliding_window": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                    "bos_token_id": 151643,
                    "eos_token_id": 151645,
                },
                vision_config={
                    "depth": 1,
                    "hidden_size": 160,  # two heads 80 wide
                    "intermediate_size": 64,
                    "num_heads": 2,
                    "out_hidden_size": 128,
                    "patch_size": 14,
                    "spatial_merge_size": 2,
                    "temporal_patch_size": 2,
                    "window_size": 112,
                    "fullatt_block_indexes": [7, 15, 23, 31],
                    "tokens_per_second": 2,
                },
                image_token_id=151655,
                video_token_id=151656,
                vision_start_token_id=151652,
                vision_end_token_id=151653,
                tie_word_embeddings=True,  # the file carries no lm_head (as ComfyUI's), so both tie theirs
            )
        )
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=2,
            attention_head_dim=128,
            num_attention_heads=2,
            joint_attention_dim=128,
            axes_dims_rope=(16, 56, 56),
        )
        vae = AutoencoderKLQwenImage(
            base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]
        )
    text_encoder.to(torch.bfloat16)  # as ComfyUI's qwen_2.5_vl_7b.safetensors
    weights = transformer.state_dict()
    transformer.to(torch.bfloat16)
    scheduler_config = {k: v for k, v in qwenimage_files.SCHEDULER.items() if not k.startswith("_")}
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_config),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    names = {
        "text_encoder": "tiny_qwen_2.5_vl_7b.safetensors",
        "text_encoder_2": "none",
        "vae": "tiny_qwen_image_vae.safetensors",
    }
    for folder, name, tensors in (
        ("text_encoders", names["text_encoder"], published_qwen_layout(text_encoder.state_dict())),
        ("vae", names["vae"], wan_vae(vae.state_dict())),
    ):
        os.makedirs(os.path.join(models_dir, folder), exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(models_dir, folder, name))
    # The file keeps diffusers' keys: each of its tensors is one of the model's.
    return write_formats(
        models_dir,
        reference_root,
        "tiny-qwen-image",
        pipe,
        names,
        formats,
        lambda fmt: quantized(weights, fmt, {k: [k] for k in weights}, dict),
    )


# -- LoRAs -------------------------------------------------------------------------------------------------------------
# Layers the tiny LoRA changes by default: column- and row-sharded ones, packed ones, replicated ones (AdaLN,
# embedders) and the context-parallel gather layer (proj_out), so every way a strategy holds a weight is covered.
LORA_LAYERS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_out.0",
    "transformer_blocks.0.attn.add_v_proj",
    "transformer_blocks.0.img_mod.1",
    "transformer_blocks.1.img_mlp.net.0.proj",
    "transformer_blocks.1.txt_mlp.net.2",
    "img_in",
    "proj_out",
)


def save_qwenimage_lora(lora: TinyLora, path: str | os.PathLike, *, layout: str) -> str:
    """Qwen-Image's own layer names (diffusers kept them): "kohya" (``lora_unet_transformer_blocks_0_attn_to_q
    .lora_down.weight``, ``.alpha``) or "comfyui" (``diffusion_model.transformer_blocks.0.attn.to_q.lora_A.weight``)."""
    tensors = {}
    for module, (a, b, alpha) in lora.layers.items():
        if layout == "kohya":
            name = f"lora_unet_{module.replace('.', '_')}"
            tensors[f"{name}.lora_down.weight"] = a.contiguous()
            tensors[f"{name}.lora_up.weight"] = b.contiguous()
            tensors[f"{name}.alpha"] = torch.tensor(alpha)
        else:
            tensors[f"diffusion_model.{module}.lora_A.weight"] = a.contiguous()
            tensors[f"diffusion_model.{module}.lora_B.weight"] = (alpha / a.shape[0] * b).contiguous()
    save_file(tensors, str(path))
    return str(path)
