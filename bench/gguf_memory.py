#!/usr/bin/env python3
"""Each rank's memory and per-step time with a GGUF transformer (Q8_0, Q4_K) against the same model's bf16 file, on
the same ranks, in one run.

    COMFYUI_DIR=... python bench/gguf_memory.py [--ranks 2] [--width 1024] [--strategy context_parallel] [--json]

A FLUX.1 transformer with random weights (``--width`` 1024: 8 heads × 128, 2 double + 4 single blocks, ~140M parameters)
is written as ComfyUI's bf16 file and as ComfyUI-GGUF's Q8_0 and Q4_K files (``families.tiny.write_gguf``) beside the
tiny CLIP / T5 / VAE files, converted by ``comfy_files`` as ParallelModelFromComfyFiles does, and generated from on a
fresh CPU backend per format (context parallel by default: each rank holds the whole transformer), where the tiny model
runs first (imports and first-run buffers in the baseline). Measured per rank: the parameter bytes it holds (diffusers'
packed GGUF tensors count their packed bytes), its anonymous memory's peak growth while the format loads and samples
(``RssAnon`` of ``/proc/<pid>/status`` sampled every 5 ms: what the rank allocated, not the file's page cache), and the
time per denoising step (a 4-step run's wall time minus a 2-step run's, over 2: the load and the encode cancel out). The
CPU ranks compute in float32, so "bf16" holds 4 bytes a parameter there; on a GPU (bf16 compute) it holds 2.
(Not ``bench/gguf.py``: run as a script, that name would shadow the ``gguf`` package for everything it imports.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from comfy_files_memory import anonymous_peaks, random_flux_files

FORMATS = ("bf16", "Q8_0", "Q4_K")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024, help="the transformer's width (a multiple of 256)")
    parser.add_argument("--strategy", default="context_parallel", choices=("context_parallel", "data_parallel"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file

    from parallel_runtime import default_spec, get_backend, jobs, shutdown_backend
    from parallel_runtime.families.flux import tiny as flux_tiny
    from parallel_runtime.families.tiny import write_gguf

    work, names, big = random_flux_files("gguf-bench-", args.width)
    parameters = sum(p.numel() for p in big.parameters())
    bfl = {k: v.to(torch.bfloat16) for k, v in flux_tiny.bfl_transformer(big.state_dict(), 2, 4).items()}
    del big
    folder = os.path.join(work, "models", "diffusion_models")
    files = {
        "bf16": "bench-flux1-dev.safetensors",
        "Q8_0": "bench-flux1-dev-Q8_0.gguf",
        "Q4_K": "bench-flux1-dev-Q4_K.gguf",
    }
    save_file({k: v.contiguous() for k, v in bfl.items()}, os.path.join(folder, files["bf16"]))
    for qtype in ("Q8_0", "Q4_K"):
        write_gguf(bfl, os.path.join(folder, files[qtype]), "flux", qtype)
    del bfl
    models = {fmt: jobs.model_from_comfy_files(**{**names, "diffusion_model": file})[0] for fmt, file in files.items()}
    tiny_model, _ = jobs.model_from_comfy_files(**names)

    spec = default_spec(ranks=args.ranks, device="cpu", memory_policy="staged")
    batch = args.ranks if args.strategy == "data_parallel" else 1
    extra = {"ulysses_degree": args.ranks} if args.strategy == "context_parallel" else {}

    def sample(model: str, steps: int) -> float:
        positive = jobs.encode_prompt(spec, model=model, prompt="a photo of a horse", max_sequence_length=32)
        handle = jobs.plan_transformer(spec, model=model, strategy=args.strategy, **extra)
        t0 = time.perf_counter()
        jobs.sample(handle, positive, seed=1, steps=steps, guidance_scale=3.5, width=128, height=128, batch_size=batch)
        return time.perf_counter() - t0

    results = {"parameters": parameters, "strategy": args.strategy, "ranks": args.ranks, "formats": {}}
    for fmt in FORMATS:
        # A fresh backend per format: memory another format's model held and gave back stays in the ranks' heaps and
        # would hide this one's peak.
        backend = get_backend(spec)
        try:
            sample(tiny_model, 2)
            pids = [pid for _, pid in sorted(backend.worker_pids.items())]
            with anonymous_peaks(pids) as (before, peak):
                sample(models[fmt], 2)  # loads the format's transformer
            step = (sample(models[fmt], 4) - sample(models[fmt], 2)) / 2
            held = [
                next(m for m in r.resident if m.component == "transformer").parameter_bytes
                for r in backend.status().ranks
            ]
        finally:
            shutdown_backend()
        results["formats"][fmt] = {
            "parameter_bytes": held,
            "peak_anonymous_growth_bytes": [p - b for p, b in zip(peak, before)],
            "seconds_per_step": round(step, 4),
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    base = results["formats"]["bf16"]
    base_held, base_peak = max(base["parameter_bytes"]), max(1, max(base["peak_anonymous_growth_bytes"]))
    print(f"FLUX.1, {parameters / 1e6:.0f}M parameters, {args.strategy} on {args.ranks} CPU ranks (float32 compute)")
    for fmt, r in results["formats"].items():
        held, peak, step = max(r["parameter_bytes"]), max(r["peak_anonymous_growth_bytes"]), r["seconds_per_step"]
        print(
            f"{fmt:>5}: holds {held / 2**20:.0f} MiB per rank ({held / base_held:.2f} × bf16's), peak anonymous "
            f"growth {peak / 2**20:.0f} MiB ({peak / base_peak:.2f} ×), {step:.3f} s per step "
            f"({step / base['seconds_per_step']:.2f} ×)"
        )


if __name__ == "__main__":
    main()
