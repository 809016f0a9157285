"""Wan's tiny builders: a random-weight ``WanPipeline`` folder (``make_tiny_model``) of Wan 2.1 (one transformer) or,
with ``two_experts``, of Wan 2.2 A14B (a second expert ``transformer_2`` and the pipeline's ``boundary_ratio``); with
``image_to_video``, their ``WanImageToVideoPipeline`` (``wan_i2v/tiny.py``): transformers of 36 input channels, and
Wan 2.1 I2V's CLIP vision encoder (17 image tokens of a 32-pixel image, read by the transformer's image embedding);
with ``ti2v``, Wan 2.2 TI2V-5B's (``wan_ti2v/tiny.py``): a transformer of 48 input and output channels,
``expand_timesteps``, and Wan 2.2's 48-channel VAE (``comfy_tiny.wan22_vae``).

The tiny pipeline: a UMT5 encoder with the shared tiny T5 tokenizer (UMT5 reads T5's vocabulary format), transformers
with 4 heads of 8 (so context parallelism splits heads and tokens over 2 or 4 ranks), Wan 2.1's video VAE with its real
per-channel latents mean / std and 4x temporal, 8x spatial compression, and the scheduler of Wan's diffusers folders
(UniPC with flow sigmas).
"""

from __future__ import annotations

import os

import torch
from diffusers import (
    AutoencoderKLWan,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from safetensors.torch import save_file
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    CLIPVisionModel,
    UMT5Config,
    UMT5EncoderModel,
)

from ..tiny import TinyLora, t5_tokenizer
from .comfy_tiny import comfy_transformer, wan22_vae

# Wan 2.1's diffusers folders' scheduler (Wan-AI/Wan2.1-T2V-*-Diffusers), flow_shift 3 as their 480p default.
SCHEDULER = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 3.0,
    "solver_order": 2,
    "solver_type": "bh2",
    "predict_x0": True,
    "lower_order_final": True,
    "final_sigmas_type": "zero",
}
BOUNDARY_RATIO = 0.875  # Wan 2.2 A14B T2V's: the high-noise expert runs while t >= 875
I2V_BOUNDARY_RATIO = 0.9  # Wan 2.2 A14B I2V's
TEXT_WIDTH = 32
IMAGE_WIDTH = 32  # the tiny CLIP vision encoder's hidden width: the transformer's image_dim
IMAGE_SIZE = 32  # its input's side, in 8-pixel patches: 16 patches and the class token
INNER_WIDTH = 4 * 8  # heads × head size


def _transformer(
    image_to_video: bool = False, image_dim: int | None = None, latent_channels: int = 16
) -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=8,  # rope: 4 temporal, 2 height, 2 width
        # I2V: the noise, then the start frame's 4-channel mask and 16 latent channels
        in_channels=36 if image_to_video else latent_channels,
        out_channels=latent_channels,
        text_dim=TEXT_WIDTH,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        image_dim=image_dim,
        added_kv_proj_dim=32 if image_dim is not None else None,  # the inner width: 4 heads of 8
        rope_max_seq_len=64,
    )


def _image_encoder() -> tuple[CLIPVisionModel, CLIPImageProcessor]:
    """A tiny CLIP vision encoder (Wan 2.1 I2V's is CLIP ViT-H/14's: 257 tokens of a 224-pixel image) and the image
    processor that resizes and crops an image to its input, as Wan-AI's ``image_processor``."""
    config = CLIPVisionConfig(
        hidden_size=IMAGE_WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,  # the pipeline reads the second-to-last hidden states
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=8,
    )
    processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size=IMAGE_SIZE)
    return CLIPVisionModel(config), processor


def make_tiny_model(
    out_dir: str, seed: int = 0, *, two_experts: bool = False, image_to_video: bool = False, ti2v: bool = False
) -> str:
    """Build a tiny Wan 2.1 ``WanPipeline`` in ``out_dir``; with ``two_experts``, Wan 2.2 A14B's layout (a second,
    differently initialised expert in ``transformer_2`` and ``boundary_ratio`` in model_index.json); with
    ``image_to_video`` their ``WanImageToVideoPipeline`` (Wan 2.1 I2V with a CLIP image encoder, Wan 2.2 A14B I2V
    without one); with ``ti2v``, Wan 2.2 TI2V-5B's ``WanPipeline`` (``expand_timesteps``, 48 latent channels, Wan
    2.2's VAE), which also makes clips from a start image."""
    if ti2v and (two_experts or image_to_video):
        raise ValueError("Wan 2.2 TI2V-5B has one transformer and is a WanPipeline folder")
    tokenizer = t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tokenizer),
                d_model=TEXT_WIDTH,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=16,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                decoder_start_token_id=tokenizer.pad_token_id,
            )
        )
        # Wan 2.2 A14B I2V reads the start image through its latents only.
        image_parts = _image_encoder() if image_to_video and not two_experts else None
        image_dim = IMAGE_WIDTH if image_parts is not None else None
        transformer = _transformer(image_to_video, image_dim, 48 if ti2v else 16)
        transformer_2 = _transformer(image_to_video, image_dim) if two_experts else None
        # The real per-channel latents_mean / latents_std (the defaults): a normalisation a wrong LATENT shows.
        vae = (
            wan22_vae()
            if ti2v
            else AutoencoderKLWan(
                base_dim=4,
                z_dim=16,
                dim_mult=[1, 2, 4, 4],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],  # 4x in time, 8x in space
            )
        )
    parts = {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": vae,
        "scheduler": UniPCMultistepScheduler(**SCHEDULER),
        "transformer": transformer,
        "transformer_2": transformer_2,
        "boundary_ratio": (I2V_BOUNDARY_RATIO if image_to_video else BOUNDARY_RATIO) if two_experts else None,
    }
    if image_to_video:
        image_encoder, image_processor = image_parts if image_parts is not None else (None, None)
        pipe = WanImageToVideoPipeline(**parts, image_encoder=image_encoder, image_processor=image_processor)
    else:
        pipe = WanPipeline(**parts, expand_timesteps=ti2v)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return os.fspath(out_dir)


# -- LoRAs -------------------------------------------------------------------------------------------------------------
# Layers the tiny LoRA changes by default: column- and row-sharded ones of both attentions and the feed-forward, ones
# every rank holds whole (the condition embedders) and the context-parallel gather layer (proj_out).
LORA_LAYERS = (
    "blocks.0.attn1.to_q",
    "blocks.0.attn1.to_out.0",
    "blocks.1.attn2.to_k",
    "blocks.0.ffn.net.0.proj",
    "blocks.1.ffn.net.2",
    "condition_embedder.time_proj",
    "condition_embedder.text_embedder.linear_1",
    "proj_out",
)
# Every block layer musubi-tuner's (kohya's) Wan LoRAs change, and diffusers' converter of them requires in every block.
BLOCK_LORA_LAYERS = tuple(
    f"blocks.{i}.{layer}"
    for i in range(2)
    for layer in (
        *(f"{attn}.{p}" for attn in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")),
        "ffn.net.0.proj",
        "ffn.net.2",
    )
)


def save_wan_lora(lora: TinyLora, path: str | os.PathLike, *, layout: str, zero_diffs: bool = False) -> str:
    """Wan in the original model's layer names (``comfy_tiny.comfy_transformer``: ``blocks.0.self_attn.q``,
    ``head.head``), written without diffusers' converters: "comfyui" (``diffusion_model.….lora_down.weight`` /
    ``lora_up.weight``, ``.alpha`` in the blocks, the alpha folded into ``lora_up`` elsewhere, where diffusers'
    converter reads no alpha) or "kohya" (musubi-tuner's ``lora_unet_blocks_0_self_attn_q.lora_down.weight`` and
    ``.alpha``; every block layer of ``BLOCK_LORA_LAYERS``, nothing else). The LoRA's ``biases`` become ``.diff_b``
    keys, as step-distillation LoRAs (lightx2v's) carry them; ``zero_diffs`` adds what else such LoRAs carry, at
    zero: ``.diff_b`` of the pairs' other layers and ``.diff`` weights of the blocks' norms (ComfyUI adds them to the
    layers' own; diffusers drops the norms' and reads a bias as PEFT's ``lora_B.bias``)."""
    tensors = {}
    for module, (a, b, alpha) in lora.layers.items():
        (original,) = comfy_transformer({module: a})
        if layout == "kohya":
            if not module.startswith("blocks.") or lora.biases:
                raise ValueError(f"{module}: musubi-tuner's layout holds the blocks' layers only, and no biases")
            name = "lora_unet_" + original.replace(".", "_")
        elif layout == "comfyui":
            name = f"diffusion_model.{original}"
        else:
            raise ValueError(f"unknown Wan LoRA layout {layout!r}")
        tensors[f"{name}.lora_down.weight"] = a.contiguous()
        if layout == "kohya" or module.startswith("blocks."):
            tensors[f"{name}.lora_up.weight"] = b.contiguous()
            tensors[f"{name}.alpha"] = torch.tensor(alpha)
        else:
            tensors[f"{name}.lora_up.weight"] = (alpha / a.shape[0] * b).contiguous()
    for module, bias in lora.biases.items():
        (original,) = comfy_transformer({module: bias})
        tensors[f"diffusion_model.{original}.diff_b"] = bias.contiguous()
    if zero_diffs:
        for module, (_, b, _) in lora.layers.items():
            (original,) = comfy_transformer({module: b})
            tensors.setdefault(f"diffusion_model.{original}.diff_b", torch.zeros(b.shape[0]))
        for block in sorted({module.split(".")[1] for module in lora.layers if module.startswith("blocks.")}):
            for norm in ("norm3", "self_attn.norm_q", "self_attn.norm_k"):
                tensors[f"diffusion_model.blocks.{block}.{norm}.diff"] = torch.zeros(INNER_WIDTH)
    save_file(tensors, str(path))
    return str(path)
