"""Tiny FLUX.1 written as ComfyUI distributes it: a transformer in Black Forest Labs' layout, CLIP-L and T5 in
transformers' layouts, the VAE in the original (LDM) layout — beside the same model as a diffusers folder.

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

import os
import shutil

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

from ..families import flux_files

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
    """Which diffusers tensors each BFL tensor is made of, read from the inverse mapping itself (each diffusers tensor
    tagged with its number)."""
    names = list(sd)
    # 1-D tags are enough: the mapping only concatenates and swaps along dim 0.
    tagged = {k: torch.full(sd[k].shape[:1], float(i), dtype=torch.float64) for i, k in enumerate(names)}
    bfl = _bfl_transformer(tagged, _count(sd, "transformer_blocks."), _count(sd, "single_transformer_blocks."))
    return {k: [names[int(i)] for i in torch.unique(v).tolist()] for k, v in bfl.items()}


def _count(sd: dict[str, torch.Tensor], prefix: str) -> int:
    return len({k[len(prefix) :].split(".")[0] for k in sd if k.startswith(prefix)})


def _quantized_transformer(
    sd: dict[str, torch.Tensor], fmt: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The BFL file's tensors in ``fmt`` (matrices in fp8, one scale per BFL matrix for scaled fp8; the rest bf16) and
    what they mean in diffusers' layout (bf16): the reference the conversion must give back."""
    layers, single = _count(sd, "transformer_blocks."), _count(sd, "single_transformer_blocks.")
    stored, meaning, scales = {}, {}, {}
    for bfl_key, parts in _groups(sd).items():
        matrix = fmt != "bf16" and all(sd[p].ndim == 2 for p in parts)
        scale = None
        if matrix and fmt == "fp8_scaled":
            scale = (max(sd[p].abs().max() for p in parts).float() / 448.0).clamp(min=1e-12)
            scales[bfl_key.removesuffix(".weight") + ".scale_weight"] = scale.reshape(())
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
    file = _bfl_transformer(as_bytes, layers, single)
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
    made = {}
    for fmt in formats:
        file, meaning = _quantized_transformer(weights, fmt)
        prefix = "model.diffusion_model." if fmt == "fp8_scaled" else ""  # as ComfyUI saves its own files
        transformer.load_state_dict(meaning)
        reference = os.path.join(reference_root, f"tiny-flux1-{variant}-{fmt}")
        if not made:
            pipe.save_pretrained(reference, safe_serialization=True)
        else:  # the same pipeline but for its transformer
            shutil.copytree(next(iter(made.values()))[1], reference, ignore=shutil.ignore_patterns("transformer"))
            transformer.save_pretrained(os.path.join(reference, "transformer"), safe_serialization=True)
        name = f"tiny-flux1-{variant}-{fmt}.safetensors"
        os.makedirs(os.path.join(models_dir, "diffusion_models"), exist_ok=True)
        save_file(
            {prefix + k: v.contiguous() for k, v in file.items()}, os.path.join(models_dir, "diffusion_models", name)
        )
        made[fmt] = ({**names, "diffusion_model": name}, reference)
    return made
