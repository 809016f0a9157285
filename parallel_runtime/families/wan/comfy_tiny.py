"""A tiny Wan written as ComfyUI's own files (``make_tiny_wan_files``), with the diffusers folder of the same weights
it must convert to; for tests, examples and benchmarks (a tiny builder: nothing the nodes import).

The files are written by the inverse of diffusers' conversion, from the original model's own names (ComfyUI's
``comfy/ldm/wan/model.py``: ``self_attn.q``, ``cross_attn.k_img``, ``norm3``, ``ffn.0``, ``modulation``, ``head.head``),
never with diffusers' converters, so a test that compares the conversion with the diffusers folder is not circular
(tests/test_comfy_files_wan.py also checks that diffusers' ``convert_wan_transformer_to_diffusers`` undoes
``comfy_transformer`` exactly). The VAE's inverse is Qwen-Image's (the same Wan 2.1 VAE; ``qwenimage/tiny.py``'s
``wan_vae``), shared on purpose; Wan 2.2's VAE (TI2V-5B's) has its own (``comfy_vae22``, from ComfyUI's
``comfy/ldm/wan/vae2_2.py``: ``downsamples.N.downsamples.M``, ``residual.0/2/3/6``, ``middle``, ``head``, ``conv1`` /
``conv2``), which tests/test_comfy_files_wan.py checks against ComfyUI's own module.

What ComfyUI's files do not carry is Wan's own: heads 128 wide, Wan 2.1's VAE shape (four levels, two residual
blocks each) and the UMT5 tokenizer, here a small SentencePiece model trained offline on the tiny builders' words, held
in the text-encoder file as ComfyUI's are (``spiece_model``). Wan 2.1 I2V's CLIP vision file is transformers' own
names, as ``clip_vision_h.safetensors`` (16 heads, GELU, as ComfyUI's ViT-H config), or open_clip's
(``open_clip_vision``, the inverse of ComfyUI's ``convert_to_transformers``).
"""

from __future__ import annotations

import io
import os
import tempfile

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
    CLIPVisionModelWithProjection,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

from ..qwenimage.tiny import wan_vae
from ..tiny import FORMATS, WORDS, quantized, tagged_groups, write_formats
from . import files as wan_files

# diffusers' names → the original's, by prefix: the block's layers, then the model's.
_BLOCK_NAMES = (
    ("attn1.to_out.0", "self_attn.o"),
    ("attn2.to_out.0", "cross_attn.o"),
    ("attn2.add_k_proj", "cross_attn.k_img"),
    ("attn2.add_v_proj", "cross_attn.v_img"),
    ("attn2.norm_added_k", "cross_attn.norm_k_img"),
    ("attn1.to_", "self_attn."),  # to_q, to_k, to_v → q, k, v
    ("attn2.to_", "cross_attn."),
    ("attn1.", "self_attn."),  # norm_q, norm_k
    ("attn2.", "cross_attn."),
    ("norm2", "norm3"),  # the norm before cross-attention: the original's third
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("scale_shift_table", "modulation"),
)
_MODEL_NAMES = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    ("proj_out", "head.head"),
    ("scale_shift_table", "head.modulation"),
    ("patch_embedding", "patch_embedding"),
)


def _renamed(name: str, names: tuple[tuple[str, str], ...]) -> str:
    for diffusers, original in names:
        if name.startswith(diffusers):
            return original + name[len(diffusers) :]
    raise KeyError(f"no original name for {name!r}")


def comfy_transformer(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``WanTransformer3DModel``'s state dict in the original Wan layout (ComfyUI's files, without their prefix)."""
    out = {}
    for key, value in sd.items():
        if key.startswith("blocks."):
            _, index, rest = key.split(".", 2)
            out[f"blocks.{index}.{_renamed(rest, _BLOCK_NAMES)}"] = value
        else:
            out[_renamed(key, _MODEL_NAMES)] = value
    return out


def open_clip_vision(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``CLIPVisionModelWithProjection``'s state dict in open_clip's ``visual.*`` layout (q, k and v fused into
    ``attn.in_proj_*``, the projection ``[width, dim]``), written from open_clip's own names, not from the
    conversion's table."""
    out = {}
    model = {
        "embeddings.class_embedding": "class_embedding",
        "embeddings.patch_embedding.weight": "conv1.weight",
        "embeddings.position_embedding.weight": "positional_embedding",
        "pre_layrnorm.weight": "ln_pre.weight",
        "pre_layrnorm.bias": "ln_pre.bias",
        "post_layernorm.weight": "ln_post.weight",
        "post_layernorm.bias": "ln_post.bias",
    }
    layer = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
    layer["self_attn.out_proj"] = "attn.out_proj"
    layers = {int(k.split(".")[3]) for k in sd if k.startswith("vision_model.encoder.layers.")}
    for i in sorted(layers):
        ours, theirs = f"vision_model.encoder.layers.{i}.", f"visual.transformer.resblocks.{i}."
        for part in ("weight", "bias"):
            out[f"{theirs}attn.in_proj_{part}"] = torch.cat([sd[f"{ours}self_attn.{p}_proj.{part}"] for p in "qkv"])
            for name, original in layer.items():
                out[f"{theirs}{original}.{part}"] = sd[f"{ours}{name}.{part}"]
    for name, original in model.items():
        out[f"visual.{original}"] = sd[f"vision_model.{name}"]
    out["visual.proj"] = sd["visual_projection.weight"].t().contiguous()
    return out


def _image_encoder() -> tuple[CLIPVisionModelWithProjection, CLIPImageProcessor]:
    """A tiny CLIP ViT (16 heads of 4, as ViT-H's 16 of 80; 17 tokens of a 32-pixel image) and the processor Wan-AI's
    folders hold (transformers' CLIP defaults: OpenAI's mean and std, bicubic) at its size."""
    config = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,  # the pipeline reads the second-to-last hidden states
        num_attention_heads=wan_files.CLIP_HEADS,
        image_size=32,
        patch_size=8,
        projection_dim=24,
        hidden_act=wan_files.CLIP_ACTIVATION,
        layer_norm_eps=wan_files.CLIP_EPS,
    )
    return CLIPVisionModelWithProjection(config), CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32)


# diffusers' names of Wan 2.2's VAE → the original's: the model's layers, then a residual block's.
_VAE22_NAMES = (
    ("quant_conv", "conv1"),
    ("post_quant_conv", "conv2"),
    ("encoder.conv_in", "encoder.conv1"),
    ("decoder.conv_in", "decoder.conv1"),
    ("encoder.norm_out", "encoder.head.0"),
    ("encoder.conv_out", "encoder.head.2"),
    ("decoder.norm_out", "decoder.head.0"),
    ("decoder.conv_out", "decoder.head.2"),
)
_VAE22_RESNET = (
    ("norm1", "residual.0"),
    ("conv1", "residual.2"),
    ("norm2", "residual.3"),
    ("conv2", "residual.6"),
    ("conv_shortcut", "shortcut"),
)


def comfy_vae22(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``AutoencoderKLWan``'s state dict of Wan 2.2's VAE (``is_residual``) in the original layout
    (``wan2.2_vae.safetensors``). A level's residual blocks and its down- or upsampler are one Sequential there
    (``downsamples.N.downsamples.M``, the sampler last, after ``num_res_blocks`` residual blocks in the encoder and one
    more in the decoder); the middle's two residual blocks sit at 0 and 2 around its attention."""
    out = {}
    for key, value in sd.items():
        out[_original_vae22(key, sd)] = value
    return out


def _original_vae22(key: str, sd: dict[str, torch.Tensor]) -> str:
    for diffusers, original in _VAE22_NAMES:
        if key.startswith(diffusers + "."):
            return original + key[len(diffusers) :]
    side, kind, *rest = key.split(".")
    if kind == "mid_block":
        group, index, layer, *part = rest  # resnets.i.norm1.gamma / attentions.0.to_qkv.weight
        if group == "attentions":
            return ".".join([side, "middle", "1", layer, *part])
        return ".".join([side, "middle", str(2 * int(index)), _renamed(layer, _VAE22_RESNET), *part])
    blocks = "downsamples" if kind == "down_blocks" else "upsamples"
    level, group, *rest = rest
    if group in ("downsampler", "upsampler"):
        resnets = {k.split(".")[4] for k in sd if k.startswith(f"{side}.{kind}.{level}.resnets.")}
        return ".".join([side, blocks, level, blocks, str(len(resnets)), *rest])
    index, layer, *part = rest
    return ".".join([side, blocks, level, blocks, index, _renamed(layer, _VAE22_RESNET), *part])


def tiny_spiece_model() -> bytes:
    """A small SentencePiece unigram model over the tiny builders' words, with T5's special ids (pad 0, eos 1, unk 2,
    no bos), as UMT5's is; deterministic (one thread)."""
    import sentencepiece

    sentences = [" ".join(WORDS)] + [f"a {w} and the {v}" for w in WORDS for v in WORDS[:5]]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=80,
        hard_vocab_limit=False,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def _tokenizer(spiece: bytes) -> T5Tokenizer:
    with tempfile.TemporaryDirectory() as scratch:
        with open(os.path.join(scratch, "spiece.model"), "wb") as f:
            f.write(spiece)
        return T5Tokenizer.from_pretrained(scratch, extra_ids=0, model_max_length=wan_files.MAX_SEQUENCE_LENGTH)


def _transformer(in_channels: int, out_channels: int = 16, image_dim: int | None = None) -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=wan_files.HEAD_DIM,
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=wan_files.EPS,
        image_dim=image_dim,
        added_kv_proj_dim=2 * wan_files.HEAD_DIM if image_dim is not None else None,  # the inner width
    )


def wan22_vae() -> AutoencoderKLWan:
    """A tiny Wan 2.2 VAE (TI2V-5B's layout, random weights from the caller's RNG): 48 latent channels, residual
    down- and up-blocks, a wider decoder (``decoder_base_dim``), 2 × 2 patches of the 12-channel patchified pixels:
    16× spatially, 4× in time. Its per-channel latents mean / std are the real ones (``files.WAN22_LATENTS_MEAN``),
    not the identity, so a LATENT normalised the wrong way shows."""
    return AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=8,
        z_dim=48,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        latents_mean=list(wan_files.WAN22_LATENTS_MEAN),
        latents_std=list(wan_files.WAN22_LATENTS_STD),
    )


def make_tiny_wan_files(
    models_dir: str,
    reference_root: str,
    *,
    seed: int = 0,
    formats: tuple[str, ...] = FORMATS,
    experts: bool = False,
    i2v: bool = False,
    ti2v: bool = False,
) -> dict[str, tuple[dict[str, str], str]]:
    """Write a tiny Wan as ComfyUI's files under ``models_dir`` (one transformer file per format in ``formats``; with
    ``experts``, Wan 2.2 A14B's two, the low-noise one in bf16; ``i2v`` for image-to-video: Wan 2.2 A14B I2V with
    ``experts``, else Wan 2.1 I2V with its CLIP vision file in fp16, in ``clip_vision``; ``ti2v`` for Wan 2.2
    TI2V-5B: 48 latent channels, Wan 2.2's VAE, ``expand_timesteps``), and for each format a diffusers folder below
    ``reference_root`` with the same weights. Returns, per format, the widgets' values and the reference folder."""
    if not formats or set(formats) - set(FORMATS):
        raise ValueError(f"formats must be some of {FORMATS}")
    spiece = tiny_spiece_model()
    tokenizer = _tokenizer(spiece)
    in_channels = wan_files.I2V_CHANNELS if i2v else wan_files.T2V_CHANNELS
    if ti2v:
        in_channels = wan_files.TI2V_CHANNELS
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tokenizer) + 16,  # padded past the tokenizer, as UMT5-XXL's 256384
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=4,
                relative_attention_num_buckets=32,
                relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu",
                dense_act_fn="gelu_new",
                is_gated_act=True,
                layer_norm_epsilon=1e-6,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
                tie_word_embeddings=False,
            )
        )
        image_parts = _image_encoder() if i2v and not experts else None
        image_dim = image_parts[0].config.hidden_size if image_parts is not None else None
        transformer = _transformer(in_channels, wan_files.TI2V_CHANNELS if ti2v else 16, image_dim)
        low_noise = _transformer(in_channels) if experts else None
        vae = (
            wan22_vae()
            if ti2v
            else AutoencoderKLWan(
                base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]
            )
        )
    text_encoder.to(torch.bfloat16)  # as ComfyUI's umt5_xxl_fp16 (bf16 here)
    weights = transformer.state_dict()
    transformer.to(torch.bfloat16)
    shift = (wan_files.WAN22_I2V_SHIFT if i2v else wan_files.WAN22_T2V_SHIFT) if experts else wan_files.WAN21_SHIFT
    if ti2v:
        shift = wan_files.WAN22_TI2V_SHIFT
    scheduler = UniPCMultistepScheduler.from_config(
        {k: v for k, v in wan_files.scheduler(shift).items() if not k.startswith("_")}
    )
    parts = {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "scheduler": scheduler}
    if image_parts is not None:
        image_encoder, image_processor = image_parts
        image_encoder.to(torch.float16)  # as ComfyUI's clip_vision_h
        parts |= {"image_encoder": image_encoder, "image_processor": image_processor}
    if ti2v:
        parts["expand_timesteps"] = True
    if experts:
        low_noise.to(torch.bfloat16)
        boundary = wan_files.WAN22_I2V_BOUNDARY if i2v else wan_files.WAN22_T2V_BOUNDARY
        parts |= {"transformer_2": low_noise, "boundary_ratio": boundary}
    pipe = (WanImageToVideoPipeline if i2v else WanPipeline)(transformer=transformer, **parts)
    kind = "i2v" if i2v else "t2v"
    stem = f"tiny_wan2.2_{kind}_high_noise_14B" if experts else f"tiny_wan2.1_{kind}_{'14B' if i2v else '1.3B'}"
    if ti2v:
        stem = "tiny_wan2.2_ti2v_5B"
    # The text encoder's and the VAE's names carry the model's, so that several tiny Wans share a models folder.
    names = {
        "text_encoder": f"{stem}_umt5_xxl_bf16.safetensors",
        "text_encoder_2": "none",
        "vae": f"{stem}_{'wan2.2_vae' if ti2v else 'wan_2.1_vae'}.safetensors",
        "diffusion_model_2": f"tiny_wan2.2_{kind}_low_noise_14B_bf16.safetensors" if experts else "none",
    }
    files = [
        (
            "text_encoders",
            names["text_encoder"],
            {
                # ComfyUI's T5 keeps the embedding once (``shared``); transformers ties the encoder's to it.
                **{k: v for k, v in text_encoder.state_dict().items() if k != "encoder.embed_tokens.weight"},
                wan_files.SPIECE_KEY: torch.frombuffer(bytearray(spiece), dtype=torch.uint8),
            },
        ),
        ("vae", names["vae"], (comfy_vae22 if ti2v else wan_vae)(vae.state_dict())),
    ]
    if experts:
        files.append(("diffusion_models", names["diffusion_model_2"], comfy_transformer(low_noise.state_dict())))
    if image_parts is not None:
        names["clip_vision"] = f"{stem}_clip_vision_h.safetensors"
        files.append(("clip_vision", names["clip_vision"], image_encoder.state_dict()))
    for folder, name, tensors in files:
        os.makedirs(os.path.join(models_dir, folder), exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(models_dir, folder, name))
    groups = tagged_groups(weights, comfy_transformer)
    return write_formats(
        models_dir,
        reference_root,
        stem,
        pipe,
        names,
        formats,
        lambda fmt: quantized(weights, fmt, groups, comfy_transformer),
    )
