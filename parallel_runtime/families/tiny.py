"""What the families' tiny builders share (each family's own are in its folder's ``tiny.py``): tokenizers built from
in-memory vocabularies, the writers of ComfyUI's files in each storage format, and tiny random LoRAs.

Tests, examples, benchmarks and the CPU demo need complete models that load with the real pipeline classes, yet
nothing may come from the Hub, so the tiny builders construct every component from an explicit config. A family's
builders live with the family (``families/<key>/tiny.py``, found by the family's key) and import diffusers' models
at their import, so nothing imports them at ComfyUI's start-up: ``make_tiny_model`` and the tests do, when they build
one; the adapters never do.

Tiny LoRAs: a ``TinyLora`` holds, per layer of the transformer (diffusers' module names), the factors A [rank, in]
and B [out, rank] and an alpha: the layer's delta at strength s is ``s * alpha / rank * B @ A``, the PEFT convention.
It is saved in diffusers' layout with the family pipeline's own ``save_lora_weights``, in the BFL layouts that FLUX.1
and FLUX.2 share (kohya's ``lora_unet_…``, ComfyUI's ``diffusion_model.…``; the BFL layer names are each family's
table, ``BFL_LORA_LAYERS``), and in the family's own layouts (its ``tiny.py``). These are written from the original
models' own layer names (the inverse of the mapping diffusers documents for the base checkpoints), never with
diffusers' LoRA converters, so a test comparing a converted file with its diffusers twin is not circular. A BFL layer
that fuses several diffusers layers (q, k and v) is written block-diagonal (kohya: rank = the sum of the parts', so
the converter splits it exactly) or, for layouts whose converters copy lora_A to every part (xlabs, FLUX.2's
``diffusion_model.``), from a LoRA whose parts share A (``share_a``).
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, pre_tokenizers
from transformers import CLIPTokenizer, T5TokenizerFast

from . import family
from .lora import meta_transformer


def family_tiny(family_key: str) -> ModuleType:
    """The tiny builders of the family whose key this is: ``families/<key>/tiny.py``."""
    return importlib.import_module(f"{__package__}.{family(family_key).key}.tiny")


def make_tiny_model(family_key: str, out_dir: str, seed: int = 0, **options: object) -> str:
    """Build a tiny random-weight pipeline of the family offline into ``out_dir`` (a ``save_pretrained`` folder, which
    the family's real pipeline class loads); ``out_dir``. Deterministic for a seed; the caller's RNG is left alone.
    ``options``: the family builder's own (Wan's ``two_experts``)."""
    return family_tiny(family_key).make_tiny_model(out_dir, seed, **options)


# -- tokenizers ----------------------------------------------------------------------------------------------------
# Words that get whole-word tokens in the tiny tokenizers; anything else still tokenizes (per character or byte),
# so every prompt is accepted. Distinct prompts give distinct token ids, which is all the tests need.
WORDS = (
    "a", "an", "the", "of", "on", "in", "with", "and", "photo", "painting", "cat", "dog", "red", "blue",
    "green", "sky", "tree", "house", "city", "night", "sunset", "portrait", "landscape", "astronaut", "horse",
)  # fmt: skip


def learn_bpe_merges(words: list[list[str]]) -> list[tuple[str, str]]:
    """Byte-pair encoding learned on `words` (each a list of initial symbols): repeatedly merge the most frequent
    adjacent pair, ties broken by the pair itself, until every word is a single symbol.

    A hand-written learner because the `tokenizers` trainer numbers its vocabulary differently from run to run. With
    these merges every corpus word encodes to exactly one token, which keeps prompt templates at the token counts
    the pipelines expect.
    """
    counts = Counter(tuple(word) for word in words)
    merges = []
    while True:
        pairs = Counter()
        for symbols, count in counts.items():
            for pair in itertools.pairwise(symbols):
                pairs[pair] += count
        if not pairs:
            return merges
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        merged = Counter()
        for symbols, count in counts.items():
            out, i = [], 0
            while i < len(symbols):
                if symbols[i : i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] += count
        counts = merged


def pre_tokenize(backend: Tokenizer, texts: list[str]) -> list[str]:
    """The words a tokenizer's normalizer and pre-tokenizer cut `texts` into (byte-level symbols)."""
    normalize = backend.normalizer.normalize_str if backend.normalizer else (lambda text: text)
    return [word for text in texts for word, _ in backend.pre_tokenizer.pre_tokenize_str(normalize(text))]


def clip_tokenizer() -> CLIPTokenizer:
    """A byte-level BPE CLIP tokenizer with CLIP's special tokens and whole-word tokens for `WORDS`."""
    words = pre_tokenize(CLIPTokenizer().backend_tokenizer, [" ".join(WORDS)])
    # CLIP marks the end of a word on its last symbol.
    merges = learn_bpe_merges([list(word[:-1]) + [word[-1] + "</w>"] for word in words])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # CLIP's vocabulary layout: byte symbols, the same with the end-of-word suffix, merge results, special tokens.
    tokens = alphabet + [symbol + "</w>" for symbol in alphabet] + [a + b for a, b in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: index for index, token in enumerate(dict.fromkeys(tokens))}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def t5_tokenizer() -> T5TokenizerFast:
    """A Unigram T5 tokenizer: whole words score higher than their characters, so they win the segmentation."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + word, -3.0) for word in WORDS]
    pieces += [(chr(code), -5.0) for code in range(33, 127)]  # printable ASCII, spaces are the "▁" marker
    # No sentinel <extra_id_*> tokens: they only matter for T5's span-corruption pre-training.
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


# -- ComfyUI's files ----------------------------------------------------------------------------------------------
FORMATS = ("bf16", "fp8", "fp8_scaled")


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


def tagged_groups(
    sd: dict[str, torch.Tensor], layout: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
) -> dict[str, list[str]]:
    """Which diffusers tensors each file tensor is made of, read from the inverse mapping ``layout`` itself (each
    diffusers tensor tagged with its number)."""
    names = list(sd)
    # 1-D tags are enough: the mappings only concatenate and swap along dim 0.
    tagged = {k: torch.full(sd[k].shape[:1], float(i), dtype=torch.float64) for i, k in enumerate(names)}
    return {k: [names[int(i)] for i in torch.unique(v).tolist()] for k, v in layout(tagged).items()}


def count_blocks(sd: dict[str, torch.Tensor], prefix: str) -> int:
    return len({k[len(prefix) :].split(".")[0] for k in sd if k.startswith(prefix)})


def quantized(
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


def write_formats(
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


def write_text_encoder_formats(models_dir: str, name: str, formats: tuple[str, ...]) -> dict[str, str]:
    """The text encoder ``name`` of ``models_dir``'s ``text_encoders`` written again in each of ``formats`` ("fp8",
    "fp8_scaled"), as ComfyUI distributes the large ones (t5xxl_fp8_e4m3fn, qwen_2.5_vl_7b_fp8_scaled): every matrix in
    fp8 (a scaled file's with its ``scale_weight`` and the ``scaled_fp8`` marker), the rest bf16, tokenizer data (uint8)
    as it is. The new files' names, by format."""
    from safetensors.torch import load_file

    folder = os.path.join(models_dir, "text_encoders")
    source = load_file(os.path.join(folder, name))
    floats = {key: value for key, value in source.items() if value.is_floating_point()}
    written = {}
    for fmt in formats:
        file, _ = quantized(floats, fmt, {key: [key] for key in floats}, dict)
        file |= {key: value for key, value in source.items() if key not in floats}
        written[fmt] = f"{os.path.splitext(name)[0]}-{fmt}.safetensors"
        save_file({k: v.contiguous() for k, v in file.items()}, os.path.join(folder, written[fmt]))
    return written


# -- ComfyUI-GGUF's files ---------------------------------------------------------------------------------------------
GGUF_TYPES = ("Q8_0", "Q4_K")  # the tiny GGUF files' quantizations: a 32-value block type and a 256-value K-quant
# Q4_K: values a block packs, and its bytes (f16 d, f16 dmin, 12 bytes of scales and mins, 128 of 4-bit values)
_Q4_K_BLOCK, _Q4_K_BYTES = 256, 144


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """``x`` (float32, its last dimension a multiple of 256) packed as GGML's Q4_K, from the format's definition
    (llama.cpp's ``block_q4_K``; the gguf package dequantizes it but does not quantize it): each block of 256 values is
    8 sub-blocks of 32, each value ``d * scale_j * q - dmin * min_j`` with q in 0..15 and 6-bit scales and mins."""
    rows = np.asarray(x, dtype=np.float32).reshape(-1, 8, 32)
    low, high = np.minimum(rows.min(axis=2), 0.0), np.maximum(rows.max(axis=2), 0.0)
    scale, mins = (high - low) / 15.0, -low
    d, dmin = (scale.max(axis=1) / 63.0).astype(np.float16), (mins.max(axis=1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):  # an all-zero block has d = 0: its codes are 0
        sc = np.where(d32 > 0, np.rint(scale / d32), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin32 > 0, np.rint(mins / dmin32), 0).clip(0, 63).astype(np.uint8)
        step = (d32 * sc)[:, :, None]
        q = np.where(step > 0, np.rint((rows + (dmin32 * m)[:, :, None]) / step), 0).clip(0, 15).astype(np.uint8)
    scales = np.zeros((rows.shape[0], 12), dtype=np.uint8)  # the first 4 sub-blocks' 6 bits, the last 4's split 4 + 2
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    pairs = q.reshape(-1, 4, 2, 32)  # sub-blocks 2i and 2i + 1 share 32 bytes: low and high nibbles
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1)
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // _Q4_K_BLOCK * _Q4_K_BYTES)


def write_gguf(tensors: Mapping[str, torch.Tensor], path: str, architecture: str, qtype: str) -> str:
    """``tensors`` (a transformer file's, in its ComfyUI layout) as ComfyUI-GGUF writes them: the matrices whose rows
    fill whole blocks in ``qtype`` (one of ``GGUF_TYPES``), the rest (biases, norms, narrow matrices) in F32, and
    ``general.architecture`` naming the family."""
    import gguf
    from gguf import quants

    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    writer = gguf.GGUFWriter(path, architecture)
    for key, tensor in tensors.items():
        values = tensor.float().numpy()
        if values.ndim == 2 and values.shape[1] % block == 0:
            packed = quantize_q4_k(values) if qtype == "Q4_K" else quants.quantize(values, kind)
            writer.add_tensor(key, packed, raw_shape=packed.shape, raw_dtype=kind)
        else:
            writer.add_tensor(key, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_meaning(sd: Mapping[str, torch.Tensor], qtype: str) -> dict[str, torch.Tensor]:
    """What ``write_gguf`` makes of each tensor of ``sd``, in float32, as diffusers' GGUF layers compute with it (its
    dequantizer: half precision for the packed types, then the compute dtype). A block lies within one row, so this is
    also what the file means after a mapping that only concatenates, slices or swaps rows (BFL's fused layers): the
    reference a GGUF file's model must equal."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor
    from gguf import quants

    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    meaning = {}
    for key, tensor in sd.items():
        values = tensor.float()
        if values.ndim == 2 and values.shape[1] % block == 0:
            plain = values.numpy()
            packed = quantize_q4_k(plain) if qtype == "Q4_K" else quants.quantize(plain, kind)
            values = dequantize_gguf_tensor(GGUFParameter(torch.from_numpy(packed), quant_type=kind)).float()
        meaning[key] = values.contiguous()
    return meaning


def write_gguf_formats(
    models_dir: str,
    made: tuple[dict[str, str], str],
    architecture: str,
    layout: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    transformer_class: type,
    qtypes: tuple[str, ...] = GGUF_TYPES,
) -> dict[str, tuple[dict[str, str], str]]:
    """Beside a family's tiny ComfyUI files (``made``: the widgets' values and the reference diffusers folder of its
    bf16 transformer), that transformer as ComfyUI-GGUF files in ``qtypes`` (``layout``: diffusers' state dict in the
    file's layout) and for each a reference folder whose transformer holds what the file means (``gguf_meaning``):
    per type, the widgets' values and the reference folder."""
    names, reference = made
    sd = transformer_class.from_pretrained(reference, subfolder="transformer", dtype=torch.float32).state_dict()
    stem = os.path.splitext(names["diffusion_model"])[0].removesuffix("-bf16")
    out = {}
    for qtype in qtypes:
        name = f"{stem}-{qtype}.gguf"
        write_gguf(layout(sd), os.path.join(models_dir, "diffusion_models", name), architecture, qtype)
        folder = f"{reference.removesuffix('-bf16')}-{qtype}"
        shutil.copytree(reference, folder, ignore=shutil.ignore_patterns("transformer"))
        model = transformer_class.from_pretrained(reference, subfolder="transformer", dtype=torch.float32)
        model.load_state_dict(gguf_meaning(sd, qtype))
        model.save_pretrained(os.path.join(folder, "transformer"), safe_serialization=True)
        out[qtype] = ({**names, "diffusion_model": name}, folder)
    return out


# -- LoRAs --------------------------------------------------------------------------------------------------------
_SWAPPED = ("final_layer.adaLN_modulation.1",)  # BFL: (shift, scale); diffusers: (scale, shift)


@dataclasses.dataclass(frozen=True)
class TinyLora:
    """Per layer (diffusers' name): ``(A [rank, in], B [out, rank], alpha)``; ``biases``: bias changes of some of
    them (at strength 1, as ComfyUI adds a ``diff_b``)."""

    layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    biases: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def delta(self, module: str) -> torch.Tensor:
        """The layer's weight change at strength 1, in float32."""
        a, b, alpha = self.layers[module]
        return alpha / a.shape[0] * (b.double() @ a.double()).float()


def make_tiny_lora(
    model_dir: str | os.PathLike,
    family_key: str,
    *,
    layers: Iterable[str] | None = None,
    ranks: Mapping[str, int] | None = None,
    rank: int = 4,
    alpha: float | None = 3.0,
    seed: int = 0,
    size: float = 0.5,
    share_a: Iterable[Iterable[str]] = (),
) -> TinyLora:
    """A random LoRA for the tiny model in ``model_dir``: ``layers`` (default: the family's ``LORA_LAYERS``), each of
    ``rank`` (or its own in ``ranks``) and ``alpha`` (None: alpha = rank, scale 1). ``size`` sets how far the delta
    moves a layer relative to its typical weight. Layers in one group of ``share_a`` get the same A (their ranks must
    be equal)."""
    config = json.loads(open(os.path.join(model_dir, "transformer", "config.json")).read())
    skeleton = dict(meta_transformer(family(family_key), config).named_modules())
    generator = torch.Generator().manual_seed(seed)
    made = {}
    for module in layers or family_tiny(family_key).LORA_LAYERS:
        layer = skeleton[module]
        r = (ranks or {}).get(module, rank)
        a = torch.randn(r, layer.in_features, generator=generator) / layer.in_features**0.5
        b = size * torch.randn(layer.out_features, r, generator=generator) / r**0.5
        made[module] = (a, b, float(r if alpha is None else alpha))
    for group in share_a:
        group = list(group)
        first = made[group[0]][0]
        for module in group[1:]:
            _, b, alpha_ = made[module]
            if b.shape[1] != first.shape[0]:
                raise ValueError(f"{module} and {group[0]} share A, so their ranks must be equal")
            made[module] = (first.clone(), b, alpha_)
    return TinyLora(made)


def save_diffusers_lora(lora: TinyLora, path: str | os.PathLike, family_key: str) -> str:
    """Saved by the family's pipeline (``save_lora_weights``), ranks and alphas in its adapter metadata: the file
    ``pipe.load_lora_weights`` reads as the reference."""
    import diffusers

    pipeline = getattr(diffusers, family(family_key).pipeline)
    ranks = {module: a.shape[0] for module, (a, _, _) in lora.layers.items()}
    alphas = {module: alpha for module, (_, _, alpha) in lora.layers.items()}
    common_rank = max(set(ranks.values()), key=list(ranks.values()).count)
    common_alpha = max(set(alphas.values()), key=list(alphas.values()).count)
    metadata = {
        "r": common_rank,
        "lora_alpha": common_alpha,
        # "^name$"-anchored: PEFT matches pattern keys as name suffixes ("proj_out" would also match every block's)
        "rank_pattern": {f"^{m}$": r for m, r in ranks.items() if r != common_rank},
        "alpha_pattern": {f"^{m}$": a for m, a in alphas.items() if a != common_alpha},
        "target_modules": sorted(lora.layers),
        **({"lora_bias": True} if lora.biases else {}),  # else PEFT builds the adapter without them
    }
    tensors = {}
    for module, (a, b, alpha) in lora.layers.items():
        tensors[f"{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{module}.lora_B.weight"] = b.contiguous()
        if lora.biases:  # PEFT gives every layer a bias then (zero where none changes), scaled by alpha / rank
            bias = lora.biases.get(module, torch.zeros(b.shape[0]))
            tensors[f"{module}.lora_B.bias"] = (a.shape[0] / alpha * bias).contiguous()
    path = str(path)
    pipeline.save_lora_weights(
        os.path.dirname(path),
        transformer_lora_layers=tensors,
        weight_name=os.path.basename(path),
        transformer_lora_adapter_metadata=metadata,
    )
    return path


def _bfl_layers(family_key: str, config: dict) -> dict[str, tuple[str, ...]]:
    """BFL layer name -> the diffusers layers it fuses, for this model's block counts (the family's table)."""
    double, single, top = family_tiny(family_key).BFL_LORA_LAYERS
    names = {f"{bfl}": (diffusers,) for bfl, diffusers in top.items()}
    for i in range(config["num_layers"]):
        names |= {f"double_blocks.{i}.{k}": tuple(f"transformer_blocks.{i}.{p}" for p in v) for k, v in double.items()}
    for i in range(config["num_single_layers"]):
        names |= {
            f"single_blocks.{i}.{k}": tuple(f"single_transformer_blocks.{i}.{p}" for p in v) for k, v in single.items()
        }
    return names


def _swap_halves(b: torch.Tensor) -> torch.Tensor:
    first, second = b.chunk(2, dim=0)
    return torch.cat([second, first])


def fused(
    lora: TinyLora, bfl: str, parts: tuple[str, ...], *, block_diagonal: bool
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A, B, alpha) of one BFL layer from its diffusers parts (all of them in ``lora``)."""
    factors = [lora.layers[p] for p in parts]
    if len(parts) == 1:
        a, b, alpha = factors[0]
        return a, (_swap_halves(b) if bfl.endswith(_SWAPPED) else b), alpha
    scales = [alpha / a.shape[0] for a, _, alpha in factors]
    if block_diagonal:
        # rank = the parts' sum, alpha = rank (scale 1): each part's own scale goes into its block of B.
        a = torch.cat([f[0] for f in factors])
        b = torch.block_diag(*[s * f[1] for s, f in zip(scales, factors)])
        return a, b, float(a.shape[0])
    if any(not torch.equal(f[0], factors[0][0]) for f in factors):
        raise ValueError(f"{bfl}: this layout copies one lora_A to {parts}; build the LoRA with share_a")
    a = factors[0][0]
    return a, torch.cat([s * f[1] for s, f in zip(scales, factors)]) / scales[0], float(a.shape[0]) * scales[0]


def save_bfl_lora(
    lora: TinyLora, path: str | os.PathLike, model_dir: str | os.PathLike, family_key: str, *, layout: str
) -> str:
    """FLUX.1 / FLUX.2 in BFL's layer names: ``layout`` "kohya" (``lora_unet_double_blocks_0_img_attn_qkv
    .lora_down.weight`` and ``.alpha``), "comfyui" (the same as ``diffusion_model.double_blocks.0.img_attn.qkv
    .lora_down.weight``) or, FLUX.2 only, "ai-toolkit" (``diffusion_model.….lora_A.weight``, one A per fused layer).
    Every diffusers layer of a fused BFL layer must be in the LoRA."""
    config = json.loads(open(os.path.join(model_dir, "transformer", "config.json")).read())
    tensors: dict[str, torch.Tensor] = {}
    covered = set()
    for bfl, parts in _bfl_layers(family_key, config).items():
        present = [p for p in parts if p in lora.layers]
        if not present:
            continue
        if len(present) != len(parts):
            raise ValueError(f"{bfl} fuses {parts}: put all of them in the LoRA, or none")
        covered |= set(parts)
        a, b, alpha = fused(lora, bfl, parts, block_diagonal=layout != "ai-toolkit")
        if layout == "ai-toolkit":
            scale = alpha / a.shape[0]
            tensors[f"diffusion_model.{bfl}.lora_A.weight"] = a.contiguous()
            tensors[f"diffusion_model.{bfl}.lora_B.weight"] = (scale * b).contiguous()
            continue
        name = f"lora_unet_{bfl.replace('.', '_')}" if layout == "kohya" else f"diffusion_model.{bfl}"
        tensors[f"{name}.lora_down.weight"] = a.contiguous()
        tensors[f"{name}.lora_up.weight"] = b.contiguous()
        tensors[f"{name}.alpha"] = torch.tensor(alpha)
    left = sorted(set(lora.layers) - covered)
    if left:
        raise ValueError(f"no BFL name for {left}")
    save_file(tensors, str(path))
    return str(path)
