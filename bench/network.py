"""What crosses the network per denoising step for each strategy, computed from a FLUX.1 transformer's shape.

    python bench/network.py [--config transformer/config.json] [--size 1024] [--text-tokens 512] [--ranks 2 4 8]

Counts the bytes each rank sends per step (bf16 activations, batch 1, no CFG batch: FLUX.1-dev is guidance-distilled)
in the collectives diffusers 0.42 runs: the arithmetic, and what it counts, is ``parallel_runtime/estimates.py``'s
``step_bytes`` (the strategy advisor, ``comfy-parallel advise``, uses the same).

Without ``--config`` the shape is FLUX.1-dev's (19 double-stream and 38 single-stream blocks, 24 heads of 128). The
per-step compute it is measured against: FLUX.1-dev 1024² takes about 240 ms a step on one H100 (xDiT: 6.71 s for 28
steps), so a link must move a step's bytes in well under that to help.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from parallel_runtime.estimates import step_bytes

FLUX1_DEV = {"num_layers": 19, "num_single_layers": 38, "num_attention_heads": 24, "attention_head_dim": 128}
LINKS_GBIT = {"10 GbE": 10, "25 GbE": 25, "100 Gb IB/RoCE": 100, "400 Gb IB": 400}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a FLUX.1 transformer's config.json (default: FLUX.1-dev's shape)")
    parser.add_argument("--size", type=int, default=1024, help="width = height in pixels")
    parser.add_argument("--text-tokens", type=int, default=512, help="T5 tokens (FLUX.1-dev: 512)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    config = FLUX1_DEV
    if args.config:
        with open(args.config) as f:
            config = json.load(f)
    tokens = (args.size // 16) ** 2  # 8× VAE, 2×2 patches
    what = f"{args.size}² ({tokens} image + {args.text_tokens} text tokens), bf16, batch 1"
    print(f"{what}: MiB each rank sends per step")
    print(f"| strategy | {' | '.join(f'{p} ranks' for p in args.ranks)} | time per step at {args.ranks[0]} ranks |")
    print("|---|" + "---|" * len(args.ranks) + "---|")
    rows = {p: step_bytes(config, tokens, args.text_tokens, p) for p in args.ranks}
    for strategy in rows[args.ranks[0]]:
        sizes = " | ".join(f"{rows[p][strategy] / 2**20:,.0f}" for p in args.ranks)
        first = rows[args.ranks[0]][strategy]
        times = ", ".join(f"{name} {first * 8 / (gbit * 1e9) * 1000:,.0f} ms" for name, gbit in LINKS_GBIT.items())
        print(f"| {strategy} | {sizes} | {times if first else '—'} |")


if __name__ == "__main__":
    main()
