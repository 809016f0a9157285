"""FLUX.1 as ComfyUI distributes it: the single files' key layouts and the diffusers configs they imply.

ComfyUI keeps FLUX.1 as four files: the transformer in Black Forest Labs' layout (``flux1-dev.safetensors`` in
``models/diffusion_models``: ``double_blocks.N.img_attn.qkv``, ``single_blocks.N.linear1``, ...), CLIP-L and T5-XXL
in transformers' own layouts (``clip_l.safetensors``, ``t5xxl_fp16.safetensors`` in ``models/text_encoders``) and the
VAE in the original (LDM) layout (``ae.safetensors`` in ``models/vae``).

Nothing here reads a tensor: the configs come from the files' shapes (the safetensors header), and the transformer's
conversion is a list of moves (which rows of which source tensor become which diffusers tensor) that
``comfy_files`` streams one source tensor at a time. The moves are keyed on the config, so they hold at every width;
diffusers' own converter (``convert_flux_transformer_checkpoint_to_diffusers``) hard-codes FLUX.1-dev's width 3072,
and tests/test_comfy_files.py checks these moves against it at that width.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

from ...errors import InvalidInput
from ..files import (
    Component,
    FilesContents,
    FilesLayout,
    Move,
    Shapes,
    SourceHeader,
    Tokenizer,
    configs_from_shapes,
    count,
)

# FLUX.1's rotary axes (diffusers' config, ComfyUI's ``axes_dim``): not in the weights; their sum is the head size.
AXES_DIMS_ROPE = (16, 56, 56)

# FLUX.1-dev's and -schnell's schedulers (their repositories' scheduler_config.json): dev shifts with the resolution,
# schnell (distilled for 1-4 steps) does not shift at all.
SCHEDULER_DEV = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
SCHEDULER_SCHNELL = {**SCHEDULER_DEV, "shift": 1.0, "use_dynamic_shifting": False}

# FLUX.1's VAE normalisation (not in ae.safetensors: the diffusers config of black-forest-labs/FLUX.1-dev).
VAE_SCALING_FACTOR = 0.3611
VAE_SHIFT_FACTOR = 0.1159
# The group norms' group count of FLUX.1's VAE (not in ae.safetensors either; ComfyUI assumes it too).
VAE_NORM_GROUPS = 32


def is_transformer(shapes: Shapes) -> bool:
    return "double_blocks.0.img_attn.qkv.weight" in shapes and "vector_in.in_layer.weight" in shapes


def transformer_config(shapes: Shapes) -> dict:
    """``FluxTransformer2DModel``'s config from the BFL layout's shapes; ``guidance_embeds`` tells dev from schnell."""
    inner, in_channels = shapes["img_in.weight"]
    head_dim = shapes["double_blocks.0.img_attn.norm.query_norm.scale"][0]
    out_channels = shapes["final_layer.linear.weight"][0]
    return {
        "_class_name": "FluxTransformer2DModel",
        "patch_size": 1,
        "in_channels": in_channels,
        "out_channels": out_channels,
        "num_layers": count(shapes, r"double_blocks\.(\d+)\."),
        "num_single_layers": count(shapes, r"single_blocks\.(\d+)\."),
        "attention_head_dim": head_dim,
        "num_attention_heads": inner // head_dim,
        "joint_attention_dim": shapes["txt_in.weight"][1],
        "pooled_projection_dim": shapes["vector_in.in_layer.weight"][1],
        "guidance_embeds": "guidance_in.in_layer.weight" in shapes,
        "axes_dims_rope": list(AXES_DIMS_ROPE),
    }


def transformer_moves(config: dict, shapes: Shapes) -> list[Move]:
    """Every diffusers tensor of ``FluxTransformer2DModel`` and where it comes from."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    moves: list[Move] = []

    def linear(target: str, source: str, rows: tuple[int, int] | None = None) -> None:
        for part in ("weight", "bias"):
            moves.append(Move(f"{target}.{part}", f"{source}.{part}", rows))

    for target, source in (
        ("time_text_embed.timestep_embedder", "time_in"),
        ("time_text_embed.text_embedder", "vector_in"),
        *((("time_text_embed.guidance_embedder", "guidance_in"),) if config["guidance_embeds"] else ()),
    ):
        linear(f"{target}.linear_1", f"{source}.in_layer")
        linear(f"{target}.linear_2", f"{source}.out_layer")
    linear("context_embedder", "txt_in")
    linear("x_embedder", "img_in")
    thirds = [(0, inner), (inner, 2 * inner), (2 * inner, 3 * inner)]
    for i in range(config["num_layers"]):
        t, s = f"transformer_blocks.{i}", f"double_blocks.{i}"
        linear(f"{t}.norm1.linear", f"{s}.img_mod.lin")
        linear(f"{t}.norm1_context.linear", f"{s}.txt_mod.lin")
        for name, rows in zip(("to_q", "to_k", "to_v"), thirds):
            linear(f"{t}.attn.{name}", f"{s}.img_attn.qkv", rows)
        for name, rows in zip(("add_q_proj", "add_k_proj", "add_v_proj"), thirds):
            linear(f"{t}.attn.{name}", f"{s}.txt_attn.qkv", rows)
        for target, source in (
            ("norm_q", "img_attn.norm.query_norm"),
            ("norm_k", "img_attn.norm.key_norm"),
            ("norm_added_q", "txt_attn.norm.query_norm"),
            ("norm_added_k", "txt_attn.norm.key_norm"),
        ):
            moves.append(Move(f"{t}.attn.{target}.weight", f"{s}.{source}.scale"))
        linear(f"{t}.ff.net.0.proj", f"{s}.img_mlp.0")
        linear(f"{t}.ff.net.2", f"{s}.img_mlp.2")
        linear(f"{t}.ff_context.net.0.proj", f"{s}.txt_mlp.0")
        linear(f"{t}.ff_context.net.2", f"{s}.txt_mlp.2")
        linear(f"{t}.attn.to_out.0", f"{s}.img_attn.proj")
        linear(f"{t}.attn.to_add_out", f"{s}.txt_attn.proj")
    for i in range(config["num_single_layers"]):
        t, s = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        mlp = shapes[f"{s}.linear1.weight"][0] - 3 * inner  # the MLP's width: the rows after q, k and v
        linear(f"{t}.norm.linear", f"{s}.modulation.lin")
        for name, rows in zip(("to_q", "to_k", "to_v"), thirds):
            linear(f"{t}.attn.{name}", f"{s}.linear1", rows)
        linear(f"{t}.proj_mlp", f"{s}.linear1", (3 * inner, 3 * inner + mlp))
        moves.append(Move(f"{t}.attn.norm_q.weight", f"{s}.norm.query_norm.scale"))
        moves.append(Move(f"{t}.attn.norm_k.weight", f"{s}.norm.key_norm.scale"))
        linear(f"{t}.proj_out", f"{s}.linear2")
    linear("proj_out", "final_layer.linear")
    for part in ("weight", "bias"):
        moves.append(Move(f"norm_out.linear.{part}", f"final_layer.adaLN_modulation.1.{part}", swap_halves=True))
    return moves


# -- the text encoders -------------------------------------------------------------------------------------------
def is_clip(shapes: Shapes) -> bool:
    return "text_model.embeddings.token_embedding.weight" in shapes


def is_t5(shapes: Shapes) -> bool:
    return "shared.weight" in shapes and "encoder.block.0.layer.0.SelfAttention.q.weight" in shapes


def clip_config(shapes: Shapes) -> dict:
    """CLIP-L's text config (ComfyUI's ``sd1_clip_config.json`` holds the same) at the file's sizes. The head count is
    not in the weights: CLIP's heads are 64 wide (L: 12 of them, G: 20), as ComfyUI assumes too."""
    vocab, hidden = shapes["text_model.embeddings.token_embedding.weight"]
    return {
        "architectures": ["CLIPTextModel"],
        "model_type": "clip_text_model",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": shapes["text_model.encoder.layers.0.mlp.fc1.weight"][0],
        "num_hidden_layers": count(shapes, r"text_model\.encoder\.layers\.(\d+)\."),
        "num_attention_heads": max(1, hidden // 64),
        "max_position_embeddings": shapes["text_model.embeddings.position_embedding.weight"][0],
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-05,
        "projection_dim": shapes["text_projection.weight"][0] if "text_projection.weight" in shapes else hidden,
        "bos_token_id": 49406,
        "eos_token_id": 49407,
        "pad_token_id": 1,
        "attention_dropout": 0.0,
        "dropout": 0.0,
        "initializer_factor": 1.0,
        "initializer_range": 0.02,
    }


def t5_config(shapes: Shapes) -> dict:
    """T5 v1.1's encoder config (google/t5-v1_1-xxl, which FLUX.1 uses) at the file's sizes; the heads come from the
    relative attention bias, the head width from the query's rows."""
    vocab, d_model = shapes["shared.weight"]
    buckets, heads = shapes["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    return {
        "architectures": ["T5EncoderModel"],
        "model_type": "t5",
        "vocab_size": vocab,
        "d_model": d_model,
        "d_kv": shapes["encoder.block.0.layer.0.SelfAttention.q.weight"][0] // heads,
        "d_ff": shapes["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"][0],
        "num_layers": count(shapes, r"encoder\.block\.(\d+)\."),
        "num_decoder_layers": count(shapes, r"encoder\.block\.(\d+)\."),
        "num_heads": heads,
        "relative_attention_num_buckets": buckets,
        "relative_attention_max_distance": 128,
        "feed_forward_proj": "gated-gelu",
        "dense_act_fn": "gelu_new",
        "is_gated_act": True,
        "layer_norm_epsilon": 1e-06,
        "dropout_rate": 0.1,
        "initializer_factor": 1.0,
        "tie_word_embeddings": False,
        "is_encoder_decoder": True,
        "use_cache": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    }


# -- the VAE -----------------------------------------------------------------------------------------------------
def is_vae(shapes: Shapes) -> bool:
    return "decoder.conv_in.weight" in shapes and "encoder.conv_in.weight" in shapes


def vae_config(shapes: Shapes) -> dict:
    """``AutoencoderKL``'s config for FLUX.1's VAE at the file's sizes (no quant convs; ``VAE_NORM_GROUPS`` norm
    groups, as in ae.safetensors and diffusers' default)."""
    levels = count(shapes, r"encoder\.down\.(\d+)\.")
    channels = [shapes[f"encoder.down.{i}.block.0.conv1.weight"][0] for i in range(levels)]
    return {
        "_class_name": "AutoencoderKL",
        "in_channels": shapes["encoder.conv_in.weight"][1],
        "out_channels": shapes["decoder.conv_out.weight"][0],
        "latent_channels": shapes["decoder.conv_in.weight"][1],
        "block_out_channels": channels,
        "down_block_types": ["DownEncoderBlock2D"] * levels,
        "up_block_types": ["UpDecoderBlock2D"] * levels,
        "layers_per_block": count(shapes, r"encoder\.down\.0\.block\.(\d+)\."),
        "act_fn": "silu",
        "norm_num_groups": VAE_NORM_GROUPS,
        "sample_size": 1024,
        "scaling_factor": VAE_SCALING_FACTOR,
        "shift_factor": VAE_SHIFT_FACTOR,
        "use_quant_conv": "quant_conv.weight" in shapes,
        "use_post_quant_conv": "post_quant_conv.weight" in shapes,
        "mid_block_add_attention": "encoder.mid.attn_1.q.weight" in shapes,
        "force_upcast": True,
    }


def _ldm_vae(config: dict) -> Callable[[dict], dict]:
    def convert(checkpoint: dict) -> dict:
        from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

        return convert_ldm_vae_checkpoint(checkpoint, config)

    return convert


# -- the layout --------------------------------------------------------------------------------------------------
MODEL_INDEX = {
    "_class_name": "FluxPipeline",
    "_diffusers_version": "0.42.1",
    "feature_extractor": [None, None],
    "image_encoder": [None, None],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
# FLUX.1 Kontext [dev]: FLUX.1-dev's components under FluxKontextPipeline (its file is told by its name).
KONTEXT = "FLUX.1 Kontext [dev]"
KONTEXT_MODEL_INDEX = MODEL_INDEX | {"_class_name": "FluxKontextPipeline"}


class Flux1Files(FilesLayout):
    """FLUX.1-dev and -schnell: the BFL transformer, CLIP-L and T5-XXL (either widget each), the LDM-layout VAE; a
    FLUX.1-dev-shaped transformer whose file name says Kontext converts into a FLUX.1 Kontext [dev] folder."""

    family = "flux"
    name = "FLUX.1"
    text_encoder_widgets = ("text_encoder", "text_encoder_2")
    variants = "FLUX.1 (dev, schnell, and Kontext [dev] told by its file's name)"
    transformer_layout = "in Black Forest Labs' layout"
    gguf_architectures = ("flux",)
    widget_files: ClassVar[Mapping[str, str]] = {
        "diffusion_model": "flux1-dev.safetensors, flux1-schnell.safetensors",
        "text_encoder": "CLIP-L (clip_l.safetensors)",
        "text_encoder_2": "T5-XXL (t5xxl_fp16.safetensors, or an fp8 one)",
        "vae": "ae.safetensors",
    }

    def variant(self, shapes: Shapes) -> str | None:
        if not is_transformer(shapes):
            return None
        return "FLUX.1-dev" if "guidance_in.in_layer.weight" in shapes else "FLUX.1-schnell"

    def contents(
        self, variant: str, transformer: SourceHeader, text_encoders: list[SourceHeader], vae: SourceHeader
    ) -> FilesContents:
        # Kontext's file has FLUX.1-dev's keys and shapes: only its name tells it (as ComfyUI names it,
        # flux1-dev-kontext_*), and converted as FLUX.1-dev it would run text-to-image, ignoring the image it is for.
        kontext = "kontext" in transformer.name.lower()
        if kontext and variant != "FLUX.1-dev":
            raise InvalidInput(
                transformer.widget,
                f"{transformer.name!r} is named as FLUX.1 Kontext's, but has FLUX.1-schnell's shapes (no guidance "
                "embedding): pick ComfyUI's flux1-dev-kontext file, or rename this one if it is not Kontext",
            )
        clip = [f for f in text_encoders if is_clip(f.shapes)]
        t5 = [f for f in text_encoders if is_t5(f.shapes)]
        for f in text_encoders:
            if f not in clip and f not in t5:
                raise InvalidInput(
                    f.widget,
                    f"{f.name!r} is neither CLIP-L nor T5-XXL; FLUX.1 takes clip_l.safetensors and a t5xxl file "
                    "(t5xxl_fp16.safetensors, or an fp8 one) from models/text_encoders",
                )
        if len(clip) != 1 or len(t5) != 1:
            twice = "CLIP" if len(clip) != 1 else "T5"
            raise InvalidInput(
                "text_encoder_2",
                f"both text encoders are {twice} files; FLUX.1 takes one CLIP-L (clip_l.safetensors) and one T5-XXL "
                "(t5xxl_fp16.safetensors): pick one of each",
            )
        if not is_vae(vae.shapes):
            raise InvalidInput(
                vae.widget, f"{vae.name!r} is not a VAE in the original layout (FLUX.1's ae.safetensors); pick that"
            )
        configs = configs_from_shapes(
            (
                ("transformer", transformer, transformer_config),
                ("text_encoder", clip[0], clip_config),
                ("text_encoder_2", t5[0], t5_config),
                ("vae", vae, vae_config),
            ),
            "FLUX.1",
        )
        if configs["vae"]["latent_channels"] * 4 != configs["transformer"]["in_channels"]:
            raise InvalidInput(
                vae.widget,
                f"{vae.name!r} has {configs['vae']['latent_channels']} latent channels, but the transformer takes "
                f"{configs['transformer']['in_channels'] // 4}: pick the VAE of this model (FLUX.1: ae.safetensors)",
            )
        # What the files do not carry is FLUX.1's own; a file that does not fit it converted, then failed at denoise
        # or decode.
        head = configs["transformer"]["attention_head_dim"]
        if head != sum(AXES_DIMS_ROPE):
            raise InvalidInput(
                transformer.widget,
                f"{transformer.name!r} has attention heads {head} wide, but FLUX.1's rotary position axes "
                f"{AXES_DIMS_ROPE} (which the file does not carry) cover {sum(AXES_DIMS_ROPE)}: this is not FLUX.1's "
                "transformer; pick flux1-dev or flux1-schnell",
            )
        channels = configs["vae"]["block_out_channels"]
        if any(c % VAE_NORM_GROUPS for c in channels):
            raise InvalidInput(
                vae.widget,
                f"{vae.name!r} has {channels} channels, but FLUX.1's VAE normalises them in {VAE_NORM_GROUPS} groups "
                f"(which the file does not carry), so each must be a multiple of {VAE_NORM_GROUPS}: pick FLUX.1's VAE "
                "(ae.safetensors)",
            )
        if configs["text_encoder_2"]["d_model"] != configs["transformer"]["joint_attention_dim"]:
            raise InvalidInput(t5[0].widget, f"{t5[0].name!r} does not fit this transformer (its width differs)")
        if configs["text_encoder"]["hidden_size"] != configs["transformer"]["pooled_projection_dim"]:
            raise InvalidInput(clip[0].widget, f"{clip[0].name!r} does not fit this transformer (its width differs)")
        try:
            moves = transformer_moves(configs["transformer"], transformer.shapes)
        except KeyError as e:
            raise InvalidInput(
                transformer.widget, f"{transformer.name!r} lacks {e}; pick FLUX.1's complete file"
            ) from None
        missing = sorted({m.source for m in moves} - set(transformer.shapes))
        if missing:
            raise InvalidInput(
                transformer.widget,
                f"{transformer.name!r} lacks {missing[0]} (cut short, or not FLUX.1); pick FLUX.1's complete file",
            )
        return FilesContents(
            variant=KONTEXT if kontext else variant,
            family="flux_kontext" if kontext else None,
            model_index=KONTEXT_MODEL_INDEX if kontext else MODEL_INDEX,
            scheduler=SCHEDULER_DEV if variant == "FLUX.1-dev" else SCHEDULER_SCHNELL,
            tokenizers=(
                # ComfyUI's CLIP tokenizer says 8192 (it chunks prompts itself); FluxPipeline pads and cuts to CLIP's
                # positions.
                Tokenizer(
                    "tokenizer",
                    "sd1_tokenizer",
                    ("vocab.json", "merges.txt", "special_tokens_map.json", "tokenizer_config.json"),
                    configs["text_encoder"]["max_position_embeddings"],
                ),
                Tokenizer(
                    "tokenizer_2",
                    "text_encoders/t5_tokenizer",
                    ("tokenizer.json", "special_tokens_map.json", "tokenizer_config.json"),
                    512,
                ),
            ),
            components=(
                # ComfyUI keeps CLIP and T5 in transformers' own layouts: linked as they are.
                Component("text_encoder", clip[0], configs["text_encoder"], weights="model.safetensors"),
                Component("text_encoder_2", t5[0], configs["text_encoder_2"], weights="model.safetensors"),
                Component("transformer", transformer, configs["transformer"], moves=tuple(moves)),
                Component("vae", vae, configs["vae"], convert=_ldm_vae(configs["vae"])),
            ),
            text_encoders=(clip[0], t5[0]),
        )
