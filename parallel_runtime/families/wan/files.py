"""Wan as ComfyUI distributes it: the single files' key layouts and the diffusers folder they make.

ComfyUI keeps Wan as three files, four for Wan 2.2 A14B and Wan 2.1 I2V:

- the transformer in the original Wan layout (``wan2.1_t2v_14B_bf16.safetensors``, ``..._fp8_scaled``,
  ``wan2.1_t2v_1.3B_fp16.safetensors`` in ``models/diffusion_models``, often behind ComfyUI's
  ``model.diffusion_model.`` prefix: ``patch_embedding``, ``blocks.N.self_attn.q``, ``blocks.N.cross_attn.k_img``,
  ``blocks.N.modulation``, ``head.head``), moved tensor by tensor into ``WanTransformer3DModel``'s keys
  (``transformer_moves``; a rename, nothing split or fused: tests/test_comfy_files_wan.py checks it against diffusers'
  own ``convert_wan_transformer_to_diffusers``);
- Wan 2.2 A14B's two experts, one file each (``wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors`` in
  ``diffusion_model``, ``wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors`` in ``diffusion_model_2``): the pipeline's
  ``transformer`` (high noise) and ``transformer_2`` (low noise), switched at the boundary timestep;
- the text encoder, UMT5-XXL's encoder (``umt5_xxl_fp8_e4m3fn_scaled.safetensors`` / ``umt5_xxl_fp16`` in
  ``models/text_encoders``) in transformers' own key names, with its SentencePiece model as a uint8 tensor
  ``spiece_model`` (ComfyUI's tokenizer reads it from there): linked as it is (rewritten when fp8), the tokenizer
  made from that model (``write_tokenizer``);
- the VAE, Wan 2.1's (``wan_2.1_vae.safetensors``, which Wan 2.2 A14B uses too) in its original layout, through
  diffusers' ``convert_wan_vae_to_diffusers``. Its shape checks and converter are Qwen-Image's (whose VAE is Wan
  2.1's): shared on purpose, imported from ``families/qwenimage/files.py``;
- Wan 2.1 I2V's image encoder, CLIP ViT-H/14 (``clip_vision_h.safetensors`` in ``models/clip_vision``, the
  ``clip_vision`` widget), as ComfyUI's ``comfy/clip_vision.py`` reads it: in transformers' own names
  (``vision_model.*``, ``visual_projection.weight``: linked as it is) or in open_clip's (``visual.*``: the fused
  ``in_proj`` split into q, k, v and ``proj`` transposed, as ComfyUI's ``convert_to_transformers``), into the folder's
  ``image_encoder`` (``CLIPVisionModelWithProjection``, as Wan-AI's diffusers folders) and the ``image_processor``
  that makes its input (CLIP's: the shorter side to the encoder's size, the centre cropped, OpenAI's mean and std; what
  ComfyUI's ``clip_preprocess`` does and laion/CLIP-ViT-H-14's processor, the one Wan-AI's folders hold).
- Wan 2.2 TI2V-5B: one transformer file (``wan2.2_ti2v_5B_fp16.safetensors``, told by its 48 input channels) and Wan
  2.2's 48-channel VAE (``wan2.2_vae.safetensors``, in its original layout: ``vae22_config``,
  ``wan22_vae_to_diffusers``, the renames of diffusers' ``convert_vae_22`` script), into a ``WanPipeline`` folder with
  ``expand_timesteps`` (the ``wan_ti2v`` family) and TI2V-5B's flow shift 5.

What the shapes cannot tell, and how it is decided:

- heads are 128 wide in every Wan (ComfyUI assumes the same): the head count is the width over 128;
- Wan 2.1 14B T2V and either Wan 2.2 A14B T2V expert have the same shapes: two transformer files make Wan 2.2
  A14B, one makes Wan 2.1; a lone file whose name says it is an expert (``high_noise`` / ``low_noise``) is refused,
  and so are the experts picked the wrong way round (by their names, when they say);
- which expert is which: the widget (``diffusion_model`` the high-noise one, ``diffusion_model_2`` the low-noise);
- T2V, I2V or TI2V-5B: the transformer's input channels (16: T2V; 36: the noise, a mask and the start image's latents;
  48: TI2V-5B), and Wan 2.1 I2V by its image embedding (``img_emb``);
- the image encoder's heads: 16, as every CLIP ViT ComfyUI loads (L/14, H/14, g/14, bigG/14; its
  ``clip_vision_config_h.json``), its activation GELU and its layer norms' epsilon 1e-5 (the same file's);
- the scheduler's flow shift and the experts' boundary: the published ones (shift 3 for Wan 2.1, as Wan-AI's diffusers
  folders; 12 with boundary 0.875 for Wan 2.2 T2V A14B, 5 with boundary 0.9 for its I2V, as Wan 2.2's own configs).

Refused by name: Wan 2.1 I2V without its CLIP vision file (and a CLIP vision file for any other Wan), Wan 2.2's VAE
beside any transformer but TI2V-5B's, and the other Wan models (VACE, FLF2V, Fun camera, S2V, HuMo, Animate); a
diffusers folder runs what is refused here.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import ClassVar

from ...errors import InvalidInput
from ..files import (
    Component,
    FilesContents,
    FilesLayout,
    FolderFromComfy,
    Move,
    Shapes,
    SourceHeader,
    TokenizerFromFile,
    configs_from_shapes,
    count,
)
from ..flux.files import t5_config
from ..qwenimage import files as qwenimage_files

# Every Wan's attention heads are 128 wide (not in the weights: the head count is the width over this).
HEAD_DIM = 128
# The transformer's constants (WanTransformer3DModel's defaults and the published configs): not in the weights.
EPS = 1e-6
ROPE_MAX_SEQ_LEN = 1024
# The transformer's input channels: T2V the noise; I2V the noise, a 4-channel mask and the start image's latents.
T2V_CHANNELS = 16
I2V_CHANNELS = 36
# The two experts' switch (``boundary_ratio``) and the scheduler's flow shift, per model: Wan 2.2's from the original
# repository's configs (``boundary``, ``sample_shift``), Wan 2.1's Wan-AI's diffusers folders' (3.0, for 480p).
WAN22_T2V_BOUNDARY, WAN22_T2V_SHIFT = 0.875, 12.0
WAN22_I2V_BOUNDARY, WAN22_I2V_SHIFT = 0.9, 5.0
WAN21_SHIFT = 3.0
# The tokenizer's length: WanPipeline pads and cuts prompts to 512 tokens (ComfyUI pads to at least 512).
MAX_SEQUENCE_LENGTH = 512
SPIECE_KEY = "spiece_model"
# Names that say a file is one of Wan 2.2 A14B's experts (ComfyUI's: wan2.2_t2v_high_noise_14B_...).
HIGH_NOISE, LOW_NOISE = "high_noise", "low_noise"
# The published sizes, by the transformer's width.
SIZES = {1536: "1.3B", 3072: "5B", 5120: "14B"}
WAN21_I2V = "Wan 2.1 I2V"  # the variant of a transformer with an image embedding: it takes a CLIP vision file


def scheduler(flow_shift: float) -> dict:
    """The scheduler of Wan-AI's diffusers folders: UniPC on flow sigmas, shifted by ``flow_shift``."""
    return {
        "_class_name": "UniPCMultistepScheduler",
        "num_train_timesteps": 1000,
        "beta_start": 0.0001,
        "beta_end": 0.02,
        "beta_schedule": "linear",
        "trained_betas": None,
        "solver_order": 2,
        "prediction_type": "flow_prediction",
        "thresholding": False,
        "dynamic_thresholding_ratio": 0.995,
        "sample_max_value": 1.0,
        "predict_x0": True,
        "solver_type": "bh2",
        "lower_order_final": True,
        "disable_corrector": [],
        "solver_p": None,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "use_flow_sigmas": True,
        "flow_shift": flow_shift,
        "timestep_spacing": "linspace",
        "steps_offset": 0,
        "final_sigmas_type": "zero",
        "rescale_betas_zero_snr": False,
    }


# -- the transformer ---------------------------------------------------------------------------------------------
def is_transformer(shapes: Shapes) -> bool:
    """Wan's transformer in the original layout (ComfyUI and diffusers tell it by ``head.modulation``)."""
    return "head.modulation" in shapes and "patch_embedding.weight" in shapes


# Wan models ComfyUI tells by a key of their own (comfy/model_detection.py), which this pack does not run.
OTHER_MODELS = (
    ("vace_patch_embedding.weight", "Wan VACE"),
    ("control_adapter.conv.weight", "Wan Fun camera control"),
    ("casual_audio_encoder.encoder.final_linear.weight", "Wan 2.2 S2V"),
    ("audio_proj.audio_proj_glob_1.layer.bias", "HuMo"),
    ("face_adapter.fuser_blocks.0.k_norm.weight", "Wan 2.2 Animate"),
    ("img_emb.emb_pos", "Wan FLF2V (first and last frame)"),
    ("ref_conv.weight", "Wan Fun (a reference image)"),
)


def transformer_config(shapes: Shapes) -> dict:
    """``WanTransformer3DModel``'s config from the file's shapes (ComfyUI's model_detection reads the same)."""
    inner, in_channels, *patch = shapes["patch_embedding.weight"]
    if inner % HEAD_DIM:
        raise ValueError(f"a width of {inner}, which is not {HEAD_DIM}-wide heads (every Wan's)")
    image = "img_emb.proj.0.weight" in shapes
    return {
        "_class_name": "WanTransformer3DModel",
        "patch_size": list(patch),
        "num_attention_heads": inner // HEAD_DIM,
        "attention_head_dim": HEAD_DIM,
        "in_channels": in_channels,
        "out_channels": shapes["head.head.weight"][0] // (patch[0] * patch[1] * patch[2]),
        "text_dim": shapes["text_embedding.0.weight"][1],
        "freq_dim": shapes["time_embedding.0.weight"][1],
        "ffn_dim": shapes["blocks.0.ffn.0.weight"][0],
        "num_layers": count(shapes, r"blocks\.(\d+)\."),
        "cross_attn_norm": "blocks.0.norm3.weight" in shapes,
        "qk_norm": "rms_norm_across_heads" if "blocks.0.self_attn.norm_q.weight" in shapes else None,
        "eps": EPS,
        "image_dim": shapes["img_emb.proj.0.weight"][0] if image else None,
        "added_kv_proj_dim": inner if image else None,
        "rope_max_seq_len": ROPE_MAX_SEQ_LEN,
        "pos_embed_seq_len": None,
    }


def transformer_moves(config: dict) -> list[Move]:
    """Every tensor of ``WanTransformer3DModel`` and its key in the original Wan layout (a rename, one to one)."""
    moves: list[Move] = []

    def layer(target: str, source: str, parts: tuple[str, ...] = ("weight", "bias")) -> None:
        moves.extend(Move(f"{target}.{part}", f"{source}.{part}") for part in parts)

    layer("patch_embedding", "patch_embedding")
    embedder = "condition_embedder"
    layer(f"{embedder}.time_embedder.linear_1", "time_embedding.0")
    layer(f"{embedder}.time_embedder.linear_2", "time_embedding.2")
    layer(f"{embedder}.time_proj", "time_projection.1")
    layer(f"{embedder}.text_embedder.linear_1", "text_embedding.0")
    layer(f"{embedder}.text_embedder.linear_2", "text_embedding.2")
    if config["image_dim"] is not None:
        for target, index in (("norm1", 0), ("ff.net.0.proj", 1), ("ff.net.2", 3), ("norm2", 4)):
            layer(f"{embedder}.image_embedder.{target}", f"img_emb.proj.{index}")
    for i in range(config["num_layers"]):
        t, s = f"blocks.{i}", f"blocks.{i}"
        for attn, original in (("attn1", "self_attn"), ("attn2", "cross_attn")):
            for target, source in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o")):
                layer(f"{t}.{attn}.{target}", f"{s}.{original}.{source}")
            if config["qk_norm"] is not None:
                layer(f"{t}.{attn}.norm_q", f"{s}.{original}.norm_q", ("weight",))
                layer(f"{t}.{attn}.norm_k", f"{s}.{original}.norm_k", ("weight",))
        if config["added_kv_proj_dim"] is not None:
            layer(f"{t}.attn2.add_k_proj", f"{s}.cross_attn.k_img")
            layer(f"{t}.attn2.add_v_proj", f"{s}.cross_attn.v_img")
            layer(f"{t}.attn2.norm_added_k", f"{s}.cross_attn.norm_k_img", ("weight",))
        if config["cross_attn_norm"]:
            layer(f"{t}.norm2", f"{s}.norm3")  # the original's norm3 (before cross-attention) is diffusers' norm2
        layer(f"{t}.ffn.net.0.proj", f"{s}.ffn.0")
        layer(f"{t}.ffn.net.2", f"{s}.ffn.2")
        moves.append(Move(f"{t}.scale_shift_table", f"{s}.modulation"))
    layer("proj_out", "head.head")
    moves.append(Move("scale_shift_table", "head.modulation"))
    return moves


def _expert(name: str) -> str | None:
    """Which of Wan 2.2 A14B's experts a file's name says it is, or None."""
    lower = os.path.basename(name).lower()
    return next((which for which in (HIGH_NOISE, LOW_NOISE) if which in lower), None)


def _check_ti2v(ti2v: bool, vae: SourceHeader, transformer_2: SourceHeader | None) -> None:
    """Wan 2.2 TI2V-5B is one transformer with Wan 2.2's VAE (``wan2.2_vae.safetensors``), which nothing else takes."""
    if ti2v and transformer_2 is not None:
        raise InvalidInput(
            "diffusion_model_2",
            "Wan 2.2 TI2V-5B is one transformer (not Wan 2.2 A14B's two experts); set diffusion_model_2 to none",
        )
    if ti2v and not is_vae22(vae.shapes):
        raise InvalidInput(
            vae.widget,
            f"{vae.name!r} is not Wan 2.2's 48-channel VAE, which Wan 2.2 TI2V-5B's transformer makes latents for; "
            "pick wan2.2_vae.safetensors",
        )


# -- the text encoder --------------------------------------------------------------------------------------------
def is_umt5(shapes: Shapes) -> bool:
    """UMT5's encoder: T5's layout with a relative attention bias in every block (T5 has one, in the first)."""
    return (
        "shared.weight" in shapes and "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" in shapes
    )


def umt5_config(shapes: Shapes) -> dict:
    """UMT5-XXL's config (google/umt5-xxl's, which Wan-AI's text_encoder holds) at the file's sizes: T5 v1.1's read
    of the shapes (FLUX.1's T5-XXL, shared on purpose), as the UMT5 model."""
    return {**t5_config(shapes), "architectures": ["UMT5EncoderModel"], "model_type": "umt5"}


def write_tokenizer(spiece: bytes, folder: str) -> None:
    """The tokenizer WanPipeline takes (T5's, as google/umt5-xxl's) made from the text-encoder file's SentencePiece
    model, the one ComfyUI's UMT5 tokenizer runs. ValueError when the data is not a SentencePiece model."""
    import sentencepiece
    from transformers import T5Tokenizer

    try:
        sentencepiece.SentencePieceProcessor(model_proto=spiece)
    except RuntimeError as e:
        raise ValueError(f"not a SentencePiece model ({e})") from None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "spiece.model")
    with open(path, "wb") as f:
        f.write(spiece)
    # No sentinel <extra_id_*> tokens: ComfyUI's tokenizer has none, and no prompt needs them.
    T5Tokenizer.from_pretrained(folder, extra_ids=0, model_max_length=MAX_SEQUENCE_LENGTH).save_pretrained(folder)


# -- the VAE -----------------------------------------------------------------------------------------------------
def vae_config(shapes: Shapes) -> dict:
    """``AutoencoderKLWan``'s config: Wan 2.1's VAE read as Qwen-Image's (the same VAE), the rest Wan's defaults."""
    read = qwenimage_files.vae_config(shapes)
    return {
        "_class_name": "AutoencoderKLWan",
        **{k: read[k] for k in ("base_dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales")},
        **{k: read[k] for k in ("temperal_downsample", "dropout", "latents_mean", "latents_std")},
        "in_channels": read["input_channels"],
        "out_channels": shapes["decoder.head.2.weight"][0],
    }


# -- the image encoder (Wan 2.1 I2V) ------------------------------------------------------------------------------
# What CLIP ViT-H/14's weights do not say (see the module's docstring): ComfyUI's clip_vision_config_h.json's values.
CLIP_HEADS = 16
CLIP_ACTIVATION = "gelu"
CLIP_EPS = 1e-5
# OpenAI CLIP's normalisation of the input (ComfyUI's clip_preprocess and laion/CLIP-ViT-H-14's processor).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# ComfyUI tells open_clip's layout by this key (comfy/clip_vision.py's ``load``).
OPEN_CLIP_KEY = "visual.transformer.resblocks.0.attn.in_proj_weight"
CLIP_PROJECTION = "visual_projection.weight"  # open_clip's ``visual.proj``, transposed
_OPEN_CLIP_NAMES = (
    ("class_embedding", "embeddings.class_embedding"),
    ("conv1.", "embeddings.patch_embedding."),
    ("positional_embedding", "embeddings.position_embedding.weight"),
    ("ln_pre.", "pre_layrnorm."),  # transformers' own spelling
    ("ln_post.", "post_layernorm."),
)
_OPEN_CLIP_LAYER_NAMES = (
    ("ln_1.", "layer_norm1."),
    ("ln_2.", "layer_norm2."),
    ("mlp.c_fc.", "mlp.fc1."),
    ("mlp.c_proj.", "mlp.fc2."),
    ("attn.out_proj.", "self_attn.out_proj."),
)
_QKV = ("q_proj", "k_proj", "v_proj")


def is_clip_vision(shapes: Shapes) -> bool:
    """A CLIP vision model in transformers' names or open_clip's (the two ComfyUI's CLIP vision loader reads)."""
    return "vision_model.embeddings.patch_embedding.weight" in shapes or OPEN_CLIP_KEY in shapes


def open_clip_sources(keys: Iterable[str]) -> dict[str, tuple[str, int | None]]:
    """Each transformers key made from open_clip's ``visual.*`` keys: its source, and which third (q, k, v) of a fused
    ``attn.in_proj_*`` it is, or None (``CLIP_PROJECTION`` is ``visual.proj`` transposed). What ComfyUI's
    ``convert_to_transformers`` renames; other keys (a whole CLIP's text tower) are left out, as ComfyUI leaves them."""
    out: dict[str, tuple[str, int | None]] = {}
    for key in keys:
        if not key.startswith("visual."):
            continue
        name = key.removeprefix("visual.")
        layer = re.fullmatch(r"transformer\.resblocks\.(\d+)\.(.+)", name)
        if name == "proj":
            out[CLIP_PROJECTION] = (key, None)
        elif layer is None:
            renamed = _renamed(name, _OPEN_CLIP_NAMES)
            if renamed is not None:
                out[f"vision_model.{renamed}"] = (key, None)
        elif layer[2].startswith("attn.in_proj_"):
            for third, projection in enumerate(_QKV):
                out[f"vision_model.encoder.layers.{layer[1]}.self_attn.{projection}.{layer[2][13:]}"] = (key, third)
        else:
            renamed = _renamed(layer[2], _OPEN_CLIP_LAYER_NAMES)
            if renamed is not None:
                out[f"vision_model.encoder.layers.{layer[1]}.{renamed}"] = (key, None)
    return out


def _renamed(name: str, names: tuple[tuple[str, str], ...]) -> str | None:
    return next((new + name[len(old) :] for old, new in names if name.startswith(old)), None)


def open_clip_to_transformers(sd: dict) -> dict:
    """An open_clip CLIP vision state dict in transformers' ``CLIPVisionModelWithProjection`` names."""
    out = {}
    for target, (source, third) in open_clip_sources(sd).items():
        tensor = sd[source]
        if third is not None:
            tensor = tensor.chunk(3, dim=0)[third]
        elif target == CLIP_PROJECTION:
            tensor = tensor.t()
        out[target] = tensor.contiguous()
    return out


def clip_vision_shapes(shapes: Shapes) -> Shapes:
    """The shapes in transformers' names, whichever of the two layouts the file has."""
    if OPEN_CLIP_KEY not in shapes:
        return shapes
    out = {}
    for target, (source, third) in open_clip_sources(shapes).items():
        shape = tuple(shapes[source])
        if third is not None:
            shape = (shape[0] // 3, *shape[1:])
        elif target == CLIP_PROJECTION:
            shape = shape[::-1]
        out[target] = shape
    return out


def clip_vision_config(shapes: Shapes) -> dict:
    """``CLIPVisionModelWithProjection``'s config from the shapes (transformers' names): the image's side is the
    patches' (the positions but the class token, a square) times the patch's."""
    width, channels, patch, _ = shapes["vision_model.embeddings.patch_embedding.weight"]
    positions = shapes["vision_model.embeddings.position_embedding.weight"][0]
    side = math.isqrt(positions - 1)
    if side * side != positions - 1 or width % CLIP_HEADS:
        raise ValueError(f"{positions} positions {width} wide, which is no CLIP ViT's")
    return {
        "architectures": ["CLIPVisionModelWithProjection"],
        "model_type": "clip_vision_model",
        "hidden_size": width,
        "intermediate_size": shapes["vision_model.encoder.layers.0.mlp.fc1.weight"][0],
        "num_hidden_layers": count(shapes, r"vision_model\.encoder\.layers\.(\d+)\."),
        "num_attention_heads": CLIP_HEADS,
        "num_channels": channels,
        "image_size": side * patch,
        "patch_size": patch,
        "projection_dim": shapes[CLIP_PROJECTION][0],
        "hidden_act": CLIP_ACTIVATION,
        "layer_norm_eps": CLIP_EPS,
    }


def write_image_processor(size: int, folder: str) -> None:
    """The ``image_processor`` folder: CLIP's preprocessing for an encoder of ``size`` pixels (the shorter side
    resized to it, bicubic, the centre cropped square, OpenAI's mean and std)."""
    from transformers import CLIPImageProcessor

    CLIPImageProcessor(
        size={"shortest_edge": size},
        crop_size={"height": size, "width": size},
        resample=3,  # PIL's bicubic
        image_mean=list(CLIP_MEAN),
        image_std=list(CLIP_STD),
    ).save_pretrained(folder)


# Wan 2.2's VAE (``wan2.2_vae.safetensors``, TI2V-5B's): its original layout's names → diffusers', for the names
# diffusers' own converter (scripts/convert_wan_to_diffusers.py's ``convert_vae_22``, not in the package) renames.
# A block's residual path, by the original's Sequential index:
_VAE22_RESIDUAL = {"residual.0": "norm1", "residual.2": "conv1", "residual.3": "norm2", "residual.6": "conv2"}
_VAE22_NAMES = {
    "conv1": "quant_conv",
    "conv2": "post_quant_conv",
    "encoder.conv1": "encoder.conv_in",
    "decoder.conv1": "decoder.conv_in",
    "encoder.head.0": "encoder.norm_out",
    "encoder.head.2": "encoder.conv_out",
    "decoder.head.0": "decoder.norm_out",
    "decoder.head.2": "decoder.conv_out",
}
# Wan 2.2's VAE's per-channel latent statistics (ComfyUI's latent_formats.Wan22, the same as diffusers' converter
# writes into Wan-AI/Wan2.2-TI2V-5B-Diffusers' vae config): not in the weights.
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.157, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.052, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.06, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip
# Wan 2.2 TI2V-5B's scheduler shift (Wan 2.2's ti2v_5B config's ``sample_shift``, as diffusers' converter sets it).
WAN22_TI2V_SHIFT = 5.0
TI2V_CHANNELS = 48  # TI2V-5B's transformer: the 48 latent channels of Wan 2.2's VAE, in and out


def is_vae22(shapes: Shapes) -> bool:
    """Wan 2.2's 48-channel VAE in its original layout (ComfyUI tells it by its nested upsamples)."""
    return "decoder.middle.0.residual.0.gamma" in shapes and qwenimage_files.WAN22_VAE_KEY in shapes


def vae22_config(shapes: Shapes) -> dict:
    """``AutoencoderKLWan``'s config for Wan 2.2's VAE: the widths, latent channels and residual blocks from the
    file's shapes; its 2 × 2 patches (12 channels of patchified pixels), 16× / 4× scale, residual blocks and latent
    statistics Wan 2.2's (``WAN22_LATENTS_MEAN`` / ``_STD``, from ComfyUI's ``latent_formats.Wan22``, which
    diffusers' converter also writes)."""
    base = shapes["encoder.conv1.weight"][0]
    levels = count(shapes, r"encoder\.downsamples\.(\d+)\.")
    blocks = count(shapes, r"encoder\.downsamples\.0\.downsamples\.(\d+)\.residual\.")
    return {
        "_class_name": "AutoencoderKLWan",
        "base_dim": base,
        "decoder_base_dim": shapes["decoder.head.0.gamma"][0],
        "z_dim": shapes["conv2.weight"][0],
        "dim_mult": [
            shapes[f"encoder.downsamples.{i}.downsamples.0.residual.2.weight"][0] // base for i in range(levels)
        ],
        "num_res_blocks": blocks,
        "attn_scales": [],
        "temperal_downsample": [False, True, True],
        "dropout": 0.0,
        "latents_mean": list(WAN22_LATENTS_MEAN),
        "latents_std": list(WAN22_LATENTS_STD),
        "is_residual": True,
        "in_channels": shapes["encoder.conv1.weight"][1],
        "out_channels": shapes["decoder.head.2.weight"][0],
        "patch_size": 2,
        "scale_factor_temporal": 4,
        "scale_factor_spatial": 16,
    }


def vae22_name(key: str) -> str:
    """One tensor's name in Wan 2.2's VAE: the original layout's → ``AutoencoderKLWan``'s (``is_residual``)."""
    module, _, part = key.rpartition(".")
    if module in _VAE22_NAMES:
        return f"{_VAE22_NAMES[module]}.{part}"
    side, _, rest = module.partition(".")
    if rest.startswith("middle."):
        _, index, inner = rest.split(".", 2)
        if index == "1":  # the attention between the middle's two residual blocks
            return f"{side}.mid_block.attentions.0.{inner}.{part}"
        return f"{side}.mid_block.resnets.{int(index) // 2}.{_residual(inner)}.{part}"
    down = "down" if side == "encoder" else "up"
    _, level, inner = rest.split(".", 2)  # {down}samples.{level}.{inner}
    _, index, inner = inner.split(".", 2)  # the level's own {down}samples.{index}.{inner}
    if inner.startswith(("resample", "time_conv")):  # the level's last: its down- or upsampler
        return f"{side}.{down}_blocks.{level}.{down}sampler.{inner}.{part}"
    return f"{side}.{down}_blocks.{level}.resnets.{index}.{_residual(inner)}.{part}"


def _residual(inner: str) -> str:
    return "conv_shortcut" if inner == "shortcut" else _VAE22_RESIDUAL[inner]


def wan22_vae_to_diffusers(checkpoint: dict) -> dict:
    """Wan 2.2's VAE in its original layout as ``AutoencoderKLWan``'s state dict (a rename, one to one)."""
    return {vae22_name(key): value for key, value in checkpoint.items()}


# -- the layout --------------------------------------------------------------------------------------------------
def model_index(i2v: bool, experts: bool, image_encoder: bool = False, ti2v: bool = False) -> dict:
    """model_index.json: WanPipeline, or WanImageToVideoPipeline with Wan 2.1 I2V's image encoder or without one (Wan
    2.2 A14B I2V reads the start image through its latents only); Wan 2.2 A14B with its second expert and their
    boundary; Wan 2.2 TI2V-5B a WanPipeline with ``expand_timesteps``."""
    index = {
        "_class_name": "WanImageToVideoPipeline" if i2v else "WanPipeline",
        "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"] if experts else [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "boundary_ratio": (WAN22_I2V_BOUNDARY if i2v else WAN22_T2V_BOUNDARY) if experts else None,
        "expand_timesteps": ti2v,
    }
    if i2v:
        index |= {"image_encoder": [None, None], "image_processor": [None, None]}
    if image_encoder:
        index |= {
            "image_encoder": ["transformers", "CLIPVisionModelWithProjection"],
            "image_processor": ["transformers", "CLIPImageProcessor"],
        }
    return index


class WanFiles(FilesLayout):
    """Wan 2.1 T2V (1.3B, 14B), Wan 2.1 I2V (14B), Wan 2.2 A14B (T2V, I2V; both experts) and Wan 2.2 TI2V-5B: the
    transformer (Wan 2.2's high-noise expert) in ``diffusion_model``, Wan 2.2's low-noise expert in
    ``diffusion_model_2``, UMT5-XXL in ``text_encoder``, Wan 2.1's VAE (TI2V-5B: Wan 2.2's), Wan 2.1 I2V's CLIP ViT-H in
    ``clip_vision``."""

    family = "wan"
    name = "Wan"
    text_encoder_widgets = ("text_encoder",)
    variants = (
        "Wan 2.1 T2V (1.3B, 14B), Wan 2.1 I2V (with its clip_vision), Wan 2.2 A14B (T2V and I2V, both experts) and "
        "Wan 2.2 TI2V-5B"
    )
    transformer_layout = "in Wan's original layout"
    widget_files: ClassVar[Mapping[str, str]] = {
        "diffusion_model": (
            "wan2.1_t2v_14B_bf16.safetensors, wan2.1_t2v_1.3B_fp16.safetensors or an fp8 one; for Wan 2.2 A14B its "
            "high-noise expert (wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors); or Wan 2.2 TI2V-5B's "
            "wan2.2_ti2v_5B_fp16.safetensors"
        ),
        "text_encoder": "UMT5-XXL (umt5_xxl_fp8_e4m3fn_scaled.safetensors, or umt5_xxl_fp16)",
        "vae": "wan_2.1_vae.safetensors (Wan 2.2 TI2V-5B: wan2.2_vae.safetensors)",
        "diffusion_model_2": "Wan 2.2 A14B's low-noise expert (wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors)",
        "clip_vision": "Wan 2.1 image-to-video: clip_vision_h.safetensors",
    }

    def variant(self, shapes: Shapes) -> str | None:
        if not is_transformer(shapes):
            return None
        for key, model in OTHER_MODELS:
            if key in shapes:
                raise InvalidInput(
                    "diffusion_model",
                    f"the file is {model}'s transformer, which this pack does not run; pick a Wan text-to-video or "
                    "Wan 2.2 A14B file, or use a diffusers folder",
                )
        in_channels = shapes["patch_embedding.weight"][1]
        if "img_emb.proj.0.weight" in shapes and in_channels == I2V_CHANNELS:
            return WAN21_I2V
        if in_channels == TI2V_CHANNELS:
            return "Wan TI2V"
        if in_channels not in (T2V_CHANNELS, I2V_CHANNELS):
            raise InvalidInput(
                "diffusion_model",
                f"the file's transformer takes {in_channels} latent channels, which no Wan this pack runs does "
                f"({T2V_CHANNELS}: text-to-video, {I2V_CHANNELS}: image-to-video, {TI2V_CHANNELS}: Wan 2.2 "
                "TI2V-5B); pick a Wan 2.1, Wan 2.2 A14B or TI2V-5B file",
            )
        return "Wan I2V" if in_channels == I2V_CHANNELS else "Wan T2V"

    def contents(
        self,
        variant: str,
        transformer: SourceHeader,
        text_encoders: list[SourceHeader],
        vae: SourceHeader,
        transformer_2: SourceHeader | None = None,
        clip_vision: SourceHeader | None = None,
    ) -> FilesContents:
        (encoder,) = text_encoders
        image = variant == WAN21_I2V
        i2v, ti2v = image or variant == "Wan I2V", variant == "Wan TI2V"
        _check_ti2v(ti2v, vae, transformer_2)
        self._image_encoder(image, transformer, transformer_2, clip_vision)
        experts = None if image else self._experts(i2v, transformer, transformer_2)
        if not is_umt5(encoder.shapes):
            what = "T5-XXL (FLUX.1's t5xxl)" if "shared.weight" in encoder.shapes else "not UMT5-XXL"
            raise InvalidInput(
                encoder.widget,
                f"{encoder.name!r} is {what}; Wan takes umt5_xxl_fp8_e4m3fn_scaled.safetensors (or umt5_xxl_fp16) "
                "from models/text_encoders",
            )
        if SPIECE_KEY not in encoder.shapes:
            raise InvalidInput(
                encoder.widget,
                f"{encoder.name!r} does not carry its tokenizer (ComfyUI's UMT5 files hold it as {SPIECE_KEY!r}); "
                "pick umt5_xxl_fp8_e4m3fn_scaled.safetensors as ComfyUI distributes it, or use a diffusers folder",
            )
        if not ti2v and qwenimage_files.WAN22_VAE_KEY in vae.shapes:
            raise InvalidInput(
                vae.widget,
                f"{vae.name!r} is Wan 2.2's 48-channel VAE (TI2V-5B's); Wan 2.1 and Wan 2.2 A14B use "
                "wan_2.1_vae.safetensors: pick that",
            )
        if not ti2v and not qwenimage_files.is_vae(vae.shapes):
            raise InvalidInput(
                vae.widget, f"{vae.name!r} is not a Wan VAE in its original layout; pick wan_2.1_vae.safetensors"
            )
        derivations = [
            ("transformer", transformer, transformer_config),
            ("text_encoder", encoder, umt5_config),
            ("vae", vae, vae22_config if ti2v else vae_config),
        ]
        if experts is not None:
            derivations.append(("transformer_2", experts, transformer_config))
        configs = configs_from_shapes(derivations, "Wan")
        if experts is not None and configs["transformer_2"] != configs["transformer"]:
            raise InvalidInput(
                experts.widget,
                f"{experts.name!r} is not the same model as {transformer.name!r} (its sizes differ); pick the "
                "low-noise expert of the same Wan 2.2 A14B",
            )
        model = configs["transformer"]
        if configs["text_encoder"]["d_model"] != model["text_dim"]:
            raise InvalidInput(
                encoder.widget,
                f"{encoder.name!r} is {configs['text_encoder']['d_model']} wide, but the transformer reads "
                f"{model['text_dim']}-wide text: pick UMT5-XXL (umt5_xxl_fp8_e4m3fn_scaled.safetensors)",
            )
        if image:
            image_config = configs_from_shapes(
                [("image_encoder", clip_vision, lambda shapes: clip_vision_config(clip_vision_shapes(shapes)))],
                "CLIP ViT-H",
            )["image_encoder"]
            if image_config["hidden_size"] != model["image_dim"]:
                raise InvalidInput(
                    "clip_vision",
                    f"{clip_vision.name!r} is {image_config['hidden_size']} wide, but the transformer reads "
                    f"{model['image_dim']}-wide image tokens: pick clip_vision_h.safetensors (CLIP ViT-H/14)",
                )
        if configs["vae"]["z_dim"] != model["out_channels"]:
            raise InvalidInput(
                vae.widget,
                f"{vae.name!r} has {configs['vae']['z_dim']} latent channels, but the transformer makes "
                f"{model['out_channels']}: pick wan_2.1_vae.safetensors",
            )
        moves = transformer_moves(model)
        for file in (transformer, experts):
            missing = sorted({m.source for m in moves} - set(file.shapes)) if file is not None else []
            if missing:
                raise InvalidInput(
                    file.widget, f"{file.name!r} lacks {missing[0]} (cut short, or not Wan); pick Wan's complete file"
                )
        width = HEAD_DIM * model["num_attention_heads"]
        size = SIZES.get(width, f"({model['num_layers']} layers, {width} wide)")
        if ti2v:
            named, shift = f"Wan 2.2 TI2V {size}", WAN22_TI2V_SHIFT
        elif experts is None:
            named, shift = f"Wan 2.1 {'I2V' if image else 'T2V'} {size}", WAN21_SHIFT
        else:
            named, shift = f"Wan 2.2 A14B {'I2V' if i2v else 'T2V'}", WAN22_I2V_SHIFT if i2v else WAN22_T2V_SHIFT
        components = [
            # Transformers' own names: linked as it is; the SentencePiece tensor rides along, unused by the model.
            Component("text_encoder", encoder, configs["text_encoder"], weights="model.safetensors"),
            Component("transformer", transformer, model, moves=tuple(moves)),
        ]
        if experts is not None:
            components.append(Component("transformer_2", experts, model, moves=tuple(moves)))
        vae_convert = wan22_vae_to_diffusers if ti2v else qwenimage_files.wan_vae_to_diffusers
        components.append(Component("vae", vae, configs["vae"], convert=vae_convert))
        folders = ()
        if image:
            # Transformers' names are linked as they are; open_clip's renamed (the model is small beside Wan's).
            convert = open_clip_to_transformers if OPEN_CLIP_KEY in clip_vision.shapes else None
            components.append(
                Component("image_encoder", clip_vision, image_config, convert=convert, weights="model.safetensors")
            )
            side = image_config["image_size"]
            folders = (FolderFromComfy("image_processor", lambda _, folder: write_image_processor(side, folder)),)
        return FilesContents(
            variant=named,
            model_index=model_index(i2v, experts is not None, image, ti2v),
            scheduler=scheduler(shift),
            tokenizers=(),
            components=tuple(components),
            text_encoders=(encoder,),
            tokenizers_from_files=(TokenizerFromFile("tokenizer", encoder, SPIECE_KEY, write_tokenizer),),
            folders=folders,
            family="wan_ti2v" if ti2v else None,
        )

    @staticmethod
    def _image_encoder(
        image: bool, transformer: SourceHeader, transformer_2: SourceHeader | None, clip_vision: SourceHeader | None
    ) -> None:
        """Wan 2.1 I2V takes its CLIP vision file and one transformer; every other Wan no CLIP vision file."""
        if not image:
            if clip_vision is not None:
                raise InvalidInput(
                    "clip_vision",
                    f"{transformer.name!r} reads no CLIP vision file (only Wan 2.1 I2V does); set clip_vision to none",
                )
            return
        if clip_vision is None:
            raise InvalidInput(
                "clip_vision",
                f"{transformer.name!r} is Wan 2.1 I2V's transformer, which also reads the start image through CLIP "
                "ViT-H: pick clip_vision_h.safetensors (from models/clip_vision) here",
            )
        if transformer_2 is not None:
            raise InvalidInput(
                "diffusion_model_2",
                "Wan 2.1 I2V runs one transformer, in diffusion_model; set diffusion_model_2 to none",
            )
        if not is_clip_vision(clip_vision.shapes):
            raise InvalidInput(
                "clip_vision",
                f"{clip_vision.name!r} is not a CLIP vision model (in transformers' or open_clip's names); pick "
                "clip_vision_h.safetensors",
            )

    @staticmethod
    def _experts(i2v: bool, transformer: SourceHeader, transformer_2: SourceHeader | None) -> SourceHeader | None:
        """Wan 2.2 A14B's low-noise expert, or None for Wan 2.1; refused where the files say otherwise (see the
        module's docstring for what the shapes cannot tell)."""
        first = _expert(transformer.name)
        if transformer_2 is None:
            if i2v or first is not None:
                raise InvalidInput(
                    "diffusion_model_2",
                    f"{transformer.name!r} is one of Wan 2.2 A14B's two experts, which run together: pick the "
                    "high-noise one in diffusion_model and the low-noise one "
                    f"(e.g. wan2.2_{'i2v' if i2v else 't2v'}_low_noise_14B_fp8_scaled.safetensors) here",
                )
            return None
        if not is_transformer(transformer_2.shapes):
            raise InvalidInput(
                transformer_2.widget,
                f"{transformer_2.name!r} is not a Wan transformer; pick Wan 2.2 A14B's low-noise expert, or none",
            )
        if first == LOW_NOISE or _expert(transformer_2.name) == HIGH_NOISE:
            raise InvalidInput(
                "diffusion_model",
                f"the experts are the wrong way round ({transformer.name!r} in diffusion_model, "
                f"{transformer_2.name!r} in diffusion_model_2): pick the high-noise expert in diffusion_model and "
                "the low-noise one in diffusion_model_2",
            )
        return transformer_2
