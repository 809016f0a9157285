#!/usr/bin/env python3
"""Peak host memory per rank when a model converted from ComfyUI's files loads with tensor parallelism, against a
full replica (context parallel), in one run.

    COMFYUI_DIR=... python bench/comfy_files_memory.py [--ranks 2] [--width 1024] [--json]

A FLUX.1 transformer with random weights, wide enough that its weights dwarf a rank's baseline (``--width`` 1024:
8 heads × 128, 2 double + 4 single blocks, ~140M parameters, ~0.56 GB in float32 as the CPU ranks hold it), is
written as ComfyUI's bf16 file in Black Forest Labs' layout beside the tiny CLIP / T5 / VAE files
(``parallel_runtime.families.flux.tiny``), converted by ``comfy_files`` (as ParallelModelFromComfyFiles
does), then generated from on a fresh CPU backend per strategy. Each backend first runs the whole path on the tiny
model (imports and first-run buffers), then the big one. Measured per rank: its resident memory before the big model
(``VmRSS`` in ``/proc/<pid>/status``) and the kernel's high-water mark after its image (``VmHWM``); the difference
bounds the rank's peak growth from above (loading the big transformer, a step's activations; rank 0 also encodes and
holds the tiny encoders). That high-water mark counts the pages of the safetensors file the rank has mapped and read
(page cache, which the kernel can drop), so the rank's anonymous memory (``RssAnon``, what it allocated) is also
sampled every 5 ms during the run: its peak growth is what the rank itself held at most.

Reported: the full model's bytes in the run dtype, each rank's peak growth, and the ratio peak / full model. A TP
rank below 1 never held the whole model, not even while loading.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def proc_status(pid: int, field: str) -> int:
    """A field of /proc/<pid>/status in bytes: VmRSS (resident now), VmHWM (the most it has been resident)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for {pid}")


def big_flux1(width: int) -> object:
    """A FLUX.1 transformer of ``width`` (heads of 128) with 2 double and 4 single blocks, random weights (seed 0),
    whose inputs fit the tiny text encoders and VAE."""
    import torch
    from diffusers import FluxTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return FluxTransformer2DModel(
            in_channels=64,
            num_layers=2,
            num_single_layers=4,
            attention_head_dim=128,
            num_attention_heads=width // 128,
            joint_attention_dim=64,
            pooled_projection_dim=64,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        )


def random_flux_files(prefix: str, width: int) -> tuple[str, dict[str, str], object]:
    """A temporary ComfyUI models folder (removed at exit; the conversion root below it) with the tiny FLUX.1's bf16
    files, and a random FLUX.1 transformer ``width`` wide (``width // 128`` heads of 128, 2 double + 4 single blocks):
    (the folder, the tiny files' widget values, the transformer)."""
    from parallel_runtime import comfy_files
    from parallel_runtime.families.flux import tiny as flux_tiny

    comfy_dir = comfy_files.comfy_package_dir()
    if comfy_dir is None:
        sys.exit("needs ComfyUI's tokenizers: set COMFYUI_DIR")
    work = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # the files and their conversion: GiBs at real widths
    os.environ["COMFY_PARALLEL_COMFY_MODELS"] = os.path.join(work, "models")
    os.environ["COMFY_PARALLEL_CONVERTED"] = os.path.join(work, "converted")
    names, _ = flux_tiny.make_tiny_flux_files(
        os.path.join(work, "models"), os.path.join(work, "reference"), comfy_dir, formats=("bf16",)
    )["bf16"]
    big = big_flux1(width)
    return work, names, big


@contextlib.contextmanager
def anonymous_peaks(pids: list[int]) -> Iterator[tuple[list[int], list[int]]]:
    """Each process's anonymous memory (``RssAnon``) before the block and its peak during it, sampled every 5 ms
    (anonymous memory has no high-water mark of its own); the peaks are final once the block ends."""
    before = [proc_status(pid, "RssAnon") for pid in pids]
    peak = list(before)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for i, pid in enumerate(pids):
                peak[i] = max(peak[i], proc_status(pid, "RssAnon"))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield before, peak
    finally:
        done.set()
        watcher.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024, help="the transformer's width (a multiple of 128)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file

    from parallel_runtime import default_spec, get_backend, jobs, shutdown_backend
    from parallel_runtime.families.flux import tiny as flux_tiny

    work, names, big = random_flux_files("comfy-files-memory-", args.width)
    full_bytes = sum(p.numel() * 4 for p in big.parameters())  # float32: the CPU ranks' dtype
    bfl = flux_tiny.bfl_transformer(big.state_dict(), 2, 4)
    name = "bench-flux1-dev.safetensors"
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in bfl.items()},
        os.path.join(work, "models", "diffusion_models", name),
    )
    del big, bfl
    model, _ = jobs.model_from_comfy_files(**{**names, "diffusion_model": name})

    tiny_model, _ = jobs.model_from_comfy_files(**names)
    results = {"full_model_bytes": full_bytes, "strategies": {}}
    for strategy, extra in (("tensor_parallel", {"tp_degree": args.ranks}), ("context_parallel", {})):
        spec = default_spec(ranks=args.ranks, device="cpu", memory_policy="staged")
        backend = get_backend(spec)

        def generate(model: str, strategy: str = strategy, extra: dict = extra, spec=spec) -> None:
            positive = jobs.encode_prompt(spec, model=model, prompt="a photo of a horse", max_sequence_length=32)
            handle = jobs.plan_transformer(spec, model=model, strategy=strategy, **extra)
            jobs.sample(handle, positive, seed=1, steps=2, guidance_scale=3.5, width=64, height=64)

        # The whole path once on the tiny model first, so that imports and first-run buffers are in the baseline.
        generate(tiny_model)
        pids = [pid for _, pid in sorted(backend.worker_pids.items())]
        before = [proc_status(pid, "VmRSS") for pid in pids]
        with anonymous_peaks(pids) as (anon_before, anon_peak):
            generate(model)
        after = [proc_status(pid, "VmHWM") for pid in pids]
        params = [
            next(m for m in r.resident if m.component == "transformer").parameter_bytes for r in backend.status().ranks
        ]
        shutdown_backend()
        growth = [a - b for a, b in zip(after, before)]  # the peak above what the rank held before: an upper bound
        anon = [a - b for a, b in zip(anon_peak, anon_before)]
        results["strategies"][strategy] = {
            "peak_anonymous_growth_bytes": anon,
            "peak_anonymous_over_full_model": [round(g / full_bytes, 3) for g in anon],
            "peak_growth_bytes": growth,
            "peak_over_full_model": [round(g / full_bytes, 3) for g in growth],
            "resident_parameter_bytes": params,
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"full transformer: {full_bytes / 2**20:.0f} MiB (float32), converted from ComfyUI's layout")
    for strategy, r in results["strategies"].items():
        per_rank = ", ".join(
            f"rank {i}: peak anonymous +{a / 2**20:.0f} MiB ({a / full_bytes:.2f} × model), peak RSS +{g / 2**20:.0f} "
            f"MiB, holds {p / 2**20:.0f} MiB"
            for i, (a, g, p) in enumerate(
                zip(r["peak_anonymous_growth_bytes"], r["peak_growth_bytes"], r["resident_parameter_bytes"])
            )
        )
        print(f"{strategy}: {per_rank}")


if __name__ == "__main__":
    main()
