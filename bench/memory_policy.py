#!/usr/bin/env python3
"""A prompt edit under each memory policy: the whole graph again with a new prompt, ``staged`` against ``auto``.

    python bench/memory_policy.py                 # 2 CPU ranks, random FLUX.1 (bench preset), 256², 4 steps
    python bench/memory_policy.py --rounds 5 --strategy device_map

What ComfyUI re-executes after a prompt edit is every node: encode the new prompt, sample, decode. Under ``staged`` the
encode frees the transformer and the sampler loads it again; under ``auto`` both stay while the memory holds them. The
third row, ``auto`` under ``COMFY_PARALLEL_MEMORY_CAP_GB`` (a cap under which the text encoders do not fit beside the
transformer and its step, ``memory.cap_without_room_for_encoders``), should behave as ``staged``.

Each row starts its own backend (the policy keys it), makes one untimed image, then ``--rounds`` prompt edits, each
timed from the encode's call to the decoded IMAGE in this process; a row reports the median seconds per edit, the
ratio to ``staged``'s, and the transformer and text-encoder loads per edit on rank 0 (from the backend's status).
Every row's last image is checked against ``staged``'s (same prompt, seed and strategy): a difference makes the exit
status 1. The rows run one after another, so a noisy moment on a shared machine hits one row only: take the ratio
from a quiet run, or several.
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
from parallel_runtime import default_spec, get_backend, jobs, shutdown_backend
from parallel_runtime.wire import Sampling
from parallel_runtime.worker import memory

MODEL = "bench-flux"
ROWS = ("staged", "auto", "capped")
PROMPTS = (
    "a photo of a horse in the city at night",
    "a red cat on a blue sky",
    "a green tree on a house",
    "a portrait of an astronaut",
    "a landscape at sunset",
    "a dog with a red tree",
)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--strategy", default="context_parallel", help="the transformer's (LoadShardedTransformer)")
    parser.add_argument("--size", type=int, default=256, help="image width and height, a multiple of 16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="timed prompt edits per row")
    parser.add_argument(
        "--rows", nargs="+", choices=ROWS, default=list(ROWS), help="which rows, in this order (staged always runs)"
    )
    parser.add_argument("--model-dir", help="the pipeline folder (built there when it holds none; default: temporary)")
    return parser.parse_args()


def _graph(spec, args, prompt: str) -> torch.Tensor:
    """Encode, sample, decode: the IMAGE."""
    positive = jobs.encode_prompt(spec, model=MODEL, prompt=prompt, max_sequence_length=64)
    handle = jobs.plan_transformer(spec, model=MODEL, strategy=args.strategy)
    latent = jobs.sample(
        handle, positive, seed=0, steps=args.steps, guidance_scale=3.5, width=args.size, height=args.size
    )
    return jobs.decode(spec, model=MODEL, samples=latent)


def _row(args, policy: str) -> tuple[float, float, float, torch.Tensor]:
    """(median seconds per prompt edit, transformer loads per edit, text-encoder loads per edit, the last image)."""
    spec = default_spec(ranks=args.ranks, device="cpu", memory_policy=policy)
    _graph(spec, args, PROMPTS[0])  # untimed: the first loads
    before = get_backend(spec).status().ranks[0].load_counts
    seconds = []
    for i in range(args.rounds):
        t0 = time.perf_counter()
        image = _graph(spec, args, PROMPTS[1 + i % (len(PROMPTS) - 1)])
        seconds.append(time.perf_counter() - t0)
    after = get_backend(spec).status().ranks[0].load_counts
    shutdown_backend()

    def per_edit(component: str) -> float:
        key = f"{component}:{MODEL}"
        return (after.get(key, 0) - before.get(key, 0)) / args.rounds

    return statistics.median(seconds), per_edit("transformer"), per_edit("text_encoders"), image


def main() -> int:
    args = _parse_args()
    scratch = tempfile.mkdtemp(prefix="bench-memory-policy-")
    failed = False
    try:
        model_dir = serve_bench_model(args.model_dir, scratch, MODEL)

        rows = {}
        for row in dict.fromkeys(args.rows if "staged" in args.rows else ["staged", *args.rows]):
            if row != "capped":
                rows[row] = _row(args, row)
                continue
            spec = default_spec(ranks=args.ranks, device="cpu", memory_policy="auto")
            handle = jobs.plan_transformer(spec, model=MODEL, strategy=args.strategy)
            sampling = Sampling(seed=0, steps=args.steps, guidance_scale=3.5, width=args.size, height=args.size)
            text_tokens = (
                jobs.encode_prompt(spec, model=MODEL, prompt=PROMPTS[0], max_sequence_length=64)
                .tensors["prompt_embeds"]
                .shape[1]
            )
            shutdown_backend()  # the cap reaches the ranks when they start
            cap = memory.cap_without_room_for_encoders(
                handle.family, model_dir, handle.plan, sampling, text_tokens, torch.float32
            )
            os.environ[memory.CAP_ENV] = cap
            try:
                rows[f"auto, cap {float(cap) * 1024:.0f} MiB"] = _row(args, "auto")
            finally:
                del os.environ[memory.CAP_ENV]

        print(f"\nprompt edit → image: FLUX.1 bench preset, {args.strategy}, {args.ranks} CPU ranks, "
              f"{args.size}², {args.steps} steps, median of {args.rounds}")  # fmt: skip
        print(
            f"  {'memory_policy':<24} {'s/edit':>8} {'vs staged':>10} {'transformer loads':>18} {'encoder loads':>14}"
        )
        reference = rows["staged"]
        for name, (seconds, transformer, encoders, image) in rows.items():
            same = torch.equal(image, reference[3])
            failed |= not same
            flag = "" if same else "   image differs from staged's!"
            print(
                f"  {name:<24} {seconds:>8.2f} {seconds / reference[0]:>10.2f} {transformer:>18.1f} "
                f"{encoders:>14.1f}{flag}"
            )
    finally:
        shutdown_backend()
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
