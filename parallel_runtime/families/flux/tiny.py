"""FLUX.1's tiny builders: a random-weight FluxPipeline folder (``make_tiny_model``), the same kind of model written as
ComfyUI distributes FLUX.1 (``make_tiny_flux_files``), and what its tiny LoRAs change and how BFL names those layers.

The tiny pipeline keeps what the pipelines and the parallel strategies depend on and shrinks everything else: 16
latent channels with 2x2 packing (ComfyUI's LATENT shapes), a VAE that downsamples 8x (4 levels) with FLUX.1's
non-trivial scale and shift, 4 attention heads (so 2- and 4-way Ulysses and tensor parallelism divide them). A builder
is deterministic for a given seed (weights are drawn from a forked RNG, the caller's global RNG is left untouched).

ComfyUI's files: a transformer in Black Forest Labs' layout, CLIP-L and T5 in transformers' layouts, the VAE in the
original (LDM) layout, written from the diffusers model by the inverse of the documented key mapping (BFL's ``qkv``
and ``linear1`` are the concatenations of diffusers' ``to_q / to_k / to_v (/ proj_mlp)``, the final AdaLN's halves
are swapped), so a test of the conversion compares two independent descriptions of one layout. What ComfyUI's files do
not carry, the conversion takes from FLUX.1 itself, so the tiny model keeps those values: heads 128 wide with the
rotary axes (16, 56, 56), CLIP heads 64 wide, 32 VAE norm groups, and the real tokenizers (from ComfyUI's
installation, hence CLIP's and T5's real vocabulary sizes). It is still small: 2 heads, one block of each kind, about
30 MB of files.
"""

from __future__ import annotations

import os

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from safetensors.torch import save_file
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from ..tiny import (
    FORMATS,
    TinyLora,
    clip_tokenizer,
    count_blocks,
    fused,
    ldm_vae,
    quantized,
    t5_tokenizer,
    tagged_groups,
    write_formats,
)
from . import files as flux_files

# FLUX.1-dev's scheduler config (files.py holds it, for pipelines built from ComfyUI's files):
# resolution-dependent ("dynamic") shifting of the sigmas, so the tiny pipeline exercises the same `mu` computation as
# the real one.
SCHEDULER_CONFIG = {k: v for k, v in flux_files.SCHEDULER_DEV.items() if not k.startswith("_")}


# FLUX.1's VAE normalisation constants (diffusers: `latents / scaling_factor + shift_factor` before decoding).
# Non-trivial values make a forgotten or doubled scale/shift visible in the tests.
_FLUX_VAE_SCALING_FACTOR = flux_files.VAE_SCALING_FACTOR
_FLUX_VAE_SHIFT_FACTOR = flux_files.VAE_SHIFT_FACTOR


def make_tiny_model(out_dir: str, seed: int = 0, latent_channels: int = 16) -> str:
    """Build a tiny FLUX.1 pipeline (CLIP + T5 + Flux transformer + VAE of ``latent_channels``, FLUX.1's 16 unless
    a test needs another) and save it to `out_dir`."""
    tokenizer = clip_tokenizer()
    tokenizer_2 = t5_tokenizer()

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
            in_channels=latent_channels * 4,  # 2x2 packing
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
            latent_channels=latent_channels,
            norm_num_groups=4,
            sample_size=64,
            scaling_factor=_FLUX_VAE_SCALING_FACTOR,
            shift_factor=_FLUX_VAE_SHIFT_FACTOR,
            use_quant_conv=False,  # as FLUX's VAE
            use_post_quant_conv=False,
        )

    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return os.fspath(out_dir)


# -- ComfyUI's files ---------------------------------------------------------------------------------------------------
def bfl_transformer(sd: dict[str, torch.Tensor], num_layers: int, num_single_layers: int) -> dict[str, torch.Tensor]:
    """diffusers' FluxTransformer2DModel state dict in BFL's layout."""
    out: dict[str, torch.Tensor] = {}

    def linear(bfl: str, diffusers: str) -> None:
        for part in ("weight", "bias"):
            out[f"{bfl}.{part}"] = sd[f"{diffusers}.{part}"]

    def cat(bfl: str, *diffusers: str) -> None:
        for part in ("weight", "bias"):
            out[f"{bfl}.{part}"] = torch.cat([sd[f"{d}.{part}"] for d in diffusers])

    for bfl, name in (
        ("time_in", "timestep_embedder"),
        ("vector_in", "text_embedder"),
        ("guidance_in", "guidance_embedder"),
    ):
        if f"time_text_embed.{name}.linear_1.weight" in sd:
            linear(f"{bfl}.in_layer", f"time_text_embed.{name}.linear_1")
            linear(f"{bfl}.out_layer", f"time_text_embed.{name}.linear_2")
    linear("txt_in", "context_embedder")
    linear("img_in", "x_embedder")
    for i in range(num_layers):
        b, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        linear(f"{b}.img_mod.lin", f"{d}.norm1.linear")
        linear(f"{b}.txt_mod.lin", f"{d}.norm1_context.linear")
        cat(f"{b}.img_attn.qkv", f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v")
        cat(f"{b}.txt_attn.qkv", f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj")
        out[f"{b}.img_attn.norm.query_norm.scale"] = sd[f"{d}.attn.norm_q.weight"]
        out[f"{b}.img_attn.norm.key_norm.scale"] = sd[f"{d}.attn.norm_k.weight"]
        out[f"{b}.txt_attn.norm.query_norm.scale"] = sd[f"{d}.attn.norm_added_q.weight"]
        out[f"{b}.txt_attn.norm.key_norm.scale"] = sd[f"{d}.attn.norm_added_k.weight"]
        linear(f"{b}.img_attn.proj", f"{d}.attn.to_out.0")
        linear(f"{b}.txt_attn.proj", f"{d}.attn.to_add_out")
        linear(f"{b}.img_mlp.0", f"{d}.ff.net.0.proj")
        linear(f"{b}.img_mlp.2", f"{d}.ff.net.2")
        linear(f"{b}.txt_mlp.0", f"{d}.ff_context.net.0.proj")
        linear(f"{b}.txt_mlp.2", f"{d}.ff_context.net.2")
    for i in range(num_single_layers):
        b, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        linear(f"{b}.modulation.lin", f"{d}.norm.linear")
        cat(f"{b}.linear1", f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp")
        linear(f"{b}.linear2", f"{d}.proj_out")
        out[f"{b}.norm.query_norm.scale"] = sd[f"{d}.attn.norm_q.weight"]
        out[f"{b}.norm.key_norm.scale"] = sd[f"{d}.attn.norm_k.weight"]
    linear("final_layer.linear", "proj_out")
    for part in ("weight", "bias"):
        scale, shift = sd[f"norm_out.linear.{part}"].chunk(2)
        out[f"final_layer.adaLN_modulation.1.{part}"] = torch.cat([shift, scale])
    return out


def _groups(sd: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Which diffusers tensors each FLUX.1 BFL tensor is made of (``tagged_groups``)."""
    layers, single = count_blocks(sd, "transformer_blocks."), count_blocks(sd, "single_transformer_blocks.")
    return tagged_groups(sd, lambda tensors: bfl_transformer(tensors, layers, single))


def _quantized_transformer(
    sd: dict[str, torch.Tensor], fmt: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The BFL file's tensors in ``fmt`` and what they mean in diffusers' layout (``quantized``)."""
    layers, single = count_blocks(sd, "transformer_blocks."), count_blocks(sd, "single_transformer_blocks.")
    return quantized(sd, fmt, _groups(sd), lambda tensors: bfl_transformer(tensors, layers, single))


def _clip_key(key: str) -> str:
    return key if key.startswith("text_model.") else "text_model." + key


def make_tiny_flux_files(
    models_dir: str,
    reference_root: str,
    comfy_dir: str,
    *,
    seed: int = 0,
    formats: tuple[str, ...] = FORMATS,
    schnell: bool = False,
) -> dict[str, tuple[dict[str, str], str]]:
    """Write a tiny FLUX.1 as ComfyUI's files under ``models_dir`` (``diffusion_models/``, ``text_encoders/``,
    ``vae/``), one transformer file per format in ``formats``, and for each a diffusers folder below
    ``reference_root`` holding the same weights (the transformer's as its file means them: fp8 cast back, scaled fp8
    dequantized). ``comfy_dir`` is ComfyUI's ``comfy`` package (its tokenizers). Returns, per format, the widgets'
    values (diffusion_model, text_encoder: CLIP, text_encoder_2: T5, vae) and the reference folder."""
    if not formats or set(formats) - set(FORMATS):
        raise ValueError(f"formats must be some of {FORMATS}")
    tokenizer = CLIPTokenizer.from_pretrained(os.path.join(comfy_dir, "sd1_tokenizer"), model_max_length=77)
    tokenizer_2 = T5TokenizerFast.from_pretrained(
        os.path.join(comfy_dir, "text_encoders", "t5_tokenizer"), model_max_length=512
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=49408,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=1,  # 64 wide, as CLIP's
                max_position_embeddings=77,
                projection_dim=64,
                hidden_act="quick_gelu",
                bos_token_id=49406,
                eos_token_id=49407,
                pad_token_id=1,
            )
        )
        t5 = T5EncoderModel(
            T5Config(
                vocab_size=32128,
                d_model=64,
                d_kv=32,
                d_ff=128,
                num_layers=2,
                num_heads=2,
                relative_attention_num_buckets=32,
                feed_forward_proj="gated-gelu",
                pad_token_id=0,
                eos_token_id=1,
            )
        )
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=128,
            num_attention_heads=2,
            joint_attention_dim=64,
            pooled_projection_dim=64,
            guidance_embeds=not schnell,
            axes_dims_rope=flux_files.AXES_DIMS_ROPE,
        )
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(32, 32, 32, 32),
            layers_per_block=1,
            latent_channels=16,
            norm_num_groups=32,
            scaling_factor=flux_files.VAE_SCALING_FACTOR,
            shift_factor=flux_files.VAE_SHIFT_FACTOR,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
    # The dtypes ComfyUI distributes them in: CLIP-L and T5 in fp16, the transformer in bf16 (or fp8), the VAE fp32.
    clip.to(torch.float16)
    t5.to(torch.float16)
    weights = transformer.state_dict()
    transformer.to(torch.bfloat16)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            **{
                k: v
                for k, v in (flux_files.SCHEDULER_SCHNELL if schnell else flux_files.SCHEDULER_DEV).items()
                if k[0] != "_"
            }
        ),
        vae=vae,
        text_encoder=clip,
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    variant = "schnell" if schnell else "dev"
    names = {
        "text_encoder": "tiny_clip_l.safetensors",
        "text_encoder_2": "tiny_t5xxl_fp16.safetensors",
        "vae": "tiny_ae.safetensors",
    }
    for folder, key, tensors in (
        # ComfyUI's clip_l.safetensors keeps transformers' older key names (text_model.…), which it still reads.
        ("text_encoders", "text_encoder", {_clip_key(k): v for k, v in clip.state_dict().items()}),
        # T5's encoder.embed_tokens is shared.weight again (tied): the file holds it once.
        (
            "text_encoders",
            "text_encoder_2",
            {k: v for k, v in t5.state_dict().items() if k != "encoder.embed_tokens.weight"},
        ),
        ("vae", "vae", ldm_vae(vae.state_dict(), 4)),
    ):
        os.makedirs(os.path.join(models_dir, folder), exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(models_dir, folder, names[key]))
    return write_formats(
        models_dir,
        reference_root,
        f"tiny-flux1-{variant}",
        pipe,
        names,
        formats,
        lambda fmt: _quantized_transformer(weights, fmt),
    )


# -- LoRAs -------------------------------------------------------------------------------------------------------------
# Layers the tiny LoRA changes by default: column- and row-sharded ones, packed ones, replicated ones (AdaLN,
# embedders) and the context-parallel gather layer (proj_out), so every way a strategy holds a weight is covered.
LORA_LAYERS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_k",
    "transformer_blocks.0.attn.to_v",
    "transformer_blocks.0.attn.to_out.0",
    "transformer_blocks.0.attn.add_k_proj",
    "transformer_blocks.0.norm1.linear",
    "transformer_blocks.1.ff.net.0.proj",
    "transformer_blocks.1.ff.net.2",
    "single_transformer_blocks.0.proj_mlp",
    "single_transformer_blocks.0.proj_out",
    "single_transformer_blocks.1.attn.to_v",
    "x_embedder",
    "proj_out",
)

# BFL's FLUX.1 layer names -> diffusers' layers (several: a fused BFL layer), for block 0..n of each kind.
# diffusers' AdaLN modulations put scale before shift where BFL's final layer puts shift first.
_FLUX1_DOUBLE = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn.proj": ("attn.to_out.0",),
    "img_mlp.0": ("ff.net.0.proj",),
    "img_mlp.2": ("ff.net.2",),
    "img_mod.lin": ("norm1.linear",),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn.proj": ("attn.to_add_out",),
    "txt_mlp.0": ("ff_context.net.0.proj",),
    "txt_mlp.2": ("ff_context.net.2",),
    "txt_mod.lin": ("norm1_context.linear",),
}
_FLUX1_SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation.lin": ("norm.linear",),
}
_FLUX1_TOP = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
}


# The BFL LoRA layouts' names (``tiny.save_bfl_lora``): (double blocks, single blocks, the rest).
BFL_LORA_LAYERS = (_FLUX1_DOUBLE, _FLUX1_SINGLE, _FLUX1_TOP)


def save_xlabs_flux_lora(lora: TinyLora, path: str | os.PathLike) -> str:
    """FLUX.1 in xlabs' layout (``double_blocks.0.processor.qkv_lora1.down.weight``; no alphas): attention only,
    q/k/v sharing A."""
    names = {}
    for module in lora.layers:
        parts = module.split(".")
        kind, index, rest = parts[0], parts[1], ".".join(parts[2:])
        double = kind == "transformer_blocks"
        table = (
            {
                "attn.to_q": "qkv_lora1",
                "attn.to_k": "qkv_lora1",
                "attn.to_v": "qkv_lora1",
                "attn.to_out.0": "proj_lora1",
                "attn.add_q_proj": "qkv_lora2",
                "attn.add_k_proj": "qkv_lora2",
                "attn.add_v_proj": "qkv_lora2",
                "attn.to_add_out": "proj_lora2",
            }
            if double
            else {"attn.to_q": "qkv_lora", "attn.to_k": "qkv_lora", "attn.to_v": "qkv_lora", "proj_out": "proj_lora"}
        )
        if rest not in table:
            raise ValueError(f"xlabs LoRAs change attention layers only, not {module}")
        names.setdefault(f"{'double' if double else 'single'}_blocks.{index}.processor.{table[rest]}", []).append(
            module
        )
    tensors = {}
    for name, parts in names.items():
        order = sorted(parts, key=lambda m: ("to_q" in m or "add_q" in m, "to_k" in m or "add_k" in m), reverse=True)
        a, b, alpha = fused(lora, name, tuple(order), block_diagonal=False)
        if alpha != a.shape[0]:
            b = alpha / a.shape[0] * b  # xlabs has no alpha: the scale goes into B
        tensors[f"{name}.down.weight"] = a.contiguous()
        tensors[f"{name}.up.weight"] = b.contiguous()
    save_file(tensors, str(path))
    return str(path)
