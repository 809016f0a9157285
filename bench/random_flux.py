"""FLUX.1 pipeline folders with a random-weight transformer of any width, built offline, for the strategy benchmarks.

    python bench/random_flux.py DIR [--preset bench|flux1-dev] [--double-blocks N] [--single-blocks N]

``families.flux.tiny.make_tiny_flux`` gives a complete pipeline that the real ``FluxPipeline`` loads (tokenizers,
scheduler, a 16-channel 8x VAE, CLIP and T5). This replaces its transformer with one built from a preset config with
random weights, and where that transformer takes wider text embeddings than the tiny encoders give (32), rebuilds CLIP
and T5 from their own saved configs at the transformer's widths (CLIP's pooled output feeds ``pooled_projection_dim``,
T5's hidden states ``joint_attention_dim``). The encoders stay one or two layers deep: only their output widths matter
to the transformer, and they never run in a timed step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

# Runnable as a plain script from a checkout: the package is not necessarily installed in the venv.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# FluxTransformer2DModel arguments over make_tiny_flux's transformer config. Both keep in_channels 64 (16 latent
# channels x 2x2 packing) and guidance_embeds (FLUX.1-dev's distilled guidance); axes_dims_rope sums to the head dim.
PRESETS: dict[str, dict] = {
    # For CPU ranks: wide enough that matrix products, not Python, fill a step (~0.25 s on one core at 256²), small
    # enough that four ranks each hold a full copy (~140 MB in float32). 8 heads: Ulysses and TP split it 2 and 4 ways.
    "bench": {
        "num_layers": 2,
        "num_single_layers": 4,
        "num_attention_heads": 8,
        "attention_head_dim": 64,
        "axes_dims_rope": (8, 28, 28),
    },
    # FLUX.1-dev's transformer config (black-forest-labs/FLUX.1-dev, transformer/config.json): 11.9 B parameters.
    "flux1-dev": {
        "num_layers": 19,
        "num_single_layers": 38,
        "num_attention_heads": 24,
        "attention_head_dim": 128,
        "joint_attention_dim": 4096,
        "pooled_projection_dim": 768,
        "axes_dims_rope": (16, 56, 56),
    },
}
# What each preset is saved in: what it runs in (the backend's "auto" dtype is float32 on CPU, bfloat16 on CUDA).
PRESET_DTYPES = {"bench": torch.float32, "flux1-dev": torch.bfloat16}


# Bytes of one saved shard: about the most of the transformer the build holds in host memory at once.
SHARD_BYTES = 2 << 30


def _chunks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's top-level children, each block of a ModuleList on its own: the units drawn one at a time."""
    chunks = []
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            chunks += [(f"{name}.{i}", block) for i, block in enumerate(child)]
        else:
            chunks.append((name, child))
    return chunks


def _draw(module: torch.nn.Module) -> None:
    """Random weights of a sensible size for a freshly materialised module: matrices normal with std 1/sqrt(fan_in)
    (the activations keep their scale through the blocks), norms' scales one, biases zero."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, p[0].numel() ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def _rebuild_in_chunks(component_dir: str, config: dict, model_cls, dtype: torch.dtype, device: str) -> None:
    """Save a random ``model_cls`` of ``config`` in ``dtype`` without ever holding it whole: built on the meta device,
    each block drawn on ``device``, moved to the host and written into shards of ``SHARD_BYTES`` with diffusers'
    index file. FLUX.1-dev (22 GiB in bfloat16) then needs one shard of host memory and one block of the GPU's, not
    the whole model on the first GPU."""
    from safetensors.torch import save_file

    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_cls.from_config(config)
    finally:
        torch.set_default_dtype(default_dtype)
    shutil.rmtree(component_dir, ignore_errors=True)
    os.makedirs(component_dir)
    model.save_config(component_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    written: list[list[str]] = []
    total = 0

    def write() -> None:
        path = os.path.join(component_dir, f"part-{len(written)}.safetensors")
        save_file(shards[-1], path, metadata={"format": "pt"})
        written.append(list(shards[-1]))
        shards[-1] = {}

    for prefix, module in _chunks(model):
        module.to_empty(device=device)
        _draw(module)
        for name, tensor in module.state_dict().items():
            shards[-1][f"{prefix}.{name}"] = tensor.to("cpu").contiguous()
            total += tensor.numel() * tensor.element_size()
        module.to("meta")  # this block's memory on ``device`` goes back now
        if sum(t.numel() * t.element_size() for t in shards[-1].values()) >= SHARD_BYTES:
            write()
    if shards[-1]:
        write()
    if {k for keys in written for k in keys} != set(model.state_dict()):
        raise RuntimeError(f"{model_cls.__name__} holds weights outside its children; the chunked build misses them")
    weight_map = {}
    for i, keys in enumerate(written):  # diffusers' names: diffusion_pytorch_model-00001-of-0000N.safetensors
        final = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.rename(os.path.join(component_dir, f"part-{i}.safetensors"), os.path.join(component_dir, final))
        weight_map.update(dict.fromkeys(keys, final))
    with open(os.path.join(component_dir, "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _rebuild(component_dir: str, config, model_cls, device: str) -> None:
    """Replace a saved component with a fresh random one of ``config``, drawn in torch's default dtype (rmtree first:
    a sharded save would leave the old single file next to the new index)."""
    with torch.device(device):
        model = model_cls(config)
    shutil.rmtree(component_dir)
    model.save_pretrained(component_dir, safe_serialization=True)


def build(
    out_dir: str, transformer: dict, *, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0
) -> str:
    """Save a FLUX.1 pipeline with a random transformer of ``transformer`` (FluxTransformer2DModel arguments over
    the tiny one's) in ``dtype`` to ``out_dir``; weights are drawn on ``device`` one block at a time (FLUX.1-dev's 12 B
    take a CPU minutes, a GPU far less) and saved in shards, so neither holds the whole transformer. Deterministic for
    a seed on one device."""
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux

    make_tiny_flux(out_dir, seed=seed)
    config = dict(FluxTransformer2DModel.load_config(os.path.join(out_dir, "transformer")), **transformer)
    clip = CLIPTextConfig.from_pretrained(os.path.join(out_dir, "text_encoder"))
    t5 = T5Config.from_pretrained(os.path.join(out_dir, "text_encoder_2"))
    with torch.random.fork_rng(devices=[] if device == "cpu" else [torch.device(device)]):
        torch.manual_seed(seed)
        if clip.hidden_size != config["pooled_projection_dim"]:
            clip.hidden_size = config["pooled_projection_dim"]
            _rebuild(os.path.join(out_dir, "text_encoder"), clip, CLIPTextModel, device)
        if t5.d_model != config["joint_attention_dim"]:
            t5.d_model = config["joint_attention_dim"]
            _rebuild(os.path.join(out_dir, "text_encoder_2"), t5, T5EncoderModel, device)
        # Drawn in the target dtype (FLUX.1-dev in float32 first would need 48 GB), one block at a time.
        _rebuild_in_chunks(os.path.join(out_dir, "transformer"), config, FluxTransformer2DModel, dtype, device)
    return os.fspath(out_dir)


def serve_bench_model(model_dir: str | None, scratch: str, name: str) -> str:
    """The ``bench`` preset's FLUX.1 in ``model_dir`` (built there when it holds none; None: below ``scratch``), listed
    to the nodes as ``name``: a link in a diffusers model folder below ``scratch`` that ``COMFY_PARALLEL_MODELS``
    names. Returns the folder."""
    model_dir = model_dir or os.path.join(scratch, name)
    if not os.path.isfile(os.path.join(model_dir, "model_index.json")):
        print(f"building the bench preset's FLUX.1 in {model_dir} ...", flush=True)
        build(model_dir, PRESETS["bench"])
    link_root = os.path.join(scratch, "models")
    os.makedirs(link_root)
    os.symlink(os.path.abspath(model_dir), os.path.join(link_root, name))
    os.environ["COMFY_PARALLEL_MODELS"] = link_root
    return model_dir


def preset_config(preset: str, double_blocks: int | None = None, single_blocks: int | None = None) -> dict:
    """A preset's transformer arguments, with its block counts overridden where given (fewer blocks: same width,
    smaller files, for proving the build and load path on a small machine)."""
    config = dict(PRESETS[preset])
    if double_blocks is not None:
        config["num_layers"] = double_blocks
    if single_blocks is not None:
        config["num_single_layers"] = single_blocks
    return config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    parser.add_argument("--double-blocks", type=int, help="override the preset's double-stream blocks")
    parser.add_argument("--single-blocks", type=int, help="override the preset's single-stream blocks")
    parser.add_argument("--device", default="cpu", help="where the weights are drawn (cpu, cuda)")
    args = parser.parse_args()
    build(
        args.out_dir,
        preset_config(args.preset, args.double_blocks, args.single_blocks),
        dtype=PRESET_DTYPES[args.preset],
        device=args.device,
    )
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
