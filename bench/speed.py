#!/usr/bin/env python3
"""CFG parallelism, step caching and the VAE decode over the ranks, measured side by side in one run: ratios only.

    python bench/speed.py [--device cpu|cuda] [--ranks 2|4] [--parts cfg cache vae] [--size 256] [--steps 6]
    bench/gpu.sh          # the FLUX.1 strategy rows, then these at Qwen-Image's width on every GPU

One Qwen-Image pipeline folder with a random transformer (``--preset bench``: 4 blocks, 8 heads × 64, for CPU ranks;
``qwen-image``: Qwen-Image's own 60 blocks of 24 heads × 128, in bfloat16, for GPUs; ``--layers`` overrides the
depth) behind the tiny test text encoder (only the text's token count reaches a timed step) and a random VAE
(``bench``: a narrow one; ``qwen-image``: Qwen-Image's own config). One prompt and negative prompt, encoded once on
an N-rank backend; then, on that backend, through the nodes' steps (``jobs``):

* ``cfg``: Qwen-Image's true CFG (``--true-cfg-scale``, two transformer passes per step) with ``device_map`` (rank 0
  alone: one process), ``context_parallel`` (Ulysses over all N ranks) and ``cfg_parallel`` (the two passes on two
  halves; with 4 ranks, Ulysses 2 inside each half). Per row: transformer passes per rank per step (each rank's own
  count, from the backend's status) and the median per-step time against ``device_map``'s.
* ``cache``: Ulysses over the N ranks with each ``cache`` mode (``first_block_cache`` at each ``--thresholds``,
  ``taylorseer``) against ``off``: per-step time, passes run in full / from the cache (rank 0's report; every rank
  takes the same decisions), and the image's deviation from the uncached one (max |diff| and PSNR, in 0..1 IMAGE
  units). Random weights change more from step to step than a trained model's, so they skip only at high thresholds:
  the deviations say what the mechanism costs here, not what a trained model loses.
* ``vae``: a ``--decode-size``² decode (default 2048) of a random latent, on one device (VAEDecodeSingleGPU's plain
  decode) and with ``decode_over_ranks`` (diffusers' tiled decode, tiles over the ranks): time ratio, tiles per
  rank and peak memory per rank above its VAE's weights (torch's allocated memory on CUDA, the resident set on the
  CPU) against the single decode's.

Step times are the intervals between the backend's progress events (the first step, which carries the lazy set-up
after a load, is dropped); each row runs once (``--steps`` steps). The numbers are from one machine in one run: on 2
shared CPU cores N ranks are never faster than one process, so the CPU ratios show what each mechanism costs in
communication and saves in work (passes, tiles), and GPUs show the speed-up.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

# Runnable as a plain script from a checkout: the package is not necessarily installed in the venv.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel_runtime import default_spec, get_backend, jobs, shutdown_backend

# QwenImageTransformer2DModel arguments over make_tiny_qwenimage's. joint_attention_dim stays the tiny encoder's 32:
# only txt_in (one small Linear) reads it, so the step's work is the model's at any text width.
PRESETS: dict[str, dict] = {
    "bench": {"num_layers": 4, "num_attention_heads": 8, "attention_head_dim": 64, "axes_dims_rope": (16, 24, 24)},
    # Qwen/Qwen-Image, transformer/config.json: 20 B parameters, 41 GB in bfloat16.
    "qwen-image": {
        "num_layers": 60,
        "num_attention_heads": 24,
        "attention_head_dim": 128,
        "axes_dims_rope": (16, 56, 56),
    },
}
VAE_PRESETS: dict[str, dict] = {
    "bench": {"base_dim": 16, "num_res_blocks": 1},
    "qwen-image": {"base_dim": 96, "num_res_blocks": 2},  # Qwen/Qwen-Image, vae/config.json
}
PRESET_DTYPES = {"bench": torch.float32, "qwen-image": torch.bfloat16}
MODEL = "bench-qwenimage"


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the backend: 2, or 4 (cfg 2 × ulysses 2)")
    parser.add_argument("--parts", nargs="+", choices=("cfg", "cache", "vae"), default=["cfg", "cache", "vae"])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    parser.add_argument("--layers", type=int, help="transformer blocks instead of the preset's")
    parser.add_argument("--size", type=int, default=256, help="image width and height, a multiple of 16")
    parser.add_argument("--steps", type=int, default=6, help="denoising steps per row, ≥ 3 (the first is not timed)")
    parser.add_argument("--true-cfg-scale", type=float, default=4.0)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.05, 0.2, 0.4], help="first_block_cache's")
    parser.add_argument("--decode-size", type=int, default=2048, help="the decoded image's side, a multiple of 16")
    parser.add_argument("--model-dir", help="the pipeline folder (built there when it holds none; default: temporary)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build(out_dir: str, preset: str, layers: int | None, device: str) -> str:
    """A Qwen-Image pipeline folder with a random transformer and VAE of ``preset`` (drawn on ``device``)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    from parallel_runtime.families.qwenimage.tiny import make_tiny_model as make_tiny_qwenimage

    make_tiny_qwenimage(out_dir)
    parts = (
        ("transformer", QwenImageTransformer2DModel, {**PRESETS[preset], **({"num_layers": layers} if layers else {})}),
        ("vae", AutoencoderKLQwenImage, VAE_PRESETS[preset]),
    )
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(PRESET_DTYPES[preset])  # drawn in the target dtype: Qwen-Image in float32 needs 82 GB
    try:
        for name, cls, overrides in parts:
            config = dict(cls.load_config(os.path.join(out_dir, name)), **overrides)
            with torch.device(device):
                model = cls.from_config(config)
            shutil.rmtree(os.path.join(out_dir, name))
            model.save_pretrained(os.path.join(out_dir, name), safe_serialization=True)
            del model
    finally:
        torch.set_default_dtype(default_dtype)
    return out_dir


def _steps_seconds(marks: list[float]) -> float:
    return statistics.median(b - a for a, b in itertools.pairwise(marks))


def sample(spec, conditioning, args, reports: list | None = None, **strategy) -> tuple[float, torch.Tensor]:
    """One generation; (median seconds per step, the latent)."""
    marks: list[float] = []

    def on_progress(step: int, total: int, text: str | None) -> None:
        if step >= 1:  # step 0 is "loading transformer"
            marks.append(time.perf_counter())

    handle = jobs.plan_transformer(spec, model=MODEL, **strategy)
    latent = jobs.sample(
        handle,
        conditioning,
        seed=args.seed,
        steps=args.steps,
        guidance_scale=1.0,
        width=args.size,
        height=args.size,
        true_cfg_scale=args.true_cfg_scale,
        on_progress=on_progress,
        on_cache_report=None if reports is None else reports.append,
    )
    return _steps_seconds(marks), latent


def _passes_per_step(spec, steps: int) -> list[str]:
    """Each rank's transformer passes per step in the last denoise ("-": the rank ran none, as under device_map)."""
    return [f"{r.last_passes / steps:g}" if r.last_passes else "-" for r in get_backend(spec).status().ranks]


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a - b).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


def bench_cfg(spec, conditioning, args) -> None:
    half = args.ranks // 2
    rows = [
        ("device_map (one process)", {"strategy": "device_map"}),
        (f"context_parallel ulysses {args.ranks}", {"strategy": "context_parallel", "anything": True}),
        (
            f"cfg_parallel cfg 2{f' x ulysses {half}' if half > 1 else ''}",
            {"strategy": "cfg_parallel", "anything": half > 1},
        ),
    ]
    print(f"\ncfg: Qwen-Image true CFG {args.true_cfg_scale}, {args.size}², {args.ranks} ranks")
    print(f"  {'strategy':34} {'passes/rank/step':>18} {'step time vs one process':>26}")
    base = None
    for name, strategy in rows:
        seconds, _ = sample(spec, conditioning, args, **strategy)
        passes = _passes_per_step(spec, args.steps)
        base = base or seconds
        print(f"  {name:34} {' '.join(passes):>18} {seconds / base:>26.2f}")


def bench_cache(spec, conditioning, args) -> None:
    strategy = {"strategy": "context_parallel", "anything": True}
    rows = [("off", {})]
    rows += [
        (f"first_block_cache {t:g}", {"cache": "first_block_cache", "cache_threshold": t}) for t in args.thresholds
    ]
    rows += [("taylorseer", {"cache": "taylorseer"})]
    print(f"\ncache: context_parallel ulysses {args.ranks}, {args.steps} steps, true CFG (two passes per step)")
    print(f"  {'cache':24} {'passes in full / cached':>24} {'step time vs off':>17} {'max |diff|':>11} {'PSNR dB':>8}")
    base = reference = None
    for name, cache in rows:
        reports: list = []
        seconds, latent = sample(spec, conditioning, args, reports, **strategy, **cache)
        image = jobs.decode(spec, model=MODEL, samples=latent)
        if base is None:
            base, reference = seconds, image
        full = sum(reports[0].passes) if reports else 2 * args.steps
        total = len(reports[0].passes) if reports else 2 * args.steps
        decisions = {tuple(r.last_cache.passes) for r in get_backend(spec).status().ranks if r.last_cache}
        agreed = "" if len(decisions) <= 1 else "  (ranks disagreed!)"
        diff, psnr = (image - reference).abs().max().item(), _psnr(image, reference)
        print(
            f"  {name:24} {f'{full} / {total - full}':>24} {seconds / base:>17.2f} {diff:>11.3g} {psnr:>8.1f}{agreed}"
        )


def bench_vae(spec, args) -> None:
    side = args.decode_size // 8
    latent = torch.randn(1, 16, 1, side, side, generator=torch.Generator().manual_seed(args.seed))
    print(f"\nvae: a {args.decode_size}² decode, {args.ranks} ranks")
    print(f"  {'decode':20} {'time vs single':>15} {'tiles per rank':>15} {'peak memory per rank vs single':>32}")
    single_seconds = single_peak = None
    for name, over in (("single device", False), ("over the ranks", True)):
        results = []
        jobs.decode(spec, model=MODEL, samples=latent, decode_over_ranks=over)  # load the VAE outside the timing
        start = time.perf_counter()
        jobs.decode(spec, model=MODEL, samples=latent, decode_over_ranks=over, on_result=results.append)
        seconds = time.perf_counter() - start
        result = results[0]
        single_seconds = single_seconds or seconds
        peaks = result.peak_bytes_per_rank
        single_peak = single_peak or (peaks[0] if peaks else None)
        shown = " ".join(f"{p / single_peak:.2f}" for p in peaks)
        tiles = " ".join(map(str, result.tiles_per_rank)) or "whole"
        print(f"  {name:20} {seconds / single_seconds:>15.2f} {tiles:>15} {shown:>32}")


def main() -> int:
    args = _parse_args()
    if args.steps < 3:
        sys.exit("--steps must be at least 3: the first step is not timed")
    scratch = tempfile.mkdtemp(prefix="bench-speed-")
    try:
        model_dir = args.model_dir or os.path.join(scratch, MODEL)
        if not os.path.isfile(os.path.join(model_dir, "model_index.json")):
            print(f"building {args.preset} Qwen-Image in {model_dir} ...", flush=True)
            build(model_dir, args.preset, args.layers, args.device)
        # The nodes find the folder by its name in a diffusers model folder.
        link_root = os.path.join(scratch, "models")
        os.makedirs(link_root)
        os.symlink(os.path.abspath(model_dir), os.path.join(link_root, MODEL))
        os.environ["COMFY_PARALLEL_MODELS"] = link_root
        spec = default_spec(ranks=args.ranks, device=args.device, memory_policy="staged")
        conditioning = None
        if {"cfg", "cache"} & set(args.parts):
            conditioning = jobs.encode_prompt(
                spec,
                model=MODEL,
                prompt="a photo of a horse in the city at night, rain on the street",
                negative_prompt="blurry, low quality",
                max_sequence_length=64,
            )
        if "cfg" in args.parts:
            bench_cfg(spec, conditioning, args)
        if "cache" in args.parts:
            bench_cache(spec, conditioning, args)
        if "vae" in args.parts:
            bench_vae(spec, args)
    finally:
        shutdown_backend()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
