"""FLUX.1 pipeline folders with a random-weight transformer of any width, built offline, for the strategy benchmarks.

    python bench/random_flux.py DIR [--preset bench|flux1-dev] [--double-blocks N] [--single-blocks N]

``testing.tiny_models.make_tiny_flux`` gives a complete pipeline that the real ``FluxPipeline`` loads (tokenizers,
scheduler, a 16-channel 8x VAE, CLIP and T5). This replaces its transformer with one built from a preset config with
random weights, and where that transformer takes wider text embeddings than the tiny encoders give (32), rebuilds CLIP
and T5 from their own saved configs at the transformer's widths (CLIP's pooled output feeds ``pooled_projection_dim``,
T5's hidden states ``joint_attention_dim``). The encoders stay one or two layers deep: only their output widths matter
to the transformer, and they never run in a timed step.
"""

from __future__ import annotations

import argparse
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
    the tiny one's) in ``dtype`` to ``out_dir``; weights are drawn on ``device`` (FLUX.1-dev's 12 B take a CPU minutes,
    a GPU far less). Deterministic for a seed on one device."""
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from parallel_runtime.testing.tiny_models import make_tiny_flux

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
        # Drawn in the target dtype: FLUX.1-dev in float32 first would need 48 GB.
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            _rebuild(os.path.join(out_dir, "transformer"), config, FluxTransformer2DModel.from_config, device)
        finally:
            torch.set_default_dtype(default_dtype)
    return os.fspath(out_dir)


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
