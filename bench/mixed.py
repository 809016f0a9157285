#!/usr/bin/env python3
"""Mixed GPUs under data_parallel: an even split of the images against the split by the ranks' measured speeds.

    python bench/mixed.py                       # 2 CPU ranks, random FLUX.1 (bench preset), 4 images of 128², 5 steps
    python bench/mixed.py --slow 0.3 --rounds 3

Rank 1 is made slower on purpose with the test-only switch ``COMFY_PARALLEL_TEST_SLOW_RANK`` (``1:--slow``: that rank
sleeps ``--slow`` seconds for each of its images at every step, as a slower GPU takes longer for every image), in a
backend started with the test ops. A data_parallel run's first split is even (no rank has measured its speed yet); it
measures each rank's speed, and the next run, the same prompt, seed and batch, follows those speeds: the slow rank gets
fewer images. Each round starts a fresh backend and makes both runs, so a noisy moment on a shared machine hits one
round; the table prints each round's seconds per step of both runs side by side and their ratio, and the median.

A run is timed from its first step's progress report to its last (``--steps`` − 1 steps): the transformer's load, which
only the first run makes, is left out. Both runs' images must agree (image i is seed + i wherever it is made); a
difference makes the exit status 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

# Runnable as a plain script from a checkout: the package is not necessarily installed in the venv.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.random_flux import serve_bench_model
from parallel_runtime import default_spec, jobs, shutdown_backend
from parallel_runtime.wire import DenoiseResult
from parallel_runtime.worker.ops import TEST_OPS_ENV
from parallel_runtime.worker.speeds import SLOW_RANK_ENV

MODEL = "bench-flux"
PROMPT = "a photo of a horse in the city at night"
TOLERANCE = 1e-5  # a batch of another size blocks its matrix products otherwise: not bit-exact


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=4, help="the batch, shared by the 2 ranks")
    parser.add_argument("--size", type=int, default=128, help="image width and height, a multiple of 16")
    parser.add_argument("--steps", type=int, default=5, help="denoising steps (the first is not timed)")
    parser.add_argument("--slow", type=float, default=0.3, help="rank 1's extra seconds per image and step")
    parser.add_argument("--rounds", type=int, default=1, help="backends started, each making both runs")
    parser.add_argument("--model-dir", help="the pipeline folder (built there when it holds none; default: temporary)")
    return parser.parse_args()


def _run(handle, positive, args) -> tuple[float, DenoiseResult, torch.Tensor]:
    """(seconds per step after the first, the run's result, its latent)."""
    marks: dict[int, float] = {}

    def on_progress(done: int, total: int, text: str | None = None) -> None:
        if total == args.steps and done not in marks:
            marks[done] = time.perf_counter()

    results: list[DenoiseResult] = []
    latent = jobs.sample(
        handle,
        positive,
        seed=0,
        steps=args.steps,
        guidance_scale=3.5,
        width=args.size,
        height=args.size,
        batch_size=args.images,
        on_progress=on_progress,
        on_result=results.append,
    )
    seconds = (marks[args.steps] - marks[1]) / (args.steps - 1)
    return seconds, results[0], latent


def _round(args) -> tuple[float, float, DenoiseResult, DenoiseResult, float]:
    """One fresh backend: (even s/step, by-speed s/step, both results, the images' largest difference)."""
    spec = default_spec(ranks=2, device="cpu", memory_policy="resident")
    try:
        positive = jobs.encode_prompt(spec, model=MODEL, prompt=PROMPT, max_sequence_length=64)
        handle = jobs.plan_transformer(spec, model=MODEL, strategy="data_parallel")
        even_s, even, even_latent = _run(handle, positive, args)
        speed_s, by_speed, speed_latent = _run(handle, positive, args)
    finally:
        shutdown_backend()
    return even_s, speed_s, even, by_speed, float((even_latent - speed_latent).abs().max())


def main() -> int:
    args = _parse_args()
    if args.images < 2 or args.steps < 2:
        sys.exit("--images and --steps must be 2 or more (each rank makes an image; the first step is not timed)")
    scratch = tempfile.mkdtemp(prefix="bench-mixed-")
    failed = False
    try:
        serve_bench_model(args.model_dir, scratch, MODEL)
        os.environ[TEST_OPS_ENV] = "1"
        os.environ[SLOW_RANK_ENV] = f"1:{args.slow}"
        print(
            f"data_parallel on 2 CPU ranks, {args.images} images of {args.size}², {args.steps} steps; rank 1 slowed by "
            f"{args.slow} s per image and step; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
        print(f"{'round':>5}  {'even split':>16}  {'split by speed':>22}  {'by speed / even':>15}  images differ by")
        ratios = []
        for i in range(args.rounds):
            even_s, speed_s, even, by_speed, diff = _round(args)
            ratios.append(speed_s / even_s)
            failed |= diff > TOLERANCE or even.split.source != "even" or by_speed.split.source != "measured"
            print(
                f"{i + 1:>5}  {even_s:>6.3f} s/step {even.split.images!s:>6}  {speed_s:>6.3f} s/step "
                f"{by_speed.split.images!s:>12}  {ratios[-1]:>14.2f}×  {diff:.1e}"
            )
            print(f"       {by_speed.split.describe()}")
        print(f"median by speed / even: {statistics.median(ratios):.2f}×" + ("  (IMAGES DIFFER)" if failed else ""))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
