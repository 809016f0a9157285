#!/usr/bin/env python3
"""Wan 2.1 at a video-like token count: per-step time of one process, Ulysses 2 and cfg_parallel 2, in one run.

    python bench/wan.py [--frames 17] [--size 192] [--steps 3] [--repeats 3] [--layers 2] [--threads 1] [--json]

A random Wan 2.1 ``WanPipeline`` folder: ``families.wan.tiny.make_tiny_model``'s (its UMT5 encoder, video VAE and
UniPC scheduler) with the transformer rebuilt wider, 8 heads × 64 (``--layers`` blocks, FFN 4× wide), so that matrix
products and attention over the clip's tokens, not Python, fill a step. 17 frames at 192² are 5 latent frames of
12 × 12 patches: 720 tokens of self-attention per pass. One prompt and a negative prompt, encoded once on a 2-rank
backend; true CFG (``--cfg``, two transformer passes per step) in every row:

* ``one process``: the Wan adapter's own ``denoise`` (what a rank runs) on a transformer loaded in this process:
  no backend, no collectives (bench/strategies.py's reasons: only an in-process run can alternate with the backend's).
* ``ulysses2``: ``context_parallel`` Ulysses over the 2 ranks (both CFG passes on each, half the tokens each).
* ``cfg_parallel2``: the positive pass on one rank, the negative on the other.

Step times as in bench/strategies.py (``step_intervals``: the S-1 intervals between step ends, from the pipeline's
callback in-process and the backend's progress events otherwise). Each row's runs alternate with one-process runs
(which one goes first alternates too), so the shared machine's noise hits both; the ratio is against those adjacent
runs, ``paired`` the median of the per-run ratios, and every run is printed so the spread shows.

The decode: a clip of the same frames at ``--decode-size`` (default 320²: 2 × 2 of the Wan VAE's 256-pixel tiles)
through VAEDecodeSingleGPU's step on the same backend, side by side in one run: ``one rank`` (the plain decode on
rank 0) and ``over 2 ranks`` (``decode_over_ranks``: diffusers' tiled decode, the tiles shared over the ranks),
``--decode-repeats`` runs each, alternating. Each rank reports its peak memory during the decode above what it held
before it (the VAE's weights not counted; on the CPU its resident set: ``VmHWM`` after a reset through
``/proc/self/clear_refs``, above ``VmRSS`` once ``malloc_trim`` has handed back what glibc kept); printed as ratios to
the one-rank decode's peak, with the time ratio. On the CPU a rank's resident set also holds diffusers' join of the
tiles, which a GPU rank keeps in host memory (``worker/vae_tiles.py``).
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=17, help="clip length, 4k + 1 (default 17: 5 latent frames)")
    parser.add_argument("--size", type=int, default=192, help="width and height, a multiple of 16 (default 192)")
    parser.add_argument("--steps", type=int, default=3, help="denoising steps per run, ≥ 3; the first is not timed")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row (default 3)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--cfg", type=float, default=4.0, help="true CFG scale, > 1 (default 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the one process and of each rank")
    parser.add_argument(
        "--vae",
        choices=("tiny", "wan21"),
        default="tiny",
        help="the decode's VAE: the tiny builder's (base width 4) or Wan 2.1's own config (96, 2 residual blocks), "
        "random weights (default tiny)",
    )
    parser.add_argument(
        "--decode-size", type=int, default=320, help="the decode's width and height, a multiple of 16 (default 320)"
    )
    parser.add_argument("--decode-repeats", type=int, default=2, help="runs of each decode row (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if args.steps < 3 or args.repeats < 1 or args.layers < 1 or args.threads < 1:
        parser.error("--steps must be at least 3 (two timed steps), --repeats, --layers and --threads at least 1")
    if args.frames < 1 or args.frames % 4 != 1:
        parser.error("--frames must be 4k + 1 (Wan's VAE compresses time 4×, keeping the first frame)")
    if args.size < 16 or args.size % 16 or args.decode_size < 16 or args.decode_size % 16:
        parser.error("--size and --decode-size must be multiples of 16")
    if args.decode_repeats < 1:
        parser.error("--decode-repeats must be at least 1")
    if args.cfg <= 1:
        parser.error("--cfg must be above 1: cfg_parallel splits the two CFG passes")
    return args


ARGS = _parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    # Before torch is imported and the backend starts (the launcher copies this environment to torchrun).
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)

import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

# Runnable as a plain script from a checkout: the package is not necessarily installed in the venv.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.strategies import Strategy, _median_ms, alternate, load_average, step_intervals  # noqa: E402
from parallel_runtime import BackendSpec, get_backend, jobs, shutdown_backend  # noqa: E402
from parallel_runtime.families import Placement, family  # noqa: E402
from parallel_runtime.families.wan.tiny import make_tiny_model  # noqa: E402
from parallel_runtime.samplers import Sampler  # noqa: E402
from parallel_runtime.wire import Sampling  # noqa: E402

wan = family("wan")
MODEL = "bench-wan21"
PROMPT, NEGATIVE = "a red cat walks on a blue sky", "a blurry painting"
TEXT_TOKENS = 32
ROWS = [
    Strategy("ulysses2", 2, {"strategy": "context_parallel", "ring_degree": 1, "ulysses_degree": 2}),
    Strategy("cfg_parallel2", 2, {"strategy": "cfg_parallel"}),
]


def build(model_dir: str, layers: int, vae: str) -> dict:
    """The tiny Wan 2.1 folder with its transformer replaced by a wider random one (and with ``vae`` "wan21", its
    VAE by one of Wan 2.1's own config); the transformer's config."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from bench.random_flux import _draw

    make_tiny_model(model_dir, 0)
    tiny = WanTransformer3DModel.load_config(model_dir, subfolder="transformer")
    config = {
        k: v for k, v in tiny.items() if not k.startswith("_")
    } | {  # text_dim stays the tiny UMT5's: only the text embedder reads it
        "num_attention_heads": 8,
        "attention_head_dim": 64,
        "ffn_dim": 2048,
        "freq_dim": 256,
        "num_layers": layers,
        "rope_max_seq_len": 1024,
    }
    torch.manual_seed(0)
    transformer = WanTransformer3DModel.from_config(config)
    _draw(transformer)  # std 1/sqrt(fan_in): activations keep their scale through the blocks
    shutil.rmtree(os.path.join(model_dir, "transformer"))
    transformer.save_pretrained(os.path.join(model_dir, "transformer"), safe_serialization=True)
    if vae == "wan21":
        shutil.rmtree(os.path.join(model_dir, "vae"))
        AutoencoderKLWan().save_pretrained(os.path.join(model_dir, "vae"), safe_serialization=True)  # its defaults
    return config


def sampling(args: argparse.Namespace) -> dict:
    """The generation every side runs: the nodes' sampler widgets."""
    return {
        "seed": args.seed,
        "steps": args.steps,
        "guidance_scale": 1.0,  # FLUX's distilled guidance: not Wan's
        "true_cfg_scale": args.cfg,
        "width": args.size,
        "height": args.size,
        "sampler": Sampler.UNI_PC.value,
    }


class OneProcess:
    """The Wan adapter's denoise loop in this process on the CPU: what every rank runs, without a backend."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.transformer = wan.load_transformer(model_dir, torch.float32, Placement("cpu"))

    def run(self, conditioning: jobs.Conditioning, args: argparse.Namespace) -> list[float]:
        marks: list[float] = []
        widgets = sampling(args)
        widgets["sampler"] = Sampler(widgets["sampler"])
        wan.denoise(
            self.model_dir,
            self.transformer,
            conditioning.tensors,
            Sampling(**widgets, frames=args.frames),
            on_step=lambda step, total: marks.append(time.perf_counter()),
        )
        return step_intervals(marks, args.steps)


def backend_run(handle: jobs.TransformerHandle, conditioning: jobs.Conditioning, args: argparse.Namespace) -> list:
    """One clip through the nodes' sampler call; step times from the backend's progress events (labels dropped)."""
    marks: list[float] = []

    def on_progress(step: int, total: int, text: str | None) -> None:
        if text is None:
            marks.append(time.perf_counter())

    jobs.sample(handle, conditioning, **sampling(args), length=args.frames, on_progress=on_progress)
    return step_intervals(marks, args.steps)


def bench_row(
    strategy: Strategy,
    spec: BackendSpec,
    conditioning: jobs.Conditioning,
    one: OneProcess,
    args: argparse.Namespace,
    log: Callable[[str], None],
) -> dict:
    handle = jobs.plan_transformer(spec, model=MODEL, **strategy.load)
    sides: list[tuple[str, Callable[[], list[float]]]] = [
        ("strategy", lambda: backend_run(handle, conditioning, args)),
        ("one", lambda: one.run(conditioning, args)),
    ]
    runs = alternate(sides, args.repeats, strategy.name, log)
    per_run = [statistics.median(s) / statistics.median(o) for s, o in zip(runs["strategy"], runs["one"])]
    return {
        "name": strategy.name,
        "ranks": strategy.ranks,
        "step_s": runs["strategy"],
        "one_step_s": runs["one"],
        "ms": _median_ms(runs["strategy"]),
        "one_ms": _median_ms(runs["one"]),
        "ratio": _median_ms(runs["strategy"]) / _median_ms(runs["one"]),
        "per_run_ratios": per_run,
        "paired_ratio": statistics.median(per_run),
    }


DECODE_ROWS = (("one rank", False), ("over 2 ranks", True))


def decode_rows(spec: BackendSpec, args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """A random clip latent of ``--frames`` at ``--decode-size`` decoded by VAEDecodeSingleGPU's step, plainly on one
    rank and over the ranks, alternating: seconds, tiles and each rank's peak memory above its VAE's weights."""
    side = args.decode_size // 8
    latent_frames = (args.frames - 1) // 4 + 1
    samples = torch.randn(1, 16, latent_frames, side, side, generator=torch.Generator().manual_seed(args.seed))
    results: dict[str, list] = {name: [] for name, _ in DECODE_ROWS}

    def timed(name: str, over: bool) -> Callable[[], list[float]]:
        def run() -> list[float]:
            start = time.perf_counter()
            jobs.decode(spec, model=MODEL, samples=samples, decode_over_ranks=over, on_result=results[name].append)
            return [time.perf_counter() - start]

        return run

    for _, over in DECODE_ROWS:  # every rank loads its VAE outside the measure
        jobs.decode(spec, model=MODEL, samples=samples[:, :, :1, :8, :8], decode_over_ranks=over)
    runs = alternate([(name, timed(name, over)) for name, over in DECODE_ROWS], args.decode_repeats, "decode", log)
    rows = []
    for name, _ in DECODE_ROWS:
        peaks = [max(ranks) for ranks in zip(*(r.peak_bytes_per_rank for r in results[name]))]
        rows.append(
            {
                "name": name,
                "seconds": statistics.median(s for run in runs[name] for s in run),
                "tiles_per_rank": list(results[name][0].tiles_per_rank),
                "peak_bytes_per_rank": peaks,
            }
        )
    one_s, one_peak = rows[0]["seconds"], rows[0]["peak_bytes_per_rank"][0]
    for row in rows:
        row["time_ratio"] = row["seconds"] / one_s
        row["peak_ratios"] = [p / one_peak for p in row["peak_bytes_per_rank"]]
    return {
        "frames": args.frames,
        "size": args.decode_size,
        "image_bytes": args.frames * args.decode_size**2 * 3 * 4,
        "rows": rows,
    }


def run(args: argparse.Namespace, scratch: str, log: Callable[[str], None]) -> dict:
    model_dir = os.path.join(scratch, MODEL)
    t0 = time.monotonic()
    config = build(model_dir, args.layers, args.vae)
    log(f"model: built in {time.monotonic() - t0:.0f} s")
    os.environ["COMFY_PARALLEL_MODELS"] = os.pathsep.join(
        [scratch] + [p for p in os.environ.get("COMFY_PARALLEL_MODELS", "").split(os.pathsep) if p]
    )
    latent_frames = (args.frames - 1) // 4 + 1
    report: dict = {
        "frames": args.frames,
        "size": args.size,
        "tokens": latent_frames * (args.size // 16) ** 2,
        "steps": args.steps,
        "repeats": args.repeats,
        "threads": args.threads,
        "cfg": args.cfg,
        "vae": args.vae,
        "decode_repeats": args.decode_repeats,
        "transformer": {k: config[k] for k in ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim")},
        "cpus": os.cpu_count(),
        "rows": [],
    }
    spec = BackendSpec(ranks=2, device="cpu", memory_policy="staged")
    try:
        backend = get_backend(spec)
        backend.start()
        report["startup_s"] = backend.startup_s
        conditioning = jobs.encode_prompt(
            spec, model=MODEL, prompt=PROMPT, negative_prompt=NEGATIVE, max_sequence_length=TEXT_TOKENS
        )
        one = OneProcess(model_dir)
        for strategy in ROWS:
            report["rows"].append(bench_row(strategy, spec, conditioning, one, args, log))
        report["decode"] = decode_rows(spec, args, log)
    finally:
        shutdown_backend()
    report["loadavg"] = load_average()
    return report


def print_report(report: dict) -> None:
    t = report["transformer"]
    print(
        f"wan benchmark: random Wan 2.1 transformer, {t['num_layers']} blocks of {t['num_attention_heads']}×"
        f"{t['attention_head_dim']}, FFN {t['ffn_dim']}; {report['frames']} frames at {report['size']}² "
        f"({report['tokens']} tokens), true CFG {report['cfg']} (2 passes per step), {report['steps']} steps × "
        f"{report['repeats']} runs per row"
    )
    print(
        f"cpu: 2-rank backend (up in {report['startup_s']:.1f} s), {report['threads']} thread(s) per process; "
        f"{report['cpus']} cpus, load average at the end {report['loadavg']}"
    )
    print()
    print(f"{'row':>14} {'ranks':>5} {'ms/step':>9} {'one proc':>9} {'ratio':>7} {'paired':>7}  per-run ratios")
    for r in report["rows"]:
        per_run = " ".join(f"{x:.2f}" for x in r["per_run_ratios"])
        print(
            f"{r['name']:>14} {r['ranks']:>5} {r['ms']:>9.1f} {r['one_ms']:>9.1f} {r['ratio']:>6.2f}× "
            f"{r['paired_ratio']:>6.2f}×  {per_run}"
        )
    print(
        f"ms/step: median of steps 2..{report['steps']} over the row's runs; one proc: its own one-process runs, "
        "alternating with them; ratio: ms/step ÷ one proc (below 1 = faster); paired: median of per-run ratios"
    )
    d = report["decode"]
    print()
    print(
        f"decode of a {d['frames']}-frame clip at {d['size']}² ({report['vae']} VAE, IMAGE "
        f"{d['image_bytes'] / 2**20:.1f} MiB), {report['decode_repeats']} run(s) each, alternating:"
    )
    print(f"  {'decode':>14} {'seconds':>8} {'vs one':>7} {'tiles per rank':>15}  peak MiB per rank (vs one rank)")
    for r in d["rows"]:
        peaks = "  ".join(f"{p / 2**20:.0f} ({x:.2f})" for p, x in zip(r["peak_bytes_per_rank"], r["peak_ratios"]))
        tiles = " ".join(map(str, r["tiles_per_rank"])) or "whole"
        print(f"  {r['name']:>14} {r['seconds']:>8.2f} {r['time_ratio']:>6.2f}× {tiles:>15}  {peaks}")
    print("  peak: the most each rank held during the decode above what it held before (its VAE's weights not counted)")


def main() -> int:
    args = ARGS
    torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="pd-wanbench-") as scratch:
        report = run(args, scratch, log)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
