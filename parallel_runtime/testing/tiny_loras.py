"""Tiny random LoRAs for the tiny models, built in code and saved as safetensors in the layouts LoRAs are published in.

A ``TinyLora`` holds, per layer of the transformer (diffusers' module names), the factors A [rank, in] and
B [out, rank] and an alpha: the layer's delta at strength s is ``s * alpha / rank * B @ A``, the PEFT convention.
It is saved:

- in diffusers' layout (``transformer.<module>.lora_A.weight``, alphas and ranks in the adapter metadata), with the
  family pipeline's own ``save_lora_weights``;
- in the BFL layouts of FLUX.1 / FLUX.2 (``double_blocks.0.img_attn.qkv``, ``final_layer.adaLN_modulation.1``, ...),
  as kohya's ``lora_unet_…`` files (lora_down / lora_up / alpha) and as ComfyUI's ``diffusion_model.…`` ones, and
  as xlabs' FLUX.1 files; and Qwen-Image's kohya and ``diffusion_model.`` files. These are written from the BFL
  model's own layer names (the inverse of the mapping diffusers documents for the base checkpoints: fused q/k/v, the
  single blocks' linear1/linear2, AdaLN modulations with shift and scale in BFL's order), never with diffusers' LoRA
  converters, so a test comparing a converted file with its diffusers twin is not circular.

A BFL layer that fuses several diffusers layers (q, k and v) is written block-diagonal (kohya: rank = the sum of the
parts', so the converter splits it exactly) or, for layouts whose converters copy lora_A to every part (xlabs,
FLUX.2's ``diffusion_model.``), from a LoRA whose parts share A (``share_a``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping

import torch
from safetensors.torch import save_file

from ..families import family
from ..families.lora import meta_transformer

# Layers each family's tiny LoRA changes by default: column- and row-sharded ones, packed ones, replicated ones (AdaLN,
# embedders) and the context-parallel gather layer (proj_out), so every way a strategy holds a weight is covered.
DEFAULT_LAYERS = {
    "flux": (
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
    ),
    "flux2": (
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.to_out.0",
        "transformer_blocks.0.ff.linear_in",
        "transformer_blocks.0.ff_context.linear_out",
        "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
        "single_transformer_blocks.1.attn.to_out",
        "x_embedder",
        "proj_out",
    ),
    "qwenimage": (
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.to_out.0",
        "transformer_blocks.0.attn.add_v_proj",
        "transformer_blocks.0.img_mod.1",
        "transformer_blocks.1.img_mlp.net.0.proj",
        "transformer_blocks.1.txt_mlp.net.2",
        "img_in",
        "proj_out",
    ),
}

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
_SWAPPED = ("final_layer.adaLN_modulation.1",)  # BFL: (shift, scale); diffusers: (scale, shift)


@dataclasses.dataclass(frozen=True)
class TinyLora:
    """Per layer (diffusers' name): ``(A [rank, in], B [out, rank], alpha)``."""

    layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]]

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
    """A random LoRA for the tiny model in ``model_dir``: ``layers`` (default: the family's ``DEFAULT_LAYERS``), each of
    ``rank`` (or its own in ``ranks``) and ``alpha`` (None: alpha = rank, scale 1). ``size`` sets how far the delta
    moves a layer relative to its typical weight. Layers in one group of ``share_a`` get the same A (their ranks must
    be equal)."""
    config = json.loads(open(os.path.join(model_dir, "transformer", "config.json")).read())
    skeleton = dict(meta_transformer(family(family_key), config).named_modules())
    generator = torch.Generator().manual_seed(seed)
    made = {}
    for module in layers or DEFAULT_LAYERS[family_key]:
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


# -- diffusers' layout -------------------------------------------------------------------------------------------
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
    }
    tensors = {}
    for module, (a, b, _) in lora.layers.items():
        tensors[f"{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{module}.lora_B.weight"] = b.contiguous()
    path = str(path)
    pipeline.save_lora_weights(
        os.path.dirname(path),
        transformer_lora_layers=tensors,
        weight_name=os.path.basename(path),
        transformer_lora_adapter_metadata=metadata,
    )
    return path


# -- BFL layouts --------------------------------------------------------------------------------------------------
def _bfl_layers(family_key: str, config: dict) -> dict[str, tuple[str, ...]]:
    """BFL layer name -> the diffusers layers it fuses, for this model's block counts."""
    double, single, top = {
        "flux": (_FLUX1_DOUBLE, _FLUX1_SINGLE, _FLUX1_TOP),
        "flux2": (_FLUX2_DOUBLE, _FLUX2_SINGLE, _FLUX2_TOP),
    }[family_key]
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


def _fused(lora: TinyLora, bfl: str, parts: tuple[str, ...], *, block_diagonal: bool):
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
        a, b, alpha = _fused(lora, bfl, parts, block_diagonal=layout != "ai-toolkit")
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
        a, b, alpha = _fused(lora, name, tuple(order), block_diagonal=False)
        if alpha != a.shape[0]:
            b = alpha / a.shape[0] * b  # xlabs has no alpha: the scale goes into B
        tensors[f"{name}.down.weight"] = a.contiguous()
        tensors[f"{name}.up.weight"] = b.contiguous()
    save_file(tensors, str(path))
    return str(path)


def save_qwenimage_lora(lora: TinyLora, path: str | os.PathLike, *, layout: str) -> str:
    """Qwen-Image's own layer names (diffusers kept them): "kohya" (``lora_unet_transformer_blocks_0_attn_to_q
    .lora_down.weight``, ``.alpha``) or "comfyui" (``diffusion_model.transformer_blocks.0.attn.to_q.lora_A.weight``)."""
    tensors = {}
    for module, (a, b, alpha) in lora.layers.items():
        if layout == "kohya":
            name = f"lora_unet_{module.replace('.', '_')}"
            tensors[f"{name}.lora_down.weight"] = a.contiguous()
            tensors[f"{name}.lora_up.weight"] = b.contiguous()
            tensors[f"{name}.alpha"] = torch.tensor(alpha)
        else:
            tensors[f"diffusion_model.{module}.lora_A.weight"] = a.contiguous()
            tensors[f"diffusion_model.{module}.lora_B.weight"] = (alpha / a.shape[0] * b).contiguous()
    save_file(tensors, str(path))
    return str(path)
