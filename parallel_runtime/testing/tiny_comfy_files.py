"""Tiny FLUX.1 and Qwen-Image written as ComfyUI distributes them, beside the same models as diffusers folders. FLUX.1:
a transformer in Black Forest Labs' layout, CLIP-L and T5 in transformers' layouts, the VAE in the original (LDM)
layout. Qwen-Image: the transformer in diffusers' keys (fp8 ones behind ComfyUI's prefix), Qwen2.5-VL in its published
layout without lm_head, the VAE in Wan 2.1's original layout (``wan_vae``).

The files are written from the diffusers model by the inverse of the documented key mapping (BFL's ``qkv`` and
``linear1`` are the concatenations of diffusers' ``to_q / to_k / to_v (/ proj_mlp)``, the final AdaLN's halves are
swapped, the VAE's attention is a 1×1 convolution, its decoder levels counted from the other end), so a test of the
conversion compares two independent descriptions of one layout.

What ComfyUI's files do not carry, the conversion takes from FLUX.1 itself, so the tiny model keeps those values:
heads 128 wide with the rotary axes (16, 56, 56), CLIP heads 64 wide, 32 VAE norm groups, and the real tokenizers
(from ComfyUI's installation, hence CLIP's and T5's real vocabulary sizes). It is still small: 2 heads, one block of
each kind, about 30 MB of files.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Callable

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from safetensors.torch import save_file
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from ..families.flux import files as flux_files
from ..families.qwenimage import files as qwenimage_files

FORMATS = ("bf16", "fp8", "fp8_scaled")


def _bfl_transformer(sd: dict[str, torch.Tensor], num_layers: int, num_single_layers: int) -> dict[str, torch.Tensor]:
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


def ldm_vae(sd: dict[str, torch.Tensor], levels: int) -> dict[str, torch.Tensor]:
    """diffusers' AutoencoderKL state dict in the original (LDM) layout of FLUX.1's ae.safetensors."""
    out: dict[str, torch.Tensor] = {}

    def resnet(ldm: str, diffusers: str) -> None:
        for key, value in sd.items():
            if key.startswith(diffusers + "."):
                out[ldm + key[len(diffusers) :].replace("conv_shortcut", "nin_shortcut")] = value

    def attention(ldm: str, diffusers: str) -> None:
        for ldm_name, name in (
            ("norm", "group_norm"),
            ("q", "to_q"),
            ("k", "to_k"),
            ("v", "to_v"),
            ("proj_out", "to_out.0"),
        ):
            for part in ("weight", "bias"):
                value = sd[f"{diffusers}.{name}.{part}"]
                out[f"{ldm}.{ldm_name}.{part}"] = value[:, :, None, None] if value.ndim == 2 else value

    for side in ("encoder", "decoder"):
        for name in ("conv_in", "conv_out"):
            for part in ("weight", "bias"):
                out[f"{side}.{name}.{part}"] = sd[f"{side}.{name}.{part}"]
        for part in ("weight", "bias"):
            out[f"{side}.norm_out.{part}"] = sd[f"{side}.conv_norm_out.{part}"]
        resnet(f"{side}.mid.block_1", f"{side}.mid_block.resnets.0")
        resnet(f"{side}.mid.block_2", f"{side}.mid_block.resnets.1")
        attention(f"{side}.mid.attn_1", f"{side}.mid_block.attentions.0")
    for i in range(levels):
        j = 0
        while f"encoder.down_blocks.{i}.resnets.{j}.conv1.weight" in sd:
            resnet(f"encoder.down.{i}.block.{j}", f"encoder.down_blocks.{i}.resnets.{j}")
            j += 1
        for part in ("weight", "bias"):
            if f"encoder.down_blocks.{i}.downsamplers.0.conv.{part}" in sd:
                out[f"encoder.down.{i}.downsample.conv.{part}"] = sd[
                    f"encoder.down_blocks.{i}.downsamplers.0.conv.{part}"
                ]
        up = levels - 1 - i  # LDM counts the decoder's levels from the latent end
        j = 0
        while f"decoder.up_blocks.{i}.resnets.{j}.conv1.weight" in sd:
            resnet(f"decoder.up.{up}.block.{j}", f"decoder.up_blocks.{i}.resnets.{j}")
            j += 1
        for part in ("weight", "bias"):
            if f"decoder.up_blocks.{i}.upsamplers.0.conv.{part}" in sd:
                out[f"decoder.up.{up}.upsample.conv.{part}"] = sd[f"decoder.up_blocks.{i}.upsamplers.0.conv.{part}"]
    return out


def _groups(sd: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Which diffusers tensors each FLUX.1 BFL tensor is made of (``_tagged_groups``)."""
    layers, single = _count(sd, "transformer_blocks."), _count(sd, "single_transformer_blocks.")
    return _tagged_groups(sd, lambda tensors: _bfl_transformer(tensors, layers, single))


def _tagged_groups(
    sd: dict[str, torch.Tensor], layout: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
) -> dict[str, list[str]]:
    """Which diffusers tensors each file tensor is made of, read from the inverse mapping ``layout`` itself (each
    diffusers tensor tagged with its number)."""
    names = list(sd)
    # 1-D tags are enough: the mappings only concatenate and swap along dim 0.
    tagged = {k: torch.full(sd[k].shape[:1], float(i), dtype=torch.float64) for i, k in enumerate(names)}
    return {k: [names[int(i)] for i in torch.unique(v).tolist()] for k, v in layout(tagged).items()}


def _count(sd: dict[str, torch.Tensor], prefix: str) -> int:
    return len({k[len(prefix) :].split(".")[0] for k in sd if k.startswith(prefix)})


def _quantized_transformer(
    sd: dict[str, torch.Tensor], fmt: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The BFL file's tensors in ``fmt`` and what they mean in diffusers' layout (``_quantized``)."""
    layers, single = _count(sd, "transformer_blocks."), _count(sd, "single_transformer_blocks.")
    return _quantized(sd, fmt, _groups(sd), lambda tensors: _bfl_transformer(tensors, layers, single))


def _quantized(
    sd: dict[str, torch.Tensor],
    fmt: str,
    groups: dict[str, list[str]],
    layout: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A transformer file's tensors in ``fmt`` (matrices in fp8, one scale per file matrix for scaled fp8; the rest
    bf16) and what they mean in diffusers' layout (bf16): the reference the conversion must give back. ``groups``: the
    diffusers tensors each file tensor is made of; ``layout``: diffusers' state dict in the file's layout."""
    stored, meaning, scales = {}, {}, {}
    for file_key, parts in groups.items():
        matrix = fmt != "bf16" and all(sd[p].ndim == 2 for p in parts)
        scale = None
        if matrix and fmt == "fp8_scaled":
            scale = (max(sd[p].abs().max() for p in parts).float() / 448.0).clamp(min=1e-12)
            scales[file_key.removesuffix(".weight") + ".scale_weight"] = scale.reshape(())
        for p in parts:
            if not matrix:
                stored[p] = meaning[p] = sd[p].to(torch.bfloat16)
            elif scale is None:
                stored[p] = sd[p].to(torch.float8_e4m3fn)
                meaning[p] = stored[p].to(torch.bfloat16)
            else:
                stored[p] = (sd[p].float() / scale).to(torch.float8_e4m3fn)
                meaning[p] = (stored[p].float() * scale).to(torch.bfloat16)
    # fp8 tensors are concatenated as bytes (cat of float8 is not implemented everywhere), which is exact.
    as_bytes = {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v for k, v in stored.items()}
    file = layout(as_bytes)
    file = {k: v.view(torch.float8_e4m3fn) if v.dtype == torch.uint8 else v for k, v in file.items()}
    file.update(scales)
    if fmt == "fp8_scaled":
        file["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return file, meaning


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
    return _write_formats(
        models_dir,
        reference_root,
        f"tiny-flux1-{variant}",
        pipe,
        names,
        formats,
        lambda fmt: _quantized_transformer(weights, fmt),
    )


def _write_formats(
    models_dir: str,
    reference_root: str,
    stem: str,
    pipe: object,
    names: dict[str, str],
    formats: tuple[str, ...],
    quantized: Callable[[str], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]],
) -> dict[str, tuple[dict[str, str], str]]:
    """One transformer file per format (``quantized``: its tensors and what they mean) in ``diffusion_models``, scaled
    fp8 behind ComfyUI's ``model.diffusion_model.`` prefix as ComfyUI saves its own files, and for each the diffusers
    folder of ``pipe`` with that meaning: the widgets' values and the folder, per format."""
    made: dict[str, tuple[dict[str, str], str]] = {}
    for fmt in formats:
        file, meaning = quantized(fmt)
        prefix = "model.diffusion_model." if fmt == "fp8_scaled" else ""
        pipe.transformer.load_state_dict(meaning)
        reference = os.path.join(reference_root, f"{stem}-{fmt}")
        if not made:
            pipe.save_pretrained(reference, safe_serialization=True)
        else:  # the same pipeline but for its transformer
            shutil.copytree(next(iter(made.values()))[1], reference, ignore=shutil.ignore_patterns("transformer"))
            pipe.transformer.save_pretrained(os.path.join(reference, "transformer"), safe_serialization=True)
        name = f"{stem}-{fmt}.safetensors"
        os.makedirs(os.path.join(models_dir, "diffusion_models"), exist_ok=True)
        save_file(
            {prefix + k: v.contiguous() for k, v in file.items()}, os.path.join(models_dir, "diffusion_models", name)
        )
        made[fmt] = ({**names, "diffusion_model": name}, reference)
    return made


# -- Qwen-Image ------------------------------------------------------------------------------------------------
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
    return _write_formats(
        models_dir,
        reference_root,
        "tiny-qwen-image",
        pipe,
        names,
        formats,
        lambda fmt: _quantized(weights, fmt, {k: [k] for k in weights}, dict),
    )


# -- FLUX.2 ------------------------------------------------------------------------------------------------------
def _bfl_flux2_transformer(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' Flux2Transformer2DModel state dict in BFL's layout (no biases: FLUX.2 has none)."""
    out: dict[str, torch.Tensor] = {}
    for bfl, diffusers in (
        ("img_in", "x_embedder"),
        ("txt_in", "context_embedder"),
        ("time_in.in_layer", "time_guidance_embed.timestep_embedder.linear_1"),
        ("time_in.out_layer", "time_guidance_embed.timestep_embedder.linear_2"),
        ("guidance_in.in_layer", "time_guidance_embed.guidance_embedder.linear_1"),
        ("guidance_in.out_layer", "time_guidance_embed.guidance_embedder.linear_2"),
        ("double_stream_modulation_img.lin", "double_stream_modulation_img.linear"),
        ("double_stream_modulation_txt.lin", "double_stream_modulation_txt.linear"),
        ("single_stream_modulation.lin", "single_stream_modulation.linear"),
        ("final_layer.linear", "proj_out"),
    ):
        if f"{diffusers}.weight" in sd:
            out[f"{bfl}.weight"] = sd[f"{diffusers}.weight"]
    for i in range(_count(sd, "transformer_blocks.")):
        b, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        out[f"{b}.img_attn.qkv.weight"] = torch.cat([sd[f"{d}.attn.to_{x}.weight"] for x in "qkv"])
        out[f"{b}.txt_attn.qkv.weight"] = torch.cat([sd[f"{d}.attn.add_{x}_proj.weight"] for x in "qkv"])
        for bfl, diffusers in (
            ("img_attn.norm.query_norm.scale", "attn.norm_q"),
            ("img_attn.norm.key_norm.scale", "attn.norm_k"),
            ("txt_attn.norm.query_norm.scale", "attn.norm_added_q"),
            ("txt_attn.norm.key_norm.scale", "attn.norm_added_k"),
            ("img_attn.proj.weight", "attn.to_out.0"),
            ("txt_attn.proj.weight", "attn.to_add_out"),
            ("img_mlp.0.weight", "ff.linear_in"),
            ("img_mlp.2.weight", "ff.linear_out"),
            ("txt_mlp.0.weight", "ff_context.linear_in"),
            ("txt_mlp.2.weight", "ff_context.linear_out"),
        ):
            out[f"{b}.{bfl}"] = sd[f"{d}.{diffusers}.weight"]
    for i in range(_count(sd, "single_transformer_blocks.")):
        b, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        for bfl, diffusers in (
            ("linear1.weight", "attn.to_qkv_mlp_proj"),
            ("linear2.weight", "attn.to_out"),
            ("norm.query_norm.scale", "attn.norm_q"),
            ("norm.key_norm.scale", "attn.norm_k"),
        ):
            out[f"{b}.{bfl}"] = sd[f"{d}.{diffusers}.weight"]
    scale, shift = sd["norm_out.linear.weight"].chunk(2)
    out["final_layer.adaLN_modulation.1.weight"] = torch.cat([shift, scale])
    return out


def _bfl_flux2_vae(sd: dict[str, torch.Tensor], levels: int) -> dict[str, torch.Tensor]:
    """diffusers' AutoencoderKLFlux2 state dict in flux2-vae.safetensors' layout: the LDM layout, the quant convs
    inside the encoder and decoder (as BFL keeps them), the batch-norm statistics as they are."""
    out = ldm_vae(sd, levels)
    for part in ("weight", "bias"):
        out[f"encoder.quant_conv.{part}"] = sd[f"quant_conv.{part}"]
        out[f"decoder.post_quant_conv.{part}"] = sd[f"post_quant_conv.{part}"]
    for key in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        out[key] = sd[key]
    return out


# Mistral's tekken special tokens, at their real ranks (<pad> is 11, as ComfyUI pads).
_TEKKEN_SPECIALS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
)  # fmt: skip
# Tekken's pre-tokenizer pattern (tiktoken-style words, digits one by one).
_TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def tiny_tekken(texts: list[str]) -> bytes:
    """A tiny tekken.json (Mistral's tokenizer format, as ComfyUI's FLUX.2 text encoder file carries it): the 256
    bytes, then every word ``texts`` pre-tokenize into as one token, after the special tokens."""
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(_TEKKEN_PATTERN), behavior="isolated")
    words = dict.fromkeys(piece.encode() for text in texts for piece, _ in split.pre_tokenize_str(text))
    tokens = [bytes([b]) for b in range(256)] + [w for w in words if len(w) > 1]
    return json.dumps(
        {
            "config": {
                "pattern": _TEKKEN_PATTERN,
                "num_vocab_tokens": len(tokens),
                "default_vocab_size": len(tokens) + len(_TEKKEN_SPECIALS),
                "default_num_special_tokens": len(_TEKKEN_SPECIALS),
                "version": "v7",
            },
            "vocab": [
                {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
                for i, t in enumerate(tokens)
            ],
            "special_tokens": [{"rank": i, "token_str": t, "is_control": True} for i, t in enumerate(_TEKKEN_SPECIALS)],
        }
    ).encode()


WHOLE_MISTRAL = "tiny_mistral_3_small_whole.safetensors"


def make_tiny_flux2_files(
    models_dir: str,
    reference_root: str,
    *,
    seed: int = 0,
    formats: tuple[str, ...] = FORMATS,
) -> dict[str, tuple[dict[str, str], str]]:
    """Write a tiny FLUX.2-dev as ComfyUI's files under ``models_dir`` (``diffusion_models/``, ``text_encoders/``,
    ``vae/``), one transformer file per format in ``formats``, and for each a diffusers folder below
    ``reference_root`` holding the same weights as black-forest-labs/FLUX.2-dev lays them out: the whole
    Mistral3ForConditionalGeneration (40 layers, a vision tower) and its PixtralProcessor made by transformers from the
    tekken vocabulary. The text encoder file (``text_encoder``'s value) is the language model's first 30 layers in
    ComfyUI's names without the final norm, as ComfyUI distributes it, with the tekken vocabulary as its
    ``tekken_model`` tensor; ``WHOLE_MISTRAL`` beside it holds all 40 and the norm. Returns, per format, the widgets'
    values (diffusion_model, text_encoder, text_encoder_2 "none", vae) and the reference folder.

    What the files do not carry the conversion takes from FLUX.2 itself, so the tiny model keeps those values: heads
    128 wide with the rotary axes (32, 32, 32, 32), Mistral heads 128 wide, 32 VAE norm groups."""
    import tempfile

    from diffusers import AutoencoderKLFlux2, Flux2Pipeline, Flux2Transformer2DModel
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessor, PixtralProcessor
    from transformers.integrations.mistral import convert_tekken_tokenizer

    from ..families.flux2 import files as flux2_files
    from .tiny_models import _WORDS

    if not formats or set(formats) - set(FORMATS):
        raise ValueError(f"formats must be some of {FORMATS}")
    tekken = tiny_tekken([SYSTEM_MESSAGE, " ".join(_WORDS), " " + " ".join(_WORDS)])
    with tempfile.TemporaryDirectory() as scratch:
        with open(os.path.join(scratch, "tekken.json"), "wb") as f:
            f.write(tekken)
        tokenizer = convert_tekken_tokenizer(
            os.path.join(scratch, "tekken.json"), chat_template=flux2_files.CHAT_TEMPLATE
        )
    tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"  # init_kwargs: what is saved
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(patch_size=14),
        tokenizer=tokenizer,
        patch_size=14,
        spatial_merge_size=2,
        chat_template=flux2_files.CHAT_TEMPLATE,
    )
    head_dim = flux2_files.MISTRAL_HEAD_DIM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Mistral3ForConditionalGeneration(
            Mistral3Config(
                text_config={
                    "model_type": "mistral",
                    "vocab_size": len(tokenizer),
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_hidden_layers": 40,  # Mistral Small 3.1's
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "head_dim": head_dim,
                    "max_position_embeddings": flux2_files.MISTRAL_MAX_POSITIONS,
                    "rms_norm_eps": flux2_files.MISTRAL_RMS_NORM_EPS,
                    "rope_parameters": {"rope_type": "default", "rope_theta": flux2_files.MISTRAL_ROPE_THETA},
                    "bos_token_id": 1,
                    "eos_token_id": 2,
                    "pad_token_id": 11,
                },
                vision_config={
                    "model_type": "pixtral",
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "image_size": 56,
                    "patch_size": 14,
                },
                image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
                spatial_merge_size=2,
            )
        )
        transformer = Flux2Transformer2DModel(
            patch_size=1,
            in_channels=128,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=sum(flux2_files.AXES_DIMS_ROPE),
            num_attention_heads=2,
            joint_attention_dim=3 * 16,
            timestep_guidance_channels=32,
            mlp_ratio=3.0,
            axes_dims_rope=flux2_files.AXES_DIMS_ROPE,
            rope_theta=flux2_files.ROPE_THETA,
            eps=flux2_files.EPS,
            guidance_embeds=True,
        )
        vae = AutoencoderKLFlux2(
            block_out_channels=(32, 32, 32, 32),
            layers_per_block=1,
            latent_channels=32,
            norm_num_groups=flux2_files.VAE_NORM_GROUPS,
            sample_size=1024,
            batch_norm_eps=flux2_files.VAE_BATCH_NORM_EPS,
            batch_norm_momentum=flux2_files.VAE_BATCH_NORM_MOMENTUM,
        )
        # A fresh BatchNorm's mean 0 / var 1 would hide a lost statistic.
        vae.bn.running_mean.copy_(0.5 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(0.5 + torch.rand_like(vae.bn.running_var))
    # The dtypes ComfyUI distributes them in: the text encoder and the transformer in bf16 (or fp8), the VAE fp32.
    text_encoder.to(torch.bfloat16)
    weights = transformer.state_dict()
    transformer.to(torch.bfloat16)
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            **{k: v for k, v in flux2_files.SCHEDULER.items() if not k.startswith("_")}
        ),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=processor,
        transformer=transformer,
    )
    language = {
        "model." + k.removeprefix("model.language_model."): v
        for k, v in text_encoder.state_dict().items()
        if k.startswith("model.language_model.")
    }
    language[flux2_files.TEKKEN_KEY] = torch.frombuffer(bytearray(tekken), dtype=torch.uint8)
    # ComfyUI's cut: layers 0-29, no final norm.
    cut = {
        k: v
        for k, v in language.items()
        if k != "model.norm.weight" and not (k.startswith("model.layers.") and int(k.split(".")[2]) >= 30)
    }
    names = {
        "text_encoder": "tiny_mistral_3_small_flux2_bf16.safetensors",
        "text_encoder_2": "none",
        "vae": "tiny_flux2-vae.safetensors",
    }
    for folder, name, tensors in (
        ("text_encoders", names["text_encoder"], cut),
        ("text_encoders", WHOLE_MISTRAL, language),
        ("vae", names["vae"], _bfl_flux2_vae(vae.state_dict(), 4)),
    ):
        os.makedirs(os.path.join(models_dir, folder), exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(models_dir, folder, name))
    groups = _tagged_groups(weights, _bfl_flux2_transformer)
    return _write_formats(
        models_dir,
        reference_root,
        "tiny-flux2-dev",
        pipe,
        names,
        formats,
        lambda fmt: _quantized(weights, fmt, groups, _bfl_flux2_transformer),
    )
