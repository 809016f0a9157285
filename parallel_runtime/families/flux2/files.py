"""FLUX.2 as ComfyUI distributes it: the single files' key layouts and the diffusers folder they make.

ComfyUI keeps FLUX.2-dev as three files:

- the transformer in Black Forest Labs' layout (``flux2_dev_bf16.safetensors``, ``flux2_dev_fp8mixed.safetensors`` in
  ``models/diffusion_models``: ``double_blocks.N.img_attn.qkv``, ``single_blocks.N.linear1``, the shared
  ``double_stream_modulation_img`` / ``single_stream_modulation``), no biases;
- Mistral Small 3.1's language model without its vision tower, in transformers' key names (``model.layers.N...``),
  cut after the 30th of its 40 layers — Flux2Pipeline reads hidden states 10, 20 and 30 only — and without the final
  norm (``mistral_3_small_flux2_bf16.safetensors`` / ``_fp8``, ``models/text_encoders``; ComfyUI also reads the whole
  40 layers), with its tokenizer's vocabulary (Mistral's ``tekken.json``) as a uint8 tensor ``tekken_model``;
- the 32-channel VAE in the original (LDM) layout with its latents' batch-norm statistics (``flux2-vae.safetensors``
  in ``models/vae``: ``encoder.down.N...``, ``bn.running_mean``).

The diffusers folder they make: the transformer moved tensor by tensor (``transformer_moves``, keyed on the config;
tests/test_comfy_files.py checks them against diffusers' own ``convert_flux2_transformer_checkpoint_to_diffusers`` at
FLUX.2-dev's widths); the VAE through diffusers' LDM converter, its batch-norm statistics kept; the text encoder as a
transformers ``MistralModel`` (the language model alone: Flux2Pipeline only calls it for hidden states, so neither a
vision tower nor the language head is made up), the file linked as it is; the tokenizer converted from the file's
tekken data by transformers' own ``convert_tekken_tokenizer``, in the PixtralProcessor Flux2Pipeline takes. Nothing
is downloaded.

One detail of the cut text encoder: transformers' last hidden state is the normalised one, so a 30-layer model's 30th
hidden state would be normalised where the 40-layer model's is not. The folder's model has one more layer, all
zeros — a layer whose output projections are zero adds nothing to its input — so its 30th hidden state is the
unnormalised one, exactly as the whole model's (its 31st, normalised, is never read). That layer costs 1/31 of the
text encoder's memory; ComfyUI gets the same by switching its final norm off.

FLUX.2 [klein]'s files (no guidance embedding, a Qwen3 text encoder) are its own layout: ``flux2_klein/files.py``.
"""

from __future__ import annotations

import json
import os
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
    TokenizerFromFile,
    configs_from_shapes,
    count,
)
from ..flux.files import is_vae

# FLUX.2's rotary axes (diffusers' config; ComfyUI's ``axes_dim``): not in the weights; their sum is the head size.
AXES_DIMS_ROPE = (32, 32, 32, 32)
ROPE_THETA = 2000
# The transformer's norm epsilon (Flux2Transformer2DModel's and ComfyUI's).
EPS = 1e-6

# FLUX.2-dev's scheduler (black-forest-labs/FLUX.2-dev's scheduler_config.json): Flux2Pipeline computes the shift
# ``mu`` itself (``compute_empirical_mu``), so it only needs dynamic shifting on.
SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}

# The VAE's batch-norm settings (AutoencoderKLFlux2's; the statistics themselves are in flux2-vae.safetensors) and its
# group norms, 32 groups as in every FLUX VAE (not in the weights).
VAE_BATCH_NORM_EPS = 1e-4
VAE_BATCH_NORM_MOMENTUM = 0.1
VAE_NORM_GROUPS = 32

# Mistral Small 3.1's language model (mistralai/Mistral-Small-3.1-24B-Instruct-2503's text_config; ComfyUI's
# ``Mistral3Small24BConfig``): what its weights do not say. Heads are 128 wide (the head count is the rows over this).
MISTRAL_HEAD_DIM = 128
MISTRAL_ROPE_THETA = 1_000_000_000.0
MISTRAL_RMS_NORM_EPS = 1e-5
MISTRAL_MAX_POSITIONS = 131072
# Flux2Pipeline's hidden states (``text_encoder_out_layers``): the text encoder needs more layers than the last.
HIDDEN_STATES_LAYERS = (10, 20, 30)

# Its tokenizer as Flux2Pipeline takes it (a PixtralProcessor): the image side as Mistral Small 3.1's (only images
# given to the text encoder use it, which this pack does not do), the chat template for what Flux2Pipeline sends (a
# system message, then the prompt; Mistral's whole template also handles tools and assistant turns), and left padding,
# as transformers' Llama tokenizer (which Mistral's converted tokenizers are) and ComfyUI's Mistral tokenizer pad.
# (The tiny FLUX.2 pipeline, tiny.py, uses the same template.)
PIXTRAL_PATCH_SIZE = 14
PIXTRAL_SPATIAL_MERGE_SIZE = 2
PIXTRAL_LONGEST_EDGE = 1540
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}[IMG]{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}[/INST]"
    "{% endif %}{% endfor %}"
)
TEKKEN_KEY = "tekken_model"

MODEL_INDEX = {
    "_class_name": "Flux2Pipeline",
    "_diffusers_version": "0.42.1",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    # The language model alone (see the module's docstring); Flux2Pipeline's annotation names the whole
    # Mistral3ForConditionalGeneration, so diffusers logs that it expected that type.
    "text_encoder": ["transformers", "MistralModel"],
    "tokenizer": ["transformers", "PixtralProcessor"],
    "transformer": ["diffusers", "Flux2Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLFlux2"],
}


# -- the transformer ---------------------------------------------------------------------------------------------
def is_transformer(shapes: Shapes) -> bool:
    return "double_stream_modulation_img.lin.weight" in shapes and "double_blocks.0.img_attn.qkv.weight" in shapes


def transformer_config(shapes: Shapes) -> dict:
    """``Flux2Transformer2DModel``'s config from the BFL layout's shapes."""
    inner, in_channels = shapes["img_in.weight"]
    head_dim = shapes["double_blocks.0.img_attn.norm.query_norm.scale"][0]
    if sum(AXES_DIMS_ROPE) != head_dim:
        raise ValueError(f"heads {head_dim} wide (FLUX.2's are {sum(AXES_DIMS_ROPE)})")
    return {
        "_class_name": "Flux2Transformer2DModel",
        "patch_size": 1,
        "in_channels": in_channels,
        "out_channels": shapes["final_layer.linear.weight"][0],
        "num_layers": count(shapes, r"double_blocks\.(\d+)\."),
        "num_single_layers": count(shapes, r"single_blocks\.(\d+)\."),
        "attention_head_dim": head_dim,
        "num_attention_heads": inner // head_dim,
        "joint_attention_dim": shapes["txt_in.weight"][1],
        "timestep_guidance_channels": shapes["time_in.in_layer.weight"][1],
        # The MLP's input projection is SwiGLU's gate and value: twice the hidden width.
        "mlp_ratio": shapes["double_blocks.0.img_mlp.0.weight"][0] / 2 / inner,
        "axes_dims_rope": list(AXES_DIMS_ROPE),
        "rope_theta": ROPE_THETA,
        "eps": EPS,
        "guidance_embeds": "guidance_in.in_layer.weight" in shapes,
    }


def transformer_moves(config: dict) -> list[Move]:
    """Every diffusers tensor of ``Flux2Transformer2DModel`` and where it comes from (FLUX.2 has no biases)."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    thirds = [(0, inner), (inner, 2 * inner), (2 * inner, 3 * inner)]
    moves = [
        Move("x_embedder.weight", "img_in.weight"),
        Move("context_embedder.weight", "txt_in.weight"),
        Move("time_guidance_embed.timestep_embedder.linear_1.weight", "time_in.in_layer.weight"),
        Move("time_guidance_embed.timestep_embedder.linear_2.weight", "time_in.out_layer.weight"),
    ]
    if config["guidance_embeds"]:
        moves += [
            Move("time_guidance_embed.guidance_embedder.linear_1.weight", "guidance_in.in_layer.weight"),
            Move("time_guidance_embed.guidance_embedder.linear_2.weight", "guidance_in.out_layer.weight"),
        ]
    for name in ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation"):
        moves.append(Move(f"{name}.linear.weight", f"{name}.lin.weight"))
    for i in range(config["num_layers"]):
        t, s = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for names, stream in ((("to_q", "to_k", "to_v"), "img"), (("add_q_proj", "add_k_proj", "add_v_proj"), "txt")):
            for name, rows in zip(names, thirds):
                moves.append(Move(f"{t}.attn.{name}.weight", f"{s}.{stream}_attn.qkv.weight", rows))
        for target, source in (
            ("attn.norm_q.weight", "img_attn.norm.query_norm.scale"),
            ("attn.norm_k.weight", "img_attn.norm.key_norm.scale"),
            ("attn.norm_added_q.weight", "txt_attn.norm.query_norm.scale"),
            ("attn.norm_added_k.weight", "txt_attn.norm.key_norm.scale"),
            ("attn.to_out.0.weight", "img_attn.proj.weight"),
            ("attn.to_add_out.weight", "txt_attn.proj.weight"),
            ("ff.linear_in.weight", "img_mlp.0.weight"),
            ("ff.linear_out.weight", "img_mlp.2.weight"),
            ("ff_context.linear_in.weight", "txt_mlp.0.weight"),
            ("ff_context.linear_out.weight", "txt_mlp.2.weight"),
        ):
            moves.append(Move(f"{t}.{target}", f"{s}.{source}"))
    for i in range(config["num_single_layers"]):
        t, s = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        # diffusers keeps the single blocks' fused projection (q, k, v and the MLP) as BFL has it.
        for target, source in (
            ("attn.to_qkv_mlp_proj.weight", "linear1.weight"),
            ("attn.to_out.weight", "linear2.weight"),
            ("attn.norm_q.weight", "norm.query_norm.scale"),
            ("attn.norm_k.weight", "norm.key_norm.scale"),
        ):
            moves.append(Move(f"{t}.{target}", f"{s}.{source}"))
    moves.append(Move("proj_out.weight", "final_layer.linear.weight"))
    moves.append(Move("norm_out.linear.weight", "final_layer.adaLN_modulation.1.weight", swap_halves=True))
    return moves


# -- the text encoder --------------------------------------------------------------------------------------------
def is_mistral(shapes: Shapes) -> bool:
    """Mistral's language model in transformers' names (Qwen3, FLUX.2 [klein]'s, has per-head q / k norms)."""
    return (
        "model.embed_tokens.weight" in shapes
        and "model.layers.0.post_attention_layernorm.weight" in shapes
        and "model.layers.0.self_attn.q_norm.weight" not in shapes
    )


def mistral_layers(shapes: Shapes) -> int:
    return count(shapes, r"model\.layers\.(\d+)\.")


def mistral_config(shapes: Shapes) -> dict:
    """``MistralModel``'s config at the file's sizes: its own layers, plus the one zero layer when the file stops
    where Flux2Pipeline's last hidden state is read (see the module's docstring)."""
    vocab, hidden = shapes["model.embed_tokens.weight"]
    layers = mistral_layers(shapes)
    return {
        "architectures": ["MistralModel"],
        "model_type": "mistral",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": shapes["model.layers.0.mlp.gate_proj.weight"][0],
        "num_hidden_layers": layers + (1 if layers == HIDDEN_STATES_LAYERS[-1] else 0),
        "num_attention_heads": shapes["model.layers.0.self_attn.q_proj.weight"][0] // MISTRAL_HEAD_DIM,
        "num_key_value_heads": shapes["model.layers.0.self_attn.k_proj.weight"][0] // MISTRAL_HEAD_DIM,
        "head_dim": MISTRAL_HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MISTRAL_MAX_POSITIONS,
        "rms_norm_eps": MISTRAL_RMS_NORM_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": MISTRAL_ROPE_THETA},
        "sliding_window": None,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 11,
    }


def mistral_filled(shapes: Shapes, config: dict) -> dict[str, tuple[tuple[int, ...], float]]:
    """What the folder's text encoder has and the file has not: the zero layer after a cut file's last, and a final
    norm (ones; transformers applies it only to the last hidden state, which Flux2Pipeline never reads)."""
    filled: dict[str, tuple[tuple[int, ...], float]] = {}
    layers = mistral_layers(shapes)
    for i in range(layers, config["num_hidden_layers"]):
        for key, value in shapes.items():
            if key.startswith("model.layers.0."):
                filled[f"model.layers.{i}." + key.removeprefix("model.layers.0.")] = (tuple(value), 0.0)
    if "model.norm.weight" not in shapes:
        filled["model.norm.weight"] = ((config["hidden_size"],), 1.0)
    return filled


def write_tokenizer(tekken: bytes, folder: str) -> None:
    """The PixtralProcessor Flux2Pipeline takes, made from the text-encoder file's tekken vocabulary by transformers'
    own converter (``convert_tekken_tokenizer``). ValueError when the data is not a tekken vocabulary."""
    import tempfile

    from transformers import PixtralImageProcessor, PixtralProcessor
    from transformers.integrations.mistral import convert_tekken_tokenizer

    vocab = json.loads(tekken)  # ValueError when it is not JSON
    if not isinstance(vocab, dict) or not {"config", "vocab", "special_tokens"} <= set(vocab):
        raise ValueError("not a tekken vocabulary (config, vocab, special_tokens)")
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "tekken.json")
        with open(path, "wb") as f:
            f.write(tekken)
        tokenizer = convert_tekken_tokenizer(path, chat_template=CHAT_TEMPLATE)
    tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"  # init_kwargs: what is saved
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(
            patch_size=PIXTRAL_PATCH_SIZE, size={"longest_edge": PIXTRAL_LONGEST_EDGE}
        ),
        tokenizer=tokenizer,
        patch_size=PIXTRAL_PATCH_SIZE,
        spatial_merge_size=PIXTRAL_SPATIAL_MERGE_SIZE,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(folder)


# -- the VAE -----------------------------------------------------------------------------------------------------
def vae_config(shapes: Shapes) -> dict:
    """``AutoencoderKLFlux2``'s config at the file's sizes."""
    levels = count(shapes, r"encoder\.down\.(\d+)\.")
    channels = [shapes[f"encoder.down.{i}.block.0.conv1.weight"][0] for i in range(levels)]
    up = count(shapes, r"decoder\.up\.(\d+)\.")
    # LDM counts the decoder's levels from the latent end; diffusers from the image end, as the encoder's.
    decoder = [shapes[f"decoder.up.{up - 1 - i}.block.0.conv1.weight"][0] for i in range(up)][::-1]
    return {
        "_class_name": "AutoencoderKLFlux2",
        "in_channels": shapes["encoder.conv_in.weight"][1],
        "out_channels": shapes["decoder.conv_out.weight"][0],
        "latent_channels": shapes["decoder.conv_in.weight"][1],
        "block_out_channels": channels,
        "decoder_block_out_channels": None if decoder == channels else decoder,
        "down_block_types": ["DownEncoderBlock2D"] * levels,
        "up_block_types": ["UpDecoderBlock2D"] * up,
        "layers_per_block": count(shapes, r"encoder\.down\.0\.block\.(\d+)\."),
        "act_fn": "silu",
        "norm_num_groups": VAE_NORM_GROUPS,
        "sample_size": 1024,
        "use_quant_conv": any(k in shapes for k in ("quant_conv.weight", "encoder.quant_conv.weight")),
        "use_post_quant_conv": any(k in shapes for k in ("post_quant_conv.weight", "decoder.post_quant_conv.weight")),
        "mid_block_add_attention": "encoder.mid.attn_1.q.weight" in shapes,
        "batch_norm_eps": VAE_BATCH_NORM_EPS,
        "batch_norm_momentum": VAE_BATCH_NORM_MOMENTUM,
        "patch_size": [2, 2],
    }


def vae_converter(config: dict) -> Callable[[dict], dict]:
    """FLUX.2's VAE file (BFL's LDM layout, batch-norm statistics) → ``AutoencoderKLFlux2``'s state dict."""

    def convert(checkpoint: dict) -> dict:
        from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

        # BFL keeps the quant convs inside the encoder / decoder; diffusers' LDM converter reads them at the top.
        moved = {
            {"encoder.quant_conv.weight": "quant_conv.weight", "encoder.quant_conv.bias": "quant_conv.bias",
             "decoder.post_quant_conv.weight": "post_quant_conv.weight",
             "decoder.post_quant_conv.bias": "post_quant_conv.bias"}.get(k, k): v
            for k, v in checkpoint.items()
        }  # fmt: skip
        converted = convert_ldm_vae_checkpoint(moved, config)
        # The latents' batch-norm statistics, which the LDM converter does not know.
        for key in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
            if key in checkpoint:
                converted[key] = checkpoint[key]
        return converted

    return convert


# -- the layout --------------------------------------------------------------------------------------------------
def checked_configs(
    model: str,
    transformer: SourceHeader,
    text_encoder: SourceHeader,
    text_encoder_config: Callable[[Shapes], dict],
    vae: SourceHeader,
    pick_text_encoder: str,
) -> tuple[dict[str, dict], list[Move]]:
    """The configs of a FLUX.2 transformer (FLUX.2-dev's or [klein]'s), its text encoder (``text_encoder_config``)
    and FLUX.2's VAE from the files' shapes, and the transformer's moves, after the checks they share: the VAE is
    FLUX.2's and its latents the transformer's, the text encoder's stacked hidden states are as wide as the
    transformer's text input (else ``pick_text_encoder`` is the fix), the transformer file holds every tensor moved."""
    if not is_vae(vae.shapes) or "bn.running_mean" not in vae.shapes:
        raise InvalidInput(
            vae.widget,
            f"{vae.name!r} is not FLUX.2's VAE (the original layout with batch-norm statistics, "
            "flux2-vae.safetensors); pick that",
        )
    configs = configs_from_shapes(
        (
            ("transformer", transformer, transformer_config),
            ("text_encoder", text_encoder, text_encoder_config),
            ("vae", vae, vae_config),
        ),
        model,
    )
    if configs["vae"]["latent_channels"] * 4 != configs["transformer"]["in_channels"]:
        raise InvalidInput(
            vae.widget,
            f"{vae.name!r} has {configs['vae']['latent_channels']} latent channels, but the transformer takes "
            f"{configs['transformer']['in_channels'] // 4}: pick FLUX.2's VAE (flux2-vae.safetensors)",
        )
    stacked = 3 * configs["text_encoder"]["hidden_size"]  # the pipelines stack three hidden states
    if stacked != configs["transformer"]["joint_attention_dim"]:
        raise InvalidInput(
            text_encoder.widget,
            f"{text_encoder.name!r} does not fit this transformer (3 of its hidden states are {stacked} wide, the "
            f"transformer takes {configs['transformer']['joint_attention_dim']}); {pick_text_encoder}",
        )
    moves = transformer_moves(configs["transformer"])
    missing = sorted({m.source for m in moves} - set(transformer.shapes))
    if missing:
        raise InvalidInput(
            transformer.widget,
            f"{transformer.name!r} lacks {missing[0]} (cut short, or not {model}'s); pick {model}'s complete file",
        )
    return configs, moves


class Flux2Files(FilesLayout):
    """FLUX.2-dev: the BFL transformer, Mistral Small 3.1's language model (``text_encoder``), the 32-channel VAE."""

    family = "flux2"
    name = "FLUX.2"
    text_encoder_widgets = ("text_encoder",)
    variants = "FLUX.2-dev"
    transformer_layout = "in Black Forest Labs' layout"
    gguf_architectures = ("flux", "flux2")
    widget_files: ClassVar[Mapping[str, str]] = {
        "diffusion_model": "flux2_dev_bf16.safetensors",
        "text_encoder": "Mistral (mistral_3_small_flux2_bf16.safetensors, or its fp8 version)",
        "vae": "flux2-vae.safetensors",
    }

    def variant(self, shapes: Shapes) -> str | None:
        if not is_transformer(shapes):
            return None
        # FLUX.2-dev is guidance-distilled (an embedding of the guidance scale); [klein] has no guidance embedding
        # (flux2_klein/files.py takes it).
        return "FLUX.2-dev" if "guidance_in.in_layer.weight" in shapes else None

    def contents(
        self, variant: str, transformer: SourceHeader, text_encoders: list[SourceHeader], vae: SourceHeader
    ) -> FilesContents:
        (text_encoder,) = text_encoders
        if not is_mistral(text_encoder.shapes):
            qwen = "model.layers.0.self_attn.q_norm.weight" in text_encoder.shapes
            raise InvalidInput(
                text_encoder.widget,
                f"{text_encoder.name!r} is "
                + ("a Qwen3 text encoder (FLUX.2 [klein]'s)" if qwen else "not Mistral Small 3.1's language model")
                + "; FLUX.2-dev takes mistral_3_small_flux2_bf16.safetensors (or its fp8 version) from "
                "models/text_encoders",
            )
        layers = mistral_layers(text_encoder.shapes)
        if layers < HIDDEN_STATES_LAYERS[-1]:
            raise InvalidInput(
                text_encoder.widget,
                f"{text_encoder.name!r} has {layers} layers, but FLUX.2 reads the hidden state after layer "
                f"{HIDDEN_STATES_LAYERS[-1]}; pick mistral_3_small_flux2_bf16.safetensors (30 or 40 layers)",
            )
        if TEKKEN_KEY not in text_encoder.shapes:
            raise InvalidInput(
                text_encoder.widget,
                f"{text_encoder.name!r} does not carry its tokenizer (ComfyUI's FLUX.2 text encoder files hold it as "
                f"{TEKKEN_KEY!r}); pick mistral_3_small_flux2_bf16.safetensors as ComfyUI distributes it, or use a "
                "diffusers folder of FLUX.2-dev",
            )
        configs, moves = checked_configs(
            "FLUX.2", transformer, text_encoder, mistral_config, vae, "pick FLUX.2-dev's Mistral file"
        )
        return FilesContents(
            variant=variant,
            model_index=MODEL_INDEX,
            scheduler=SCHEDULER,
            tokenizers=(),
            components=(
                # Linked as it is (transformers' own names); the tekken tensor rides along, unused by the model.
                Component(
                    "text_encoder",
                    text_encoder,
                    configs["text_encoder"],
                    weights="model.safetensors",
                    filled=mistral_filled(text_encoder.shapes, configs["text_encoder"]),
                ),
                Component("transformer", transformer, configs["transformer"], moves=tuple(moves)),
                Component("vae", vae, configs["vae"], convert=vae_converter(configs["vae"])),
            ),
            text_encoders=(text_encoder,),
            tokenizers_from_files=(TokenizerFromFile("tokenizer", text_encoder, TEKKEN_KEY, write_tokenizer),),
        )
