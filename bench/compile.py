#!/usr/bin/env python3
"""Regional compilation (LoadShardedTransformer's ``compile``) against eager, per strategy, in one run: ratios only.

    python bench/compile.py [--device cpu|cuda] [--ranks 2] [--size 256] [--steps 4] [--repeats 3]
                            [--backend inductor] [--strategies ulysses tp device_map] [--json]
    bench/gpu.sh compile      # the same on every GPU, at FLUX.1-dev's width and 1024², random weights
    bench/gpu_check.sh --only compile   # one GPU: the device_map row

bench/strategies.py's FLUX.1 folder with a random transformer (``--preset bench`` on CPU), one prompt encoded once on
an N-rank backend, then for Ulysses N and tensor parallel N (and
``device_map``, rank 0 alone: a one-GPU row): ``--repeats`` eager runs, then the same with ``compile
regional`` (a new transformer handle: compiling is part of the resident transformer, so the switch reloads it). The
first compiled run pays the compile; its wall time less an eager run's median is the compile time. Per-step times
are bench/strategies.py's (intervals between the backend's step events, the first step dropped), and the ratio is
the compiled median over the eager median (below 1: compiling made a step faster). The ranks compile with
``--backend`` (``COMPILE_BACKEND_ENV``; inductor needs a C++ compiler on CPU ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

# Runnable as a plain script from a checkout: the package is not necessarily installed in the venv.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.strategies import backend_run, prepare_model_dir
from parallel_runtime import BackendSpec, jobs, shutdown_backend
from parallel_runtime.wire import COMPILE_BACKEND_ENV

PROMPT = "a photo of a red cat on a blue sky"


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size", type=int, default=256, help="image side, a multiple of 16 (default 256)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per run, ≥ 3; the first is not timed")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (default 3)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend on the ranks (default inductor)")
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=("ulysses", "tp", "device_map"),
        default=["ulysses", "tp"],
        help="rows to run (device_map: one GPU's row, for a 1-rank backend)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end as well")
    parser.add_argument("--max-sequence-length", type=int, default=64)
    parser.add_argument("--model-dir", help="the FLUX.1 folder to use or build (default: a temporary one)")
    parser.add_argument("--preset", default="bench", help="transformer config: bench (CPU) or flux1-dev")
    parser.add_argument("--double-blocks", type=int, help="build with this many double-stream blocks instead")
    parser.add_argument("--single-blocks", type=int, help="build with this many single-stream blocks instead")
    parser.add_argument("--guidance", type=float, default=3.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps < 3 or args.repeats < 1 or args.size % 16:
        parser.error("--steps at least 3, --repeats at least 1, --size a multiple of 16")
    args.width = args.height = args.size
    return args


def _timed(handle: jobs.TransformerHandle, conditioning: jobs.Conditioning, args: argparse.Namespace):
    t0 = time.perf_counter()
    steps = backend_run(handle, conditioning, args, images=1)
    return time.perf_counter() - t0, steps


def bench(args: argparse.Namespace, model_dir: str) -> list[dict]:
    model = os.path.basename(model_dir)
    os.environ["COMFY_PARALLEL_MODELS"] = os.path.dirname(model_dir)
    os.environ[COMPILE_BACKEND_ENV] = args.backend  # before the backend starts: the launcher copies this environment
    spec = BackendSpec(ranks=args.ranks, device=args.device, memory_policy="staged")
    strategies = {
        "ulysses": {"strategy": "context_parallel", "ulysses_degree": args.ranks},
        "tp": {"strategy": "tensor_parallel", "tp_degree": args.ranks},
        "device_map": {"strategy": "device_map"},
    }
    rows = []
    try:
        conditioning = jobs.encode_prompt(
            spec, model=model, prompt=PROMPT, max_sequence_length=args.max_sequence_length
        )
        for name in args.strategies:
            side = {}
            for compile in ("off", "regional"):
                handle = jobs.plan_transformer(spec, model=model, compile=compile, **strategies[name])
                first = _timed(handle, conditioning, args)  # eager: the load; compiled: the load and the compile
                runs = [_timed(handle, conditioning, args) for _ in range(args.repeats)]
                side[compile] = (first, runs)
            step = {c: statistics.median(s for _, steps in side[c][1] for s in steps) for c in side}
            rows.append(
                {
                    "strategy": name if name == "device_map" else f"{name}{args.ranks}",
                    "eager_ms": step["off"] * 1e3,
                    "compiled_ms": step["regional"] * 1e3,
                    "ratio": step["regional"] / step["off"],
                    # both first runs load the transformer; the compiled one compiles too
                    "compile_s": side["regional"][0][0] - side["off"][0][0],
                    "load_and_compile_s": side["regional"][0][0],
                    "eager_first_s": side["off"][0][0],
                }
            )
            print(_row(rows[-1]), flush=True)
    finally:
        shutdown_backend()
    return rows


def _row(row: dict) -> str:
    return (
        f"{row['strategy']:<10} eager {row['eager_ms']:8.1f} ms/step  compiled {row['compiled_ms']:8.1f} ms/step  "
        f"ratio {row['ratio']:.2f}  first compiled run {row['load_and_compile_s']:.1f} s "
        f"(first eager run {row['eager_first_s']:.1f} s; compile ≈ {row['compile_s']:.1f} s)"
    )


def main() -> None:
    args = _parse_args()
    with tempfile.TemporaryDirectory(prefix="pd-bench-compile-") as scratch:
        model_dir = prepare_model_dir(args, scratch, print)
        print(
            f"{args.device}, {args.ranks} ranks, {args.size}², {args.steps} steps × {args.repeats} runs per side, "
            f"backend {args.backend}; load average {os.getloadavg()[0]:.1f}"
        )
        rows = bench(args, model_dir)
    if args.json:
        print(json.dumps({"device": args.device, "ranks": args.ranks, "backend": args.backend, "rows": rows}))


if __name__ == "__main__":
    main()
