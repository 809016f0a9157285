#!/usr/bin/env python3
"""Each rank's peak memory and per-step time of a transformer held in bf16 against the same one stored in fp8 (plain
and ComfyUI's scaled fp8), per strategy, side by side in one run.

    COMFYUI_DIR=... python bench/quantized.py [--ranks 2] [--width 1024] [--steps 3] [--dtype bfloat16] [--json]

A FLUX.1 transformer with random weights (``--width`` 1024: 8 heads × 128, 2 double + 4 single blocks, ~140M
parameters) is written as ComfyUI's files in Black Forest Labs' layout in each format of ``FORMATS`` (the tiny CLIP /
T5 / VAE beside it, ``parallel_runtime.families.flux.tiny``), converted by ``comfy_files`` as
ParallelModelFromComfyFiles does, then generated from on a fresh CPU backend per (strategy, format), computing in
``--dtype``. Each backend first runs the whole path on the tiny model (imports and first-run buffers), then the big
one twice: the first run loads it, the second is timed (per step). Measured per rank, as bench/comfy_files_memory.py
does: the growth of its anonymous memory (``RssAnon``, sampled every 5 ms: what the rank allocated at its peak,
loading included) and of its ``VmHWM`` (peak RSS, which also counts the file's pages it read), and the parameter
bytes its transformer holds.

Reported per strategy: each format's figures and their ratios to bf16's. GGUF joins as more entries of ``FORMATS``
(a writer of the file and the widget values it loads with) when the pack loads GGUF files.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from comfy_files_memory import big_flux1, proc_status

# The formats compared: bf16 first (the ratios' base). A GGUF format is one more name here, written by its writer.
FORMATS = ("bf16", "fp8", "fp8_scaled")
STRATEGIES = {"context_parallel": {}, "tensor_parallel": {"tp_degree": 0}, "device_map": {}}


def _write_files(work: str, width: int) -> dict[str, str]:
    """The big transformer as ComfyUI's file in each format; the model name of each, converted."""
    from safetensors.torch import save_file

    from parallel_runtime import comfy_files, jobs
    from parallel_runtime.families.flux import tiny as flux_tiny

    names, _ = flux_tiny.make_tiny_flux_files(
        os.path.join(work, "models"),
        os.path.join(work, "reference"),
        comfy_files.comfy_package_dir(),
        formats=("bf16",),
    )["bf16"]
    big = big_flux1(width)
    models = {"tiny": jobs.model_from_comfy_files(**names)[0]}
    sd = big.state_dict()
    del big
    for fmt in FORMATS:
        stored, _ = flux_tiny._quantized_transformer(sd, fmt)
        prefix = "model.diffusion_model." if fmt == "fp8_scaled" else ""  # as ComfyUI saves its scaled files
        name = f"bench-flux1-dev-{fmt}.safetensors"
        save_file(
            {prefix + k: v.contiguous() for k, v in stored.items()},
            os.path.join(work, "models", "diffusion_models", name),
        )
        del stored
        models[fmt] = jobs.model_from_comfy_files(**{**names, "diffusion_model": name})[0]
    return models


def _measure(models: dict[str, str], fmt: str, strategy: str, ranks: int, steps: int, dtype: str) -> dict:
    from parallel_runtime import default_spec, get_backend, jobs, shutdown_backend

    spec = default_spec(ranks=ranks, device="cpu", memory_policy="staged")
    backend = get_backend(spec)
    extra = dict(STRATEGIES[strategy])
    if "tp_degree" in extra:
        extra["tp_degree"] = ranks

    def generate(model: str, steps: int = 2) -> float:
        positive = jobs.encode_prompt(spec, model=model, prompt="a photo of a horse", max_sequence_length=32)
        handle = jobs.plan_transformer(spec, model=model, strategy=strategy, dtype=dtype, **extra)
        t0 = time.perf_counter()
        jobs.sample(handle, positive, seed=1, steps=steps, guidance_scale=3.5, width=128, height=128)
        return time.perf_counter() - t0

    try:
        generate(models["tiny"])
        pids = [pid for _, pid in sorted(backend.worker_pids.items())]
        before = [proc_status(pid, "VmRSS") for pid in pids]
        anon_before = [proc_status(pid, "RssAnon") for pid in pids]
        anon_peak = list(anon_before)
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                for i, pid in enumerate(pids):
                    anon_peak[i] = max(anon_peak[i], proc_status(pid, "RssAnon"))
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        generate(models[fmt])  # loads it
        per_step = generate(models[fmt], steps) / steps  # warm: the steps alone (and the encode's handover)
        done.set()
        watcher.join()
        after = [proc_status(pid, "VmHWM") for pid in pids]
        params = [m.parameter_bytes for r in backend.status().ranks for m in r.resident if m.component == "transformer"]
    finally:
        shutdown_backend()
    return {
        "peak_anonymous_growth_bytes": [a - b for a, b in zip(anon_peak, anon_before)],
        "peak_rss_growth_bytes": [a - b for a, b in zip(after, before)],
        "parameter_bytes": params,
        "seconds_per_step": round(per_step, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024, help="the transformer's width (a multiple of 128)")
    parser.add_argument("--steps", type=int, default=3, help="steps of the timed run")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the compute dtype")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from parallel_runtime import comfy_files

    if comfy_files.comfy_package_dir() is None:
        sys.exit("needs ComfyUI's tokenizers: set COMFYUI_DIR")
    work = tempfile.mkdtemp(prefix="quantized-bench-")
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    os.environ["COMFY_PARALLEL_COMFY_MODELS"] = os.path.join(work, "models")
    os.environ["COMFY_PARALLEL_CONVERTED"] = os.path.join(work, "converted")
    models = _write_files(work, args.width)
    results = {
        strategy: {fmt: _measure(models, fmt, strategy, args.ranks, args.steps, args.dtype) for fmt in FORMATS}
        for strategy in args.strategies
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    mib = 2**20
    print(f"FLUX.1 width {args.width}, {args.ranks} CPU ranks, compute in {args.dtype}; ratios to bf16 in brackets")
    print("| strategy | format | parameters / rank MiB | peak anonymous / rank MiB | peak RSS / rank MiB | s / step |")
    print("|---|---|---|---|---|---|")
    for strategy, by_format in results.items():
        base = by_format[FORMATS[0]]
        for fmt, r in by_format.items():

            def cell(key: str, r: dict = r, base: dict = base) -> str:
                values = [f"{v / mib:.0f} ({v / max(b, 1):.2f})" for v, b in zip(r[key], base[key])]
                return ", ".join(values)

            ratio = r["seconds_per_step"] / base["seconds_per_step"]
            print(
                f"| {strategy} | {fmt} | {cell('parameter_bytes')} | {cell('peak_anonymous_growth_bytes')} | "
                f"{cell('peak_rss_growth_bytes')} | {r['seconds_per_step']:.2f} ({ratio:.2f}) |"
            )


if __name__ == "__main__":
    main()
