"""Qwen-Image as ComfyUI distributes it: the single files' key layouts and the diffusers configs they imply.

ComfyUI keeps Qwen-Image as three files:

- the transformer (``qwen_image_bf16.safetensors``, ``qwen_image_fp8_e4m3fn.safetensors``, ... in
  ``models/diffusion_models``) in diffusers' own key names, sometimes behind ComfyUI's ``model.diffusion_model.``
  prefix: diffusers' single-file loader maps it as it is (``QwenImageTransformer2DModel``'s ``checkpoint_mapping_fn``
  is the identity), so the conversion keeps its tensors — a link when nothing changes;
- the text encoder, Qwen2.5-VL-7B (``qwen_2.5_vl_7b.safetensors`` / ``..._fp8_scaled`` in ``models/text_encoders``),
  in the layout the Qwen2.5-VL checkpoints were published in (``model.layers.N``, ``model.embed_tokens``,
  ``visual.blocks.N``, and ``lm_head`` when the file keeps it). transformers reads that layout itself: its
  ``Qwen2_5_VLForConditionalGeneration`` renames ``visual`` to ``model.visual`` and ``model.X`` to
  ``model.language_model.X`` on load (transformers 5's conversion mapping; 4.52+'s ``_checkpoint_conversion_mapping``;
  4.51's own layout), as it does for Qwen/Qwen-Image's diffusers folder, so this file is linked too. The vision tower
  comes with the file (ComfyUI's Qwen-Image-Edit uses it); text-to-image never runs it. A file without ``lm_head``
  (ComfyUI does not use it) gets ``tie_word_embeddings`` so transformers ties it to the embeddings instead of drawing
  a random 3584 × 152064 matrix: its logits are never read, only the hidden states;
- the VAE (``qwen_image_vae.safetensors`` in ``models/vae``), Wan 2.1's video VAE in its original layout
  (``encoder.downsamples.N.residual``, ``decoder.upsamples.N``, ``head``), through diffusers' own
  ``convert_wan_vae_to_diffusers`` into ``AutoencoderKLQwenImage``'s keys (the same as ``AutoencoderKLWan``'s). That
  converter groups the decoder's blocks for Wan 2.1's shape (four levels, two residual blocks each), which ComfyUI
  assumes too; other shapes are refused.

The tokenizer is ComfyUI's own copy (``comfy/text_encoders/qwen25_tokenizer``). What the weights do not carry is
Qwen-Image's published configuration, kept here as data: the transformer's 128-wide heads and rotary axes (16, 56,
56), Qwen2.5-VL-7B's non-shape values (128-wide heads, multimodal RoPE sections, special-token ids, the vision tower's
80-wide heads and windows), the VAE's latent statistics and the scheduler.

Qwen-Image-Edit-2511's and -2509's transformer files have Qwen-Image's keys and shapes: the same three files convert
into a Qwen-Image-Edit Plus folder (``edit_model`` tells them apart, by ComfyUI's flag or the name), which adds the
``processor`` the edit pipeline's text encoder sees the images through (``write_processor``) and 2511's
``zero_cond_t``.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from typing import ClassVar

from ...errors import InvalidInput
from ..files import (
    Component,
    FilesContents,
    FilesLayout,
    FolderFromComfy,
    Shapes,
    SourceHeader,
    Tokenizer,
    configs_from_shapes,
    count,
)

# Qwen/Qwen-Image's scheduler/scheduler_config.json: dynamic shifting over a long reference sequence, to a terminal
# sigma.
SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "stochastic_sampling": False,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

# The transformer: heads 128 wide, the rotary axes (frame, height, width) summing to that.
HEAD_DIM = 128
AXES_DIMS_ROPE = (16, 56, 56)

# Qwen-Image's VAE (Wan 2.1's): per-channel latent statistics (Qwen/Qwen-Image vae/config.json) and its fixed shape.
LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip
VAE_DIM_MULT = (1, 2, 4, 4)
VAE_RES_BLOCKS = 2

# Qwen2.5-VL-7B-Instruct's values the weights do not carry (its config.json, which Qwen/Qwen-Image's text_encoder
# holds too).
TEXT_HEAD_DIM = 128
MROPE_SECTION = (16, 24, 24)  # (temporal, height, width) halves of a head
VISION_HEAD_DIM = 80
TEXT_ENCODER_VALUES = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": list(MROPE_SECTION)},
    "sliding_window": 32768,
    "use_sliding_window": False,
    "use_cache": True,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "torch_dtype": "bfloat16",
}
VISION_VALUES = {
    "hidden_act": "silu",
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "tokens_per_second": 2,
    "initializer_range": 0.02,
}
TOKENIZER = Tokenizer(
    "tokenizer", "text_encoders/qwen25_tokenizer", ("vocab.json", "merges.txt", "tokenizer_config.json")
)

MODEL_INDEX = {
    "_class_name": "QwenImagePipeline",
    "_diffusers_version": "0.42.1",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}
# Qwen-Image-Edit Plus (2509, 2511): the same components, and the processor through which its text encoder sees the
# images.
EDIT_MODEL_INDEX = MODEL_INDEX | {
    "_class_name": "QwenImageEditPlusPipeline",
    "processor": ["transformers", "Qwen2VLProcessor"],
}
# Qwen2.5-VL-7B-Instruct's preprocessor_config.json values the weights do not carry (its patch, merge and temporal
# sizes are the vision tower's, read from the file): the pixel bounds an image is resized within.
IMAGE_PIXELS = {"shortest_edge": 56 * 56, "longest_edge": 12845056}


# -- the transformer ---------------------------------------------------------------------------------------------
def is_transformer(shapes: Shapes) -> bool:
    return "txt_norm.weight" in shapes and "transformer_blocks.0.img_mod.1.weight" in shapes


def transformer_config(shapes: Shapes) -> dict:
    """``QwenImageTransformer2DModel``'s config from the file's shapes (ComfyUI's model_detection reads the same)."""
    inner, in_channels = shapes["img_in.weight"]
    head_dim = shapes["transformer_blocks.0.attn.norm_q.weight"][0]
    patch = 2  # a 2x2 patch of 16 latent channels: img_in takes 64
    if head_dim != HEAD_DIM:
        raise ValueError(f"heads {head_dim} wide (Qwen-Image's are {HEAD_DIM}, as its rotary axes need)")
    return {
        "_class_name": "QwenImageTransformer2DModel",
        "patch_size": patch,
        "in_channels": in_channels,
        "out_channels": shapes["proj_out.weight"][0] // (patch * patch),
        "num_layers": count(shapes, r"transformer_blocks\.(\d+)\."),
        "attention_head_dim": head_dim,
        "num_attention_heads": inner // head_dim,
        "joint_attention_dim": shapes["txt_in.weight"][1],
        "guidance_embeds": False,
        "axes_dims_rope": list(AXES_DIMS_ROPE),
    }


def transformer_keys(config: dict) -> list[str]:
    """Every tensor ``QwenImageTransformer2DModel`` loads (without guidance embeddings), by its diffusers key."""
    keys = ["txt_norm.weight"]
    linears = ["img_in", "txt_in", "proj_out", "norm_out.linear"]
    linears += [f"time_text_embed.timestep_embedder.linear_{i}" for i in (1, 2)]
    for i in range(config["num_layers"]):
        b = f"transformer_blocks.{i}"
        linears += [f"{b}.img_mod.1", f"{b}.txt_mod.1"]
        linears += [f"{b}.attn.{n}" for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")]
        linears += [f"{b}.attn.to_out.0", f"{b}.attn.to_add_out"]
        linears += [f"{b}.{m}.net.{n}" for m in ("img_mlp", "txt_mlp") for n in ("0.proj", "2")]
        keys += [f"{b}.attn.{n}.weight" for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")]
    return keys + [f"{linear}.{part}" for linear in linears for part in ("weight", "bias")]


# -- the text encoder --------------------------------------------------------------------------------------------
def is_text_encoder(shapes: Shapes) -> bool:
    """Qwen2.5-VL's language model in its published layout (its attention has biases; Llama's and Mistral's not)."""
    return "model.embed_tokens.weight" in shapes and "model.layers.0.self_attn.k_proj.bias" in shapes


def text_encoder_config(shapes: Shapes) -> dict:
    """Qwen2.5-VL's config (the published, flat layout transformers reads) at the file's sizes."""
    vocab, hidden = shapes["model.embed_tokens.weight"]
    heads = shapes["model.layers.0.self_attn.q_proj.weight"][0] // TEXT_HEAD_DIM
    if heads * TEXT_HEAD_DIM != hidden:
        raise ValueError(f"a width of {hidden} that is not {TEXT_HEAD_DIM}-wide heads (Qwen2.5-VL's)")
    layers = count(shapes, r"model\.layers\.(\d+)\.")
    vision_depth = count(shapes, r"visual\.blocks\.(\d+)\.")
    if vision_depth:
        vision_hidden, in_chans, temporal, patch, _ = shapes["visual.patch_embed.proj.weight"]
        merge = math.isqrt(shapes["visual.merger.mlp.0.weight"][1] // vision_hidden)
        vision = {
            "depth": vision_depth,
            "hidden_size": vision_hidden,
            "intermediate_size": shapes["visual.blocks.0.mlp.gate_proj.weight"][0],
            "num_heads": vision_hidden // VISION_HEAD_DIM,
            "in_chans": in_chans,
            "out_hidden_size": shapes["visual.merger.mlp.2.weight"][0],
            "patch_size": patch,
            "spatial_merge_size": merge,
            "temporal_patch_size": temporal,
        }
    else:
        # No vision tower in the file: an empty one (no blocks), so nothing 7B-sized is drawn at random for a tower
        # text-to-image never runs; what is left of it (patch embedding, merger) is small.
        vision = {"depth": 0, "hidden_size": VISION_HEAD_DIM, "num_heads": 1, "out_hidden_size": hidden}
    return {
        **TEXT_ENCODER_VALUES,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": shapes["model.layers.0.mlp.gate_proj.weight"][0],
        "num_hidden_layers": layers,
        "max_window_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": shapes["model.layers.0.self_attn.k_proj.weight"][0] // TEXT_HEAD_DIM,
        # Only the hidden states are read: without the file's lm_head, tie it to the embeddings (nothing random).
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "vision_config": {**VISION_VALUES, **vision},
    }


# -- the VAE -----------------------------------------------------------------------------------------------------
WAN22_VAE_KEY = "decoder.upsamples.0.upsamples.0.residual.2.weight"


def is_vae(shapes: Shapes) -> bool:
    """Wan 2.1's VAE in its original layout (ComfyUI tells it by the same key); Wan 2.2's has nested upsamples."""
    return "decoder.middle.0.residual.0.gamma" in shapes and WAN22_VAE_KEY not in shapes


def vae_config(shapes: Shapes) -> dict:
    """``AutoencoderKLQwenImage``'s config: the base width and latent channels from the file, the rest Wan 2.1's."""
    levels = len(VAE_DIM_MULT)
    downsamples = count(shapes, r"encoder\.downsamples\.(\d+)\.")
    upsamples = count(shapes, r"decoder\.upsamples\.(\d+)\.")
    # Each encoder level: its residual blocks, then a downsampling but the last; the decoder has one block more.
    if (downsamples, upsamples) != (levels * VAE_RES_BLOCKS + levels - 1, levels * (VAE_RES_BLOCKS + 1) + levels - 1):
        raise ValueError(
            f"{downsamples} encoder and {upsamples} decoder blocks (Wan 2.1's VAE has "
            f"{levels * VAE_RES_BLOCKS + levels - 1} and {levels * (VAE_RES_BLOCKS + 1) + levels - 1})"
        )
    return {
        "_class_name": "AutoencoderKLQwenImage",
        "base_dim": shapes["decoder.head.0.gamma"][0],
        "z_dim": shapes["decoder.conv1.weight"][1],
        "dim_mult": list(VAE_DIM_MULT),
        "num_res_blocks": VAE_RES_BLOCKS,
        "attn_scales": [],
        "temperal_downsample": [False, True, True],
        "dropout": 0.0,
        "input_channels": shapes["encoder.conv1.weight"][1],
        "latents_mean": list(LATENTS_MEAN),
        "latents_std": list(LATENTS_STD),
    }


def wan_vae_to_diffusers(checkpoint: dict) -> dict:
    """Wan 2.1's VAE in its original layout as diffusers' (diffusers' own converter; Wan's layout uses it too)."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    return convert_wan_vae_to_diffusers(checkpoint)


# -- the layout --------------------------------------------------------------------------------------------------
class QwenImageFiles(FilesLayout):
    """Qwen-Image: its transformer, Qwen2.5-VL-7B in ``text_encoder`` (``text_encoder_2`` left at "none"), the Wan 2.1
    VAE."""

    family = "qwenimage"
    name = "Qwen-Image"
    text_encoder_widgets = ("text_encoder",)
    variants = "Qwen-Image, Qwen-Image-Edit-2509 and -2511"
    transformer_layout = "in diffusers' layout"
    gguf_architectures = ("qwen_image",)
    widget_files: ClassVar[Mapping[str, str]] = {
        "diffusion_model": "qwen_image_bf16.safetensors",
        "text_encoder": "Qwen2.5-VL (qwen_2.5_vl_7b.safetensors, or its fp8 version)",
        "vae": "qwen_image_vae.safetensors",
    }

    def variant(self, shapes: Shapes) -> str | None:
        return "Qwen-Image" if is_transformer(shapes) else None

    def contents(
        self, variant: str, transformer: SourceHeader, text_encoders: list[SourceHeader], vae: SourceHeader
    ) -> FilesContents:
        edit = edit_model(transformer)
        (encoder,) = text_encoders
        if not is_text_encoder(encoder.shapes):
            raise InvalidInput(
                encoder.widget,
                f"{encoder.name!r} is {_what_encoder(encoder.shapes)}, not Qwen2.5-VL; Qwen-Image takes "
                "qwen_2.5_vl_7b.safetensors (or its fp8 version) from models/text_encoders",
            )
        if not is_vae(vae.shapes):
            raise InvalidInput(
                vae.widget,
                f"{vae.name!r} is {_what_vae(vae.shapes)}, not Qwen-Image's (Wan 2.1's) VAE; pick "
                "qwen_image_vae.safetensors from models/vae",
            )
        configs = configs_from_shapes(
            (
                ("transformer", transformer, transformer_config),
                ("text_encoder", encoder, text_encoder_config),
                ("vae", vae, vae_config),
            ),
            "Qwen-Image",
        )
        missing = [k for k in transformer_keys(configs["transformer"]) if k not in transformer.shapes]
        if missing:
            raise InvalidInput(
                transformer.widget,
                f"{transformer.name!r} lacks {missing[0]} (cut short, or not Qwen-Image); pick Qwen-Image's complete "
                "file",
            )
        if configs["text_encoder"]["hidden_size"] != configs["transformer"]["joint_attention_dim"]:
            raise InvalidInput(
                encoder.widget,
                f"{encoder.name!r} is {configs['text_encoder']['hidden_size']} wide, but the transformer reads "
                f"{configs['transformer']['joint_attention_dim']}-wide text: pick Qwen2.5-VL-7B "
                "(qwen_2.5_vl_7b.safetensors)",
            )
        if configs["vae"]["z_dim"] * 4 != configs["transformer"]["in_channels"]:
            raise InvalidInput(
                vae.widget,
                f"{vae.name!r} has {configs['vae']['z_dim']} latent channels, but the transformer takes "
                f"{configs['transformer']['in_channels'] // 4}: pick qwen_image_vae.safetensors",
            )
        folders = ()
        if edit is not None:
            if not configs["text_encoder"]["vision_config"]["depth"]:
                raise InvalidInput(
                    encoder.widget,
                    f"{encoder.name!r} has no vision tower (no visual.blocks weights), and {edit}'s text encoder sees "
                    "the images: pick ComfyUI's complete qwen_2.5_vl_7b.safetensors (or its fp8 version)",
                )
            variant = edit
            configs["transformer"]["zero_cond_t"] = edit == EDIT_2511
            vision = configs["text_encoder"]["vision_config"]
            folders = (FolderFromComfy("processor", functools.partial(write_processor, vision=vision)),)
        return FilesContents(
            variant=variant,
            family="qwenimage_edit" if edit is not None else None,
            folders=folders,
            model_index=MODEL_INDEX if edit is None else EDIT_MODEL_INDEX,
            scheduler=SCHEDULER,
            tokenizers=(TOKENIZER,),
            components=(
                Component("text_encoder", encoder, configs["text_encoder"], weights="model.safetensors"),
                # Already in diffusers' keys: linked, or rewritten only to drop a prefix or undo fp8.
                Component("transformer", transformer, configs["transformer"]),
                Component("vae", vae, configs["vae"], convert=wan_vae_to_diffusers),
            ),
            text_encoders=(encoder,),
        )


# The empty tensor ComfyUI's Qwen-Image-Edit-2511 files carry (ComfyUI reads it as that model's reference method,
# index_timestep_zero: diffusers' zero_cond_t).
EDIT_2511_FLAG = "__index_timestep_zero__"


EDIT_2511, EDIT_2509 = "Qwen-Image-Edit-2511", "Qwen-Image-Edit-2509"


def edit_model(transformer: SourceHeader) -> str | None:
    """Which Qwen-Image-Edit Plus ``transformer`` is, or None for Qwen-Image: its files have Qwen-Image's keys and
    shapes, so 2511's is told by ComfyUI's flag (or an edit name with 2511) and 2509's by its name alone; a name
    without "edit" is Qwen-Image's. The first Edit (one image, ``QwenImageEditPipeline``, which the pack does not run)
    is refused rather than run as text-to-image, without its image."""
    name = transformer.name.lower()
    if EDIT_2511_FLAG in transformer.shapes:
        return EDIT_2511
    if "edit" not in name:
        return None
    if "2511" in name:
        return EDIT_2511
    if "2509" in name:
        return EDIT_2509
    raise InvalidInput(
        transformer.widget,
        f"{transformer.name!r} is named as the first Qwen-Image-Edit's (neither 2509 nor 2511), which this pack does "
        "not run; its weights have Qwen-Image's shapes, so it would run as Qwen-Image, without its image. Pick "
        "qwen_image_edit_2509_*.safetensors or qwen_image_edit_2511_*.safetensors (a 2509 file is told by its name: "
        "keep 2509 in it)",
    )


def write_processor(comfy_dir: str, folder: str, vision: dict) -> None:
    """The ``processor`` folder Qwen-Image-Edit's pipeline reads, which ComfyUI's files do not carry, written as
    transformers' ``Qwen2VLProcessor`` saves it: ComfyUI's Qwen2.5 tokenizer (its vision tokens included) and
    Qwen2.5-VL's image processor at the vision tower's patch, merge and temporal sizes (``vision``, the text encoder's
    ``vision_config``) with the published pixel bounds; nothing downloaded."""
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    sizes = {
        "patch_size": vision["patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
    }
    tokenizer = Qwen2Tokenizer.from_pretrained(os.path.join(comfy_dir, *TOKENIZER.source.split("/")))
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=IMAGE_PIXELS, **sizes),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**sizes),
    )
    processor.save_pretrained(folder)


def _what_encoder(shapes: Shapes) -> str:
    if "text_model.embeddings.token_embedding.weight" in shapes:
        return "CLIP (FLUX.1's clip_l)"
    if "shared.weight" in shapes:
        return "T5 (FLUX.1's t5xxl)"
    if "model.layers.0.self_attn.k_proj.weight" in shapes:
        return "a language model without attention biases (Mistral or Llama: FLUX.2's or another model's)"
    return "not a text encoder this pack recognises"


def _what_vae(shapes: Shapes) -> str:
    if "decoder.conv_in.weight" in shapes and "encoder.conv_in.weight" in shapes:
        return "an image VAE in the original layout (FLUX.1's ae.safetensors or similar)"
    if WAN22_VAE_KEY in shapes:
        return "Wan 2.2's VAE"
    return "not a VAE this pack recognises"
