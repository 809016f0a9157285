#!/usr/bin/env python3
"""Per-step time of each parallel strategy against one process, on the same model, in one run.

    python bench/strategies.py [--ranks 2|4] [--size 256] [--steps 4] [--repeats 3] [--threads 1] [--json]
    bench/gpu.sh [--ranks N]     # the same on GPUs, at FLUX.1-dev's width and 1024², random weights

One FLUX.1 pipeline folder with a random transformer (bench/random_flux.py; on CPU 2 double + 4 single blocks,
8 heads × 64, wide enough that matrix products rather than Python fill a step), one prompt encoded once on the
backend, then for each strategy the same generation (seed, steps, guidance, size):

* ``one process``: the FLUX.1 adapter's own ``denoise`` (what a rank runs) on a transformer loaded in this process,
  on one device: no backend, no collectives. In-process rather than a 1-rank backend because two backends cannot
  be up at once, so only an in-process run can alternate with the strategies' runs; the backend's own cost per
  step (a progress event, a cancel broadcast) is what the ``device_map`` row shows.
* each strategy on an N-rank backend through ``jobs.load_transformer`` / ``jobs.sample``: ``device_map`` (rank 0
  alone), Ulysses N, Ring N, Unified 2×N/2 (N ≥ 4), tensor parallel N, TP 2 × Ulysses N/2 (``tp_cp``, N ≥ 4, once
  the runtime has it) and data parallel N (a batch of N, one image per rank; reported per image).

Per-step time: the clock reads at each step's end, the pipeline's ``callback_on_step_end`` (in-process: that
callback itself; on the backend: the progress event rank 0 sends from it, read as it reaches this process), and a
run of S steps gives the S-1 intervals from the end of step 1 to the end of step S. So the first step, which carries
the lazy set-up after a load, is dropped, and loading, encoding and what follows the last step (unpacking the
latents, the backend's closing "denoised" event, the result's trip back) are never timed. The backend's events with a
text are labels, not steps ("loading transformer" before step 1, "denoised" after step S): they are not counted, and
a run whose step events do not number S is an error rather than a figure.

Reported: medians, and their ratio strategy / one process (below 1: faster than one process). On CPU (default) each
strategy's runs alternate with one-process runs (which one goes first alternates too), so a noisy moment on a shared
machine hits both; the ratio is taken against those adjacent runs, and ``paired`` is the median of the per-run
ratios. On CUDA the one-process runs come first and their model is freed before the backend loads its own: two
FLUX.1-dev copies on GPU 0 would not fit a 48 GB card, and GPU timings do not drift the way a shared CPU's do.
On CUDA every step end waits for the GPU (``torch.cuda.synchronize``: in the one process here, on the ranks before
they report the step), so the intervals are GPU time, not the launch queue's. A side that runs out of GPU memory
(the one-process copy on GPU 0, or a strategy's row) is reported as such and the others still run.

The one process and each rank run ``--threads`` threads, so N ranks use N cores where the one process uses one (the
GPU picture: N devices against one). On 2 shared CPU cores a ratio below 1 therefore says the second core paid for
the communication, not what speed-up GPUs give; the ratios measure what each strategy costs on top of the compute.

Parameter bytes: each rank's resident transformer (the backend's ``status``; a TP shard counts its local slice),
the largest rank against the full model's bytes in this process.

Exit status 1 if a strategy failed; one the runtime does not offer yet is skipped with a message.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--ranks", type=int, default=2, help="ranks of the backend (default 2; 4 adds Unified and tp_cp)"
    )
    parser.add_argument("--width", type=int, default=256, help="image width, a multiple of 16 (default 256)")
    parser.add_argument("--height", type=int, default=256, help="image height, a multiple of 16 (default 256)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per run, ≥ 3; the first is not timed")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per strategy (default 3)")
    parser.add_argument(
        "--max-sequence-length",
        type=int,
        default=64,
        help="text tokens (default 64; FLUX.1-dev uses 512); a multiple of the ranks for Ulysses/Ring",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch/OpenMP threads of the one process and of each rank (default 1, torchrun's)",
    )
    parser.add_argument("--strategies", nargs="+", metavar="NAME", help="run only these rows (names as printed)")
    parser.add_argument(
        "--model-dir",
        help="a FLUX.1 pipeline folder; built there with random weights when it holds "
        "none (default: a temporary folder)",
    )
    parser.add_argument("--preset", default="bench", help="transformer config to build: bench (CPU) or flux1-dev")
    parser.add_argument("--double-blocks", type=int, help="build with this many double-stream blocks instead")
    parser.add_argument("--single-blocks", type=int, help="build with this many single-stream blocks instead")
    parser.add_argument("--build-only", action="store_true", help="build (or check) the model folder and exit")
    parser.add_argument("--guidance", type=float, default=3.5, help="guidance scale (default 3.5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if args.steps < 3 or args.repeats < 1 or args.ranks < 1 or args.threads < 1:
        parser.error("--steps must be at least 3 (two timed steps), --repeats, --ranks and --threads at least 1")
    if min(args.width, args.height) < 16 or args.width % 16 or args.height % 16:
        parser.error("--width and --height must be multiples of 16")
    return args


ARGS = _parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    # Before torch is imported (its OpenMP pool reads these) and before the backend starts (the launcher copies this
    # environment to torchrun, which then leaves OMP_NUM_THREADS alone): the one process and each rank alike.
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)

import dataclasses  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

# Runnable as a plain script from a checkout: the package is not necessarily installed in the venv.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.random_flux import PRESET_DTYPES, PRESETS, build, preset_config  # noqa: E402
from parallel_runtime import (  # noqa: E402
    BackendSpec,
    InvalidInput,
    ParallelRuntimeError,
    get_backend,
    jobs,
    shutdown_backend,
)
from parallel_runtime.arena import TORCH_DTYPES  # noqa: E402
from parallel_runtime.families import Placement, family  # noqa: E402
from parallel_runtime.strategy import Strategy as Kind  # noqa: E402
from parallel_runtime.wire import Sampling  # noqa: E402

flux = family("flux")

PROMPT = "a photo of a red cat on a blue sky"


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    ranks: int  # ranks doing the work (device_map: rank 0 alone)
    load: dict  # jobs.plan_transformer keyword arguments
    images: int = 1  # images per run; the reported step time is per image


def strategies_for(ranks: int) -> list[Strategy]:
    """Every strategy an N-rank backend can run, at its natural degrees."""
    rows = [Strategy("device_map", 1, {"strategy": "device_map"})]
    if ranks < 2:
        return rows
    cp = {"strategy": "context_parallel"}
    rows += [
        Strategy(f"ulysses{ranks}", ranks, {**cp, "ring_degree": 1, "ulysses_degree": ranks}),
        Strategy(f"ring{ranks}", ranks, {**cp, "ring_degree": ranks, "ulysses_degree": 1}),
    ]
    if ranks >= 4 and ranks % 2 == 0:
        rows.append(Strategy(f"unified2x{ranks // 2}", ranks, {**cp, "ring_degree": 2, "ulysses_degree": ranks // 2}))
    rows.append(Strategy(f"tp{ranks}", ranks, {"strategy": "tensor_parallel", "tp_degree": ranks}))
    if ranks >= 4 and ranks % 2 == 0:
        rows.append(
            Strategy(
                f"tp2xulysses{ranks // 2}",
                ranks,
                {"strategy": "tp_cp", "tp_degree": 2, "ring_degree": 1, "ulysses_degree": ranks // 2},
            )
        )
    rows.append(Strategy(f"data_parallel{ranks}", ranks, {"strategy": "data_parallel"}, images=ranks))
    return rows


def step_intervals(marks: list[float], steps: int) -> list[float]:
    """Seconds between consecutive step ends: steps 2..S of a run (the first step's start is not observed)."""
    if len(marks) != steps:
        raise RuntimeError(f"{len(marks)} step ends were timed for {steps} steps; the bench's timing points are off")
    return [b - a for a, b in itertools.pairwise(marks)]


class OneProcess:
    """The FLUX.1 adapter's denoise loop in this process, on one device: what every rank runs, without a backend."""

    def __init__(self, model_dir: str, dtype: str, device: str):
        self.model_dir, self.device = model_dir, device
        self.transformer = flux.load_transformer(model_dir, TORCH_DTYPES[dtype], Placement(device))
        self.parameter_bytes = sum(p.numel() * p.element_size() for p in self.transformer.parameters())

    def run(self, conditioning: jobs.Conditioning, args: argparse.Namespace) -> list[float]:
        marks: list[float] = []
        sampling = Sampling(
            seed=args.seed, steps=args.steps, guidance_scale=args.guidance, width=args.width, height=args.height
        )

        def on_step(step: int, total: int) -> None:
            if self.device.startswith("cuda"):
                torch.cuda.synchronize(self.device)  # the step's kernels, not their launch
            marks.append(time.perf_counter())

        flux.denoise(self.model_dir, self.transformer, conditioning.tensors, sampling, on_step=on_step)
        return step_intervals(marks, args.steps)


def backend_run(
    handle: jobs.TransformerHandle, conditioning: jobs.Conditioning, args: argparse.Namespace, images: int
) -> list[float]:
    """One generation of ``images`` through the nodes' sampler call; step times from the backend's progress events."""
    marks: list[float] = []

    def on_progress(step: int, total: int, text: str | None) -> None:
        # A step's event carries no text; "loading transformer" (step 0) and "denoised" (step S, sent after the
        # latents are unpacked) are labels. Counting "denoised" added a 1-2 ms interval per run.
        if text is None:
            marks.append(time.perf_counter())

    jobs.sample(
        handle,
        conditioning,
        seed=args.seed,
        steps=args.steps,
        guidance_scale=args.guidance,
        width=args.width,
        height=args.height,
        batch_size=images,
        on_progress=on_progress,
    )
    return step_intervals(marks, args.steps)


def flux_parameter_bytes(model_dir: str, dtype: str) -> int:
    """The whole transformer's parameter bytes in ``dtype``, from its files' headers (nothing is loaded)."""
    from parallel_runtime.worker.memory import parameters_in

    return parameters_in(os.path.join(model_dir, "transformer")) * TORCH_DTYPES[dtype].itemsize


def _transformer_bytes_per_rank(spec: BackendSpec) -> list[int]:
    ranks = get_backend(spec).status().ranks
    return [sum(m.parameter_bytes for m in r.resident if m.component == "transformer") for r in ranks]


def transformer_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "transformer", "config.json")) as f:
        return json.load(f)


def _median_ms(runs: list[list[float]], per: int = 1) -> float:
    return statistics.median(s for run in runs for s in run) * 1e3 / per


def alternate(
    sides: list[tuple[str, Callable[[], list[float]]]], repeats: int, label: str, log: Callable[[str], None]
) -> dict[str, list[list[float]]]:
    """Each side's step times over ``repeats`` runs, the sides taking turns to go first, so that a noisy moment on a
    shared machine hits them alike; each repeat's medians are logged."""
    runs: dict[str, list[list[float]]] = {name: [] for name, _ in sides}
    for r in range(repeats):
        for name, run in sides if r % 2 == 0 else sides[::-1]:
            runs[name].append(run())
        log(
            f"  {label}: run {r + 1}/{repeats}: "
            + ", ".join(f"{name} {_median_ms(runs[name][-1:]):.0f} ms/step" for name in runs)
        )
    return runs


def bench_strategy(
    strategy: Strategy,
    spec: BackendSpec,
    model: str,
    conditioning: jobs.Conditioning,
    one: OneProcess | None,
    args: argparse.Namespace,
    log: Callable[[str], None],
) -> dict:
    """One row: the strategy's runs, alternating with one-process runs when ``one`` is given."""
    row: dict = {"name": strategy.name, "ranks": strategy.ranks, "images": strategy.images, "load": strategy.load}
    if strategy.load["strategy"] not in {k.value for k in Kind}:
        row["skipped"] = f"the runtime has no strategy {strategy.load['strategy']!r} yet"
        return row
    try:
        handle = jobs.plan_transformer(spec, model=model, **strategy.load)
        sides: list[tuple[str, Callable[[], list[float]]]] = [
            ("strategy", lambda: backend_run(handle, conditioning, args, strategy.images))
        ]
        if one is not None:
            sides.append(("one", lambda: one.run(conditioning, args)))
        runs = alternate(sides, args.repeats, strategy.name, log)
        row["parameter_bytes"] = _transformer_bytes_per_rank(spec)
    except InvalidInput as e:  # the model or the size does not fit this strategy: say why, go on
        row["skipped"] = str(e)
        return row
    except ParallelRuntimeError as e:
        row["error"] = f"{type(e).__name__}: {e}"
        log(f"  {strategy.name}: {row['error']}")
        return row
    row["step_s"] = runs["strategy"]
    row["ms_per_image_step"] = _median_ms(runs["strategy"], per=strategy.images)
    if one is not None:
        row["one_step_s"] = runs["one"]
        row["paired_ratio"] = statistics.median(
            statistics.median(s) / strategy.images / statistics.median(o) for s, o in zip(runs["strategy"], runs["one"])
        )
    return row


def prepare_model_dir(args: argparse.Namespace, scratch: str, log: Callable[[str], None]) -> str:
    """The pipeline folder to run: ``--model-dir`` if it holds one whose transformer matches the requested config,
    else built there (or in ``scratch``)."""
    if args.preset not in PRESETS:
        raise SystemExit(f"unknown --preset {args.preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    wanted = preset_config(args.preset, args.double_blocks, args.single_blocks)
    model_dir = os.path.abspath(args.model_dir or os.path.join(scratch, f"flux-{args.preset}"))
    if os.path.isfile(os.path.join(model_dir, "model_index.json")):
        config = transformer_config(model_dir)
        differs = {k: config.get(k) for k, v in wanted.items() if json.loads(json.dumps(v)) != config.get(k)}
        if differs:
            raise SystemExit(
                f"{model_dir} holds another transformer ({differs} where {args.preset} asks for "
                f"{ {k: wanted[k] for k in differs} }); remove it or pick another --model-dir"
            )
        log(f"model: {model_dir} (already built)")
        return model_dir
    device = "cuda" if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    t0 = time.monotonic()
    log(
        f"model: building {args.preset} ({wanted['num_layers']} double + {wanted['num_single_layers']} single blocks) "
        f"in {model_dir}, weights drawn on {device}"
    )
    build(model_dir, wanted, dtype=PRESET_DTYPES[args.preset], device=device)
    log(f"model: built in {time.monotonic() - t0:.0f} s")
    return model_dir


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def run(args: argparse.Namespace, model_dir: str, log: Callable[[str], None]) -> dict:
    model = os.path.basename(model_dir)
    os.environ["COMFY_PARALLEL_MODELS"] = os.pathsep.join(
        [os.path.dirname(model_dir)] + [p for p in os.environ.get("COMFY_PARALLEL_MODELS", "").split(os.pathsep) if p]
    )
    spec = BackendSpec(ranks=args.ranks, device=args.device, memory_policy="staged")
    dtype = "bfloat16" if args.device == "cuda" else "float32"  # what the nodes' dtype "auto" resolves to
    device = "cuda:0" if args.device == "cuda" else "cpu"
    rows = [s for s in strategies_for(args.ranks) if not args.strategies or s.name in args.strategies]
    report = {
        "device": args.device,
        "ranks": args.ranks,
        "width": args.width,
        "height": args.height,
        "steps": args.steps,
        "repeats": args.repeats,
        "max_sequence_length": args.max_sequence_length,
        "threads": args.threads,
        "dtype": dtype,
        "model_dir": model_dir,
        "transformer": {k: v for k, v in transformer_config(model_dir).items() if not k.startswith("_")},
        "interleaved": args.device == "cpu",
        "cpus": os.cpu_count(),
        "rows": [],
    }
    try:
        backend = get_backend(spec)
        backend.start()
        report["startup_s"] = backend.startup_s
        conditioning = jobs.encode_prompt(
            spec, model=model, prompt=PROMPT, max_sequence_length=args.max_sequence_length
        )
        report["full_parameter_bytes"] = flux_parameter_bytes(model_dir, dtype)
        one: OneProcess | None = None
        try:
            one = OneProcess(model_dir, dtype, device)
            log(f"one process: transformer loaded ({one.parameter_bytes / 2**20:.0f} MiB {dtype} on {device})")
            if not report["interleaved"]:
                runs = [one.run(conditioning, args) for _ in range(args.repeats)]
                report["one_step_s"], report["one_ms"] = runs, _median_ms(runs)
                log(f"  one process: {report['one_ms']:.1f} ms/step")
        except torch.OutOfMemoryError as e:  # the whole model on one GPU: the strategies' rows still run
            report["one_error"] = f"out of memory on {device}: {str(e).splitlines()[0]}"
            report["one_ms"] = None
            log(f"  one process: {report['one_error']}")
            one = None
        if not report["interleaved"] and one is not None:
            del one  # free its GPU memory before the ranks load their copies
            one = None
        if args.device == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        for strategy in rows:
            row = bench_strategy(strategy, spec, model, conditioning, one, args, log)
            if "step_s" in row:
                row["parameter_share"] = max(row["parameter_bytes"]) / report["full_parameter_bytes"]
            if "step_s" in row and (row.get("one_step_s") or report.get("one_step_s")):
                # against its own one-process runs (CPU), or the ones made first (CUDA)
                row["one_ms"] = _median_ms(row.get("one_step_s") or report["one_step_s"])
                row["ratio"] = row["ms_per_image_step"] / row["one_ms"]
            report["rows"].append(row)
        if report["interleaved"]:  # every one-process run of the bench, for the table's first line
            one_runs = [run for r in report["rows"] for run in r.get("one_step_s", [])]
            report["one_ms"] = _median_ms(one_runs) if one_runs else None
    finally:
        shutdown_backend()
    report["loadavg"] = load_average()  # at the end: how busy the machine was while it ran
    return report


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, as the benchmarks print them beside their ratios."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def print_report(report: dict) -> None:
    t = report["transformer"]
    print(
        f"strategies benchmark: FLUX.1 transformer {t['num_layers']} double + {t['num_single_layers']} single "
        f"blocks, {t['num_attention_heads']}×{t['attention_head_dim']} wide, "
        f"{report['full_parameter_bytes'] / 2**20:.0f} MiB {report['dtype']}; {report['width']}×{report['height']}, "
        f"{report['max_sequence_length']} text tokens, {report['steps']} steps × {report['repeats']} runs per row"
    )
    print(
        f"{report['device']}: {report['ranks']}-rank backend (up in {report['startup_s']:.1f} s), "
        f"{report['threads']} thread(s) per process; {report['cpus']} cpus, load average at the end "
        f"{report['loadavg']}"
    )
    print()
    print(
        f"{'strategy':>16} {'ranks':>5} {'ms/step':>9} {'one proc':>9} {'ratio':>7} {'paired':>7} {'params/rank':>12}"
    )
    if report["one_ms"] is not None:
        print(f"{'one process':>16} {1:>5} {report['one_ms']:>9.1f}")
    elif "one_error" in report:
        print(f"{'one process':>16} {1:>5}  FAILED: {report['one_error']}")
    for r in report["rows"]:
        if "skipped" in r or "error" in r:
            print(
                f"{r['name']:>16} {r['ranks']:>5}  "
                + (f"skipped: {r['skipped']}" if "skipped" in r else f"FAILED: {r['error'].splitlines()[0]}")
            )
            continue
        paired = f"{r['paired_ratio']:>6.2f}×" if "paired_ratio" in r else f"{'':>7}"
        share = (
            f"{max(r['parameter_bytes']) / 2**20:>6.0f} MiB {r['parameter_share']:>4.0%}"
            if max(r["parameter_bytes"])
            else f"{'':>12}"
        )
        against = f"{r['one_ms']:>9.1f} {r['ratio']:>6.2f}×" if "ratio" in r else f"{'-':>9} {'-':>7}"
        print(
            f"{r['name']:>16} {r['ranks']:>5} {r['ms_per_image_step']:>9.1f} {against} {paired} {share}"
            + (f"   (per image: a batch of {r['images']})" if r["images"] > 1 else "")
        )
    where = (
        "its own one-process runs, alternating with them"
        if report["interleaved"]
        else "the one-process runs made before the backend loaded"
    )
    print(
        f"ms/step: median of steps 2..{report['steps']} over all runs (per image for data parallel); one proc: "
        f"{where}; ratio: ms/step ÷ one proc (below 1 = faster); paired: median of per-run ratios; params/rank: "
        "the largest rank's transformer parameters, and their share of the whole model"
    )


def check_request(args: argparse.Namespace, names: list[str], needs_gpus: bool = True) -> None:
    """Refuse, before anything starts, a CUDA run on fewer GPUs than ``--ranks`` and ``--strategies`` that are not
    among ``names``; then silence diffusers' and transformers' progress bars (the bench prints its own lines)."""
    if args.device == "cuda" and needs_gpus and torch.cuda.device_count() < args.ranks:
        raise SystemExit(
            f"--device cuda --ranks {args.ranks} needs {args.ranks} GPUs; this machine has {torch.cuda.device_count()}"
        )
    unknown = set(args.strategies or ()) - set(names)
    if unknown:
        raise SystemExit(
            f"no strategy {', '.join(sorted(unknown))} at --ranks {args.ranks}; there are {', '.join(names)}"
        )
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def main() -> int:
    args = ARGS
    torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    check_request(args, [s.name for s in strategies_for(args.ranks)], needs_gpus=not args.build_only)
    with tempfile.TemporaryDirectory(prefix="pd-strategies-") as scratch:
        model_dir = prepare_model_dir(args, scratch, log)
        if args.build_only:
            print(f"{model_dir}: {_folder_bytes(model_dir) / 2**30:.2f} GiB")
            return 0
        report = run(args, model_dir, log)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 1 if any("error" in r for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
