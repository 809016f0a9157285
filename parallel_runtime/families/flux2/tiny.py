"""FLUX.2's tiny builders: a random-weight Flux2Pipeline folder (``make_tiny_model``), the same kind of model written as
ComfyUI distributes FLUX.2-dev (``make_tiny_flux2_files``), and what its tiny LoRAs change and how BFL names those
layers.

The tiny pipeline: a Mistral3 text encoder of 30 layers (Flux2Pipeline stacks hidden states 10, 20 and 30), a Flux2
transformer with 4 heads, a 32-channel VAE whose batch-norm statistics are non-trivial (a forgotten normalisation
shows), tokenized by a PixtralProcessor whose whole-word tokens cover Flux2Pipeline's system message. ComfyUI's files:
the transformer and the VAE in Black Forest Labs' layouts, the text encoder cut as ComfyUI distributes it with its
tekken vocabulary inside, written from the diffusers model by the inverse of the documented key mapping.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PixtralImageProcessor,
    PixtralProcessor,
    PreTrainedTokenizerFast,
)

from ..flux.tiny import SCHEDULER_CONFIG
from ..tiny import (
    FORMATS,
    WORDS,
    count_blocks,
    ldm_vae,
    learn_bpe_merges,
    pre_tokenize,
    quantized,
    tagged_groups,
    write_formats,
)
from . import files as flux2_files

# The tiny FLUX.2 pipeline schedules as the tiny FLUX.1 does (SCHEDULER_CONFIG, FLUX.1-dev's): Flux2Pipeline computes
# the shift ``mu`` itself, the scheduler only needs dynamic shifting enabled to accept it.


# Mistral's special tokens as FLUX.2's chat template and PixtralProcessor use them.
_MISTRAL_SPECIAL_TOKENS = (
    "<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
    "[IMG_BREAK]", "[IMG_END]",
)  # fmt: skip


# The shape of Mistral's chat template for what Flux2Pipeline sends (a system message, then user text or images; the
# real one also handles tools and assistant turns): files.py holds it, for pipelines built from ComfyUI's files.
_MISTRAL_CHAT_TEMPLATE = flux2_files.CHAT_TEMPLATE


def _mistral_processor() -> PixtralProcessor:
    """FLUX.2's "tokenizer": a PixtralProcessor around a byte-level BPE tokenizer and a Mistral-style chat template.

    The tokenizer has whole-word tokens for Flux2Pipeline's system message, so a short `max_sequence_length` still
    leaves room for the prompt.
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    texts = [SYSTEM_MESSAGE, " ".join(WORDS), " " + " ".join(WORDS)]
    merges = learn_bpe_merges([list(word) for word in pre_tokenize(backend, texts)])
    tokens = list(_MISTRAL_SPECIAL_TOKENS) + sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in merges]
    backend.model = models.BPE(vocab={token: index for index, token in enumerate(dict.fromkeys(tokens))}, merges=merges)
    backend.add_special_tokens(list(_MISTRAL_SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    return PixtralProcessor(
        image_processor=PixtralImageProcessor(patch_size=16),
        tokenizer=tokenizer,
        patch_size=16,
        spatial_merge_size=2,
        chat_template=_MISTRAL_CHAT_TEMPLATE,
    )


def tiny_transformer(guidance_embeds: bool) -> Flux2Transformer2DModel:
    """The tiny pipelines' Flux2 transformer (random weights from torch's generator): 4 heads, text 48 wide (3 stacked
    hidden states of a 16-wide text encoder); FLUX.2-dev embeds its guidance, [klein] does not."""
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=128,  # 32 latent channels x 2x2 patchification
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=48,  # 3 stacked hidden states x 16
        timestep_guidance_channels=32,
        mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4),  # must sum to attention_head_dim
        guidance_embeds=guidance_embeds,
    )


def tiny_vae(
    block_out_channels: tuple[int, ...] = (8, 8, 16, 16), norm_num_groups: int = 4, sample_size: int = 64
) -> AutoencoderKLFlux2:
    """The tiny pipelines' 32-channel VAE (4 levels: a pipeline without its VAE assumes 8x), with random batch-norm
    statistics: FLUX.2 normalises latents with them (`vae.bn.running_mean / running_var`), and a fresh BatchNorm's
    mean 0 / var 1 would hide a forgotten normalisation."""
    vae = AutoencoderKLFlux2(
        block_out_channels=block_out_channels,
        layers_per_block=1,
        latent_channels=32,
        norm_num_groups=norm_num_groups,
        sample_size=sample_size,
        batch_norm_eps=flux2_files.VAE_BATCH_NORM_EPS,
        batch_norm_momentum=flux2_files.VAE_BATCH_NORM_MOMENTUM,
    )
    vae.bn.running_mean.copy_(0.5 * torch.randn_like(vae.bn.running_mean))
    vae.bn.running_var.copy_(0.5 + torch.rand_like(vae.bn.running_var))
    return vae


def files_transformer(guidance_embeds: bool) -> Flux2Transformer2DModel:
    """The transformer of the tiny ComfyUI files (random weights from torch's generator): what the files do not carry,
    the conversion takes from FLUX.2 itself, so it keeps those values (heads 128 wide, the rotary axes and theta, the
    norm epsilon); 2 heads, 16-wide text encoders' 3 stacked hidden states."""
    return Flux2Transformer2DModel(
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
        guidance_embeds=guidance_embeds,
    )


def files_vae() -> AutoencoderKLFlux2:
    """The VAE of the tiny ComfyUI files: FLUX.2's 32 norm groups (not in the weights) and batch-norm settings."""
    return tiny_vae((32, 32, 32, 32), flux2_files.VAE_NORM_GROUPS, 1024)


def make_tiny_model(out_dir: str, seed: int = 0) -> str:
    """Build a tiny FLUX.2 pipeline (Mistral3 + Flux2 transformer + 32-channel VAE with batch-norm) in `out_dir`."""
    processor = _mistral_processor()
    tokenizer = processor.tokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Mistral3ForConditionalGeneration(
            Mistral3Config(
                text_config={
                    "model_type": "mistral",
                    "vocab_size": len(tokenizer),
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    # Flux2Pipeline stacks hidden states 10, 20 and 30 (`text_encoder_out_layers`): 30 layers at least.
                    "num_hidden_layers": 30,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "head_dim": 8,
                    "max_position_embeddings": 2048,
                    "bos_token_id": tokenizer.bos_token_id,
                    "eos_token_id": tokenizer.eos_token_id,
                    "pad_token_id": tokenizer.pad_token_id,
                },
                vision_config={
                    "model_type": "pixtral",
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "image_size": 64,
                    "patch_size": 16,
                },
                image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
                spatial_merge_size=2,
            )
        )
        transformer = tiny_transformer(guidance_embeds=True)
        vae = tiny_vae()

    pipe = Flux2Pipeline(
        # Flux2Pipeline computes the shift `mu` itself (`compute_empirical_mu`); the scheduler only needs dynamic
        # shifting enabled to accept it.
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=processor,
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return os.fspath(out_dir)


# -- ComfyUI's files ---------------------------------------------------------------------------------------------------
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
    for i in range(count_blocks(sd, "transformer_blocks.")):
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
    for i in range(count_blocks(sd, "single_transformer_blocks.")):
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
    from transformers.integrations.mistral import convert_tekken_tokenizer

    if not formats or set(formats) - set(FORMATS):
        raise ValueError(f"formats must be some of {FORMATS}")
    tekken = tiny_tekken([SYSTEM_MESSAGE, " ".join(WORDS), " " + " ".join(WORDS)])
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
        transformer, vae = files_transformer(guidance_embeds=True), files_vae()
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
    text_encoders = {names["text_encoder"]: cut, WHOLE_MISTRAL: language}
    return write_files(models_dir, reference_root, "tiny-flux2-dev", pipe, names, text_encoders, weights, formats)


def write_files(
    models_dir: str,
    reference_root: str,
    stem: str,
    pipe: object,
    names: dict[str, str],
    text_encoders: dict[str, dict[str, torch.Tensor]],
    weights: dict[str, torch.Tensor],
    formats: tuple[str, ...],
) -> dict[str, tuple[dict[str, str], str]]:
    """A tiny FLUX.2-family pipeline ``pipe`` as ComfyUI's files under ``models_dir``: its text encoder files (by
    name), its VAE (``names["vae"]``) in flux2-vae.safetensors' layout, and its transformer's ``weights`` in BFL's
    layout in each of ``formats``, each with its reference folder (``write_formats``, which names the files after
    ``stem``)."""
    files = [("text_encoders", name, tensors) for name, tensors in text_encoders.items()]
    files.append(("vae", names["vae"], _bfl_flux2_vae(pipe.vae.state_dict(), 4)))
    for folder, name, tensors in files:
        os.makedirs(os.path.join(models_dir, folder), exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(models_dir, folder, name))
    groups = tagged_groups(weights, _bfl_flux2_transformer)
    return write_formats(
        models_dir,
        reference_root,
        stem,
        pipe,
        names,
        formats,
        lambda fmt: quantized(weights, fmt, groups, _bfl_flux2_transformer),
    )


# -- LoRAs -------------------------------------------------------------------------------------------------------------
# Layers the tiny LoRA changes by default: column- and row-sharded ones, packed ones, replicated ones (AdaLN,
# embedders) and the context-parallel gather layer (proj_out), so every way a strategy holds a weight is covered.
LORA_LAYERS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_out.0",
    "transformer_blocks.0.ff.linear_in",
    "transformer_blocks.0.ff_context.linear_out",
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
    "single_transformer_blocks.1.attn.to_out",
    "x_embedder",
    "proj_out",
)

# BFL's FLUX.2 layer names -> diffusers' layers (several: a fused BFL layer), for block 0..n of each kind.
_FLUX2_DOUBLE = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn.proj": ("attn.to_out.0",),
    "img_mlp.0": ("ff.linear_in",),
    "img_mlp.2": ("ff.linear_out",),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn.proj": ("attn.to_add_out",),
    "txt_mlp.0": ("ff_context.linear_in",),
    "txt_mlp.2": ("ff_context.linear_out",),
}
_FLUX2_SINGLE = {"linear1": ("attn.to_qkv_mlp_proj",), "linear2": ("attn.to_out",)}
_FLUX2_TOP = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
}

# The BFL LoRA layouts' names (``tiny.save_bfl_lora``): (double blocks, single blocks, the rest).
BFL_LORA_LAYERS = (_FLUX2_DOUBLE, _FLUX2_SINGLE, _FLUX2_TOP)
