#!/usr/bin/env python3
"""What the node pack costs on top of the same diffusers call: one warm generation, both ways, in one run.

    python bench/overhead.py [--sizes 128 512] [--steps 8] [--repeats 7] [--threads 1] [--json]

The same tiny FLUX.1 generation (prompt, seed, steps, guidance, size) two ways:

* ``nodes``: the four nodes' steps (``parallel_runtime.jobs``: encode → plan transformer → sample → decode, what
  EncodeOnBalancedGPUs → LoadShardedTransformer → ParallelSampler → VAEDecodeSingleGPU call) on a warm 1-rank CPU
  backend with ``memory_policy=resident``, so a
  timed run loads nothing: it is encode + denoise + decode with resident models, plus the pack's socket,
  shared-memory and process hops.
* ``direct``: diffusers' one-shot ``FluxPipeline`` in this process, loaded once, called with the same
  arguments (``output_type="pt"``). The staged node path is bitwise equal to it (DESIGN.md), and the bench
  checks that the two images agree.

Fairness: torchrun gives each rank ``OMP_NUM_THREADS=1`` unless the variable is already set, while an
in-process call uses every core. Both sides get ``--threads`` (set in the environment before torch is
imported and the backend starts, and with ``torch.set_num_threads`` here); the rank's environment is read
back from /proc and printed. The default, 1, is also torchrun's, and it is the stable choice on a shared
machine: OpenMP teams spin-wait, and on two busy cores two threads can make a tiny run 20× slower.

Each side runs once untimed per size (the node path's first run loads the models), then ``--repeats`` timed
runs, alternating which side goes first so a noisy moment hits both alike; the report is medians.
Per-stage split: each node call is timed on the client; on the direct side ``encode_prompt``,
``vae.decode`` and ``image_processor.postprocess`` are wrapped with timers and the rest of the call is
denoise. Target: nodes / direct ≤ 1.10 at 512², on the medians of wall time.

Wall time on a shared machine swings by tens of percent from one minute to the next, so the report also gives
the median of the per-repetition ratios, the ratio of the fastest runs, and CPU time (this process + rank 0,
all threads, from /proc/<pid>/task/*/schedstat), which other programs disturb less. Per stage it also counts
minor page faults: memory that glibc handed back to the kernel after one run and takes again in the next is
paid for in system time on every run, and how much of that a process does depends on its heap's history. The
JSON also has, per stage, the time the working process sat runnable waiting for a CPU (``cpu_wait_ms``) and
wall minus that (``idle_ms``). Exit status 1 if the images differ, a timed run reloaded a model or the backend
left a shared-memory segment behind.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[128, 512],
        metavar="PX",
        help="square image sizes, multiples of 16 (default 128 512)",
    )
    parser.add_argument("--steps", type=int, default=8, help="denoising steps (default 8)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per side and size (default 7)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per side and size first (default 1)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch/OpenMP threads for both sides (default 1, torchrun's own default)"
    )
    parser.add_argument("--guidance", type=float, default=3.5, help="guidance scale (default 3.5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args()
    if any(s < 16 or s % 16 for s in args.sizes):
        parser.error("--sizes must be multiples of 16")
    if args.repeats < 1 or args.steps < 1 or args.threads < 1 or args.warmup < 0:
        parser.error("--repeats, --steps and --threads must be at least 1, --warmup at least 0")
    return args


ARGS = _parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    # Before torch is imported (its OpenMP pool reads these) and before the backend starts (the launcher copies
    # this environment to torchrun, which then leaves OMP_NUM_THREADS alone).
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)

import glob  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

# Runnable as a plain script from a checkout: the package is not necessarily installed in the venv.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel_runtime import default_spec, get_backend, jobs, shutdown_backend  # noqa: E402  # noqa: E402
from parallel_runtime.arena import SHM_DIR  # noqa: E402

MODEL = "tiny-flux"
PROMPT = "a photo of a red cat on a blue sky"
TARGET_SIZE = 512
TARGET_RATIO = 1.10
STAGES = ("encode", "load", "denoise", "decode")
IMAGE_TOLERANCE = 1e-4  # fp32, same ops in the same order; only thread-count-dependent reductions may differ


def _schedstat_of(pid: int) -> tuple[float, float]:
    """(CPU time of all its threads, time its main thread spent runnable but waiting for a CPU) of process
    ``pid``, in seconds; (0, 0) if they cannot be read.

    From the nanosecond counters of /proc/<pid>/task/*/schedstat (/proc/<pid>/stat only counts 10 ms ticks). The
    wait is the main thread's alone (it is the one that runs the model, here and on rank 0): side threads that
    wake now and then wait in parallel with it and would be counted twice."""
    cpu_ns, wait_ns = 0, 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
            cpu_ns += int(fields[0])
            if tid == str(pid):
                wait_ns = int(fields[1])
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended between listdir and open
    return cpu_ns / 1e9, wait_ns / 1e9


def _minor_faults_of(pid: int) -> int:
    """Minor page faults of process ``pid`` so far (fresh pages the kernel had to hand it); 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return 0


def _env_of(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
        return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}
    except OSError:
        return {}


class NodePath:
    """The four nodes, as ComfyUI would call them for one queue run; wall and CPU time around each call."""

    def __init__(self, spec, rank0_pid: int, size: int, steps: int, guidance: float, seed: int):
        self.spec, self.rank0_pid = spec, rank0_pid
        self.size, self.steps, self.guidance, self.seed = size, steps, guidance, seed

    def _clock(self) -> tuple[float, float, float, float]:
        # CPU: this process (client side: validation, arena copies, the wait loop) plus rank 0 (the ops). Waiting
        # for a CPU: rank 0's only, since the client mostly waits for rank 0; the client's own scheduling delays at
        # each call boundary stay in the corrected time, counted as the pack's.
        cpu, wait = _schedstat_of(self.rank0_pid)
        faults = _minor_faults_of(os.getpid()) + _minor_faults_of(self.rank0_pid)
        return time.perf_counter(), time.process_time() + cpu, wait, faults

    def __call__(self) -> tuple[dict[str, dict[str, float]], torch.Tensor]:
        marks = [self._clock()]
        positive = jobs.encode_prompt(self.spec, model=MODEL, prompt=PROMPT)
        marks.append(self._clock())
        transformer = jobs.plan_transformer(self.spec, model=MODEL, strategy="device_map")
        marks.append(self._clock())
        latent = jobs.sample(
            transformer,
            positive,
            seed=self.seed,
            steps=self.steps,
            guidance_scale=self.guidance,
            width=self.size,
            height=self.size,
        )
        marks.append(self._clock())
        image = jobs.decode(self.spec, model=MODEL, samples=latent)
        marks.append(self._clock())
        t: dict[str, dict[str, float]] = {"wall": {}, "cpu": {}, "cpu_wait": {}, "faults": {}}
        for i, kind in enumerate(t):
            t[kind] = {stage: marks[j + 1][i] - marks[j][i] for j, stage in enumerate(STAGES)}
            t[kind]["total"] = marks[-1][i] - marks[0][i]
        return _with_corrected(t), image


class DirectPath:
    """diffusers' one-shot FluxPipeline, loaded once, with timers around its encode and decode stages."""

    def __init__(self, pipe, size: int, steps: int, guidance: float, seed: int):
        self.pipe, self.size, self.steps, self.guidance, self.seed = pipe, size, steps, guidance, seed
        self._spent = self._zero()
        pipe.encode_prompt = self._timed("encode", pipe.encode_prompt)
        pipe.vae.decode = self._timed("decode", pipe.vae.decode)
        pipe.image_processor.postprocess = self._timed("decode", pipe.image_processor.postprocess)

    @staticmethod
    def _zero() -> dict[str, dict[str, float]]:
        return {kind: {"encode": 0.0, "decode": 0.0} for kind in ("wall", "cpu", "cpu_wait", "faults")}

    @staticmethod
    def _clock() -> tuple[float, float, float, float]:
        pid = os.getpid()
        return time.perf_counter(), time.process_time(), _schedstat_of(pid)[1], _minor_faults_of(pid)

    def _timed(self, stage: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = self._clock()
            try:
                return fn(*args, **kwargs)
            finally:
                for kind, now, then in zip(self._spent, self._clock(), start):
                    self._spent[kind][stage] += now - then

        return wrapper

    def __call__(self) -> tuple[dict[str, dict[str, float]], torch.Tensor]:
        self._spent = self._zero()
        start = self._clock()
        image = self.pipe(
            PROMPT,
            num_inference_steps=self.steps,
            guidance_scale=self.guidance,
            width=self.size,
            height=self.size,
            generator=torch.Generator("cpu").manual_seed(self.seed),
            output_type="pt",
        ).images
        totals = {kind: now - then for kind, now, then in zip(self._spent, self._clock(), start)}
        t = self._spent
        for kind, total in totals.items():
            # The pipeline's own encode and decode stages are timed inside the call; the rest is the denoise loop
            # (with its latent preparation and unpacking). Nothing is loaded: the "load" stage is the node's.
            t[kind].update(load=0.0, total=total, denoise=total - t[kind]["encode"] - t[kind]["decode"])
        return _with_corrected(t), image.permute(0, 2, 3, 1)


def _with_corrected(t: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Add ``idle``: wall time minus the time the working process sat runnable, waiting for a CPU that other
    programs held. About what the run would take on an idle machine; on a shared one it is far steadier than wall."""
    t["idle"] = {k: t["wall"][k] - t["cpu_wait"][k] for k in t["wall"]}
    return t


def bench_size(spec, rank0_pid: int, pipe, size: int, args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    paths = (
        ("nodes", NodePath(spec, rank0_pid, size, args.steps, args.guidance, args.seed)),
        ("direct", DirectPath(pipe, size, args.steps, args.guidance, args.seed)),
    )
    images = {}
    for i in range(args.warmup):
        for name, path in paths:
            _, images[name] = path()
        log(f"  {size}²: warm-up {i + 1}/{args.warmup} done")
    runs: dict[str, list] = {"nodes": [], "direct": []}
    for r in range(args.repeats):
        for name, path in paths if r % 2 == 0 else paths[::-1]:  # alternate which side goes first
            t, images[name] = path()
            runs[name].append(t)
        log(
            f"  {size}²: run {r + 1}/{args.repeats}: nodes {runs['nodes'][-1]['wall']['total'] * 1e3:.0f} ms, "
            f"direct {runs['direct'][-1]['wall']['total'] * 1e3:.0f} ms"
        )

    def medians_ms(name: str, kind: str, scale: float = 1e3) -> dict[str, float]:
        return {k: statistics.median(t[kind][k] for t in runs[name]) * scale for k in (*STAGES, "total")}

    row = {
        "size": size,
        "repeats": args.repeats,
        "wall_ms": {name: medians_ms(name, "wall") for name in runs},
        "idle_ms": {name: medians_ms(name, "idle") for name in runs},
        "cpu_ms": {name: medians_ms(name, "cpu") for name in runs},
        "cpu_wait_ms": {name: medians_ms(name, "cpu_wait") for name in runs},
        "page_faults": {name: medians_ms(name, "faults", scale=1) for name in runs},
        "all_wall_ms": {name: [round(t["wall"]["total"] * 1e3, 1) for t in runs[name]] for name in runs},
        "image_max_abs_diff": (images["nodes"] - images["direct"]).abs().max().item(),
    }
    wall, cpu = row["wall_ms"], row["cpu_ms"]
    row["ratio"] = wall["nodes"]["total"] / wall["direct"]["total"]
    # The same ratio per alternating pair, then the median: less sensitive to slow drifts in machine load.
    row["paired_ratio"] = statistics.median(
        n["wall"]["total"] / d["wall"]["total"] for n, d in zip(runs["nodes"], runs["direct"])
    )
    # Best of n: noise from other programs only ever adds time, so the fastest runs come closest to the true cost.
    row["best_wall_ms"] = {name: min(t["wall"]["total"] for t in runs[name]) * 1e3 for name in runs}
    row["best_ratio"] = row["best_wall_ms"]["nodes"] / row["best_wall_ms"]["direct"]
    row["overhead_ms"] = wall["nodes"]["total"] - wall["direct"]["total"]
    row["cpu_ratio"] = cpu["nodes"]["total"] / cpu["direct"]["total"]
    row["idle_ratio"] = row["idle_ms"]["nodes"]["total"] / row["idle_ms"]["direct"]["total"]
    row["images_match"] = row["image_max_abs_diff"] <= IMAGE_TOLERANCE
    if size == TARGET_SIZE:
        row["ratio_ok"] = row["ratio"] <= TARGET_RATIO
        row["idle_ratio_ok"] = row["idle_ratio"] <= TARGET_RATIO
    return row


def _mark(ok: bool | None) -> str:
    return "" if ok is None else ("PASS" if ok else "MISS")


def print_report(report: dict) -> None:
    print(
        f"overhead benchmark: tiny FLUX.1, {report['steps']} steps, guidance {report['guidance']}, "
        f"seed {report['seed']}; {report['cpus']} cpus, load average at the end {report['loadavg']}"
    )
    print(
        f"threads: in-process torch {report['client_threads']}, backend rank 0 OMP_NUM_THREADS="
        f"{report['rank0_omp_num_threads']}; backend: 1 cpu rank, resident, up in {report['startup_s']:.1f} s"
    )
    print()
    target = f"≤{TARGET_RATIO:.2f}@{TARGET_SIZE}²"
    print(
        f"{'size':>5} {'n':>3} {'nodes ms':>9} {'direct ms':>9} {'Δ ms':>7} {'ratio':>7} {target:>11}  "
        f"{'paired':>7} {'best':>7}  {'cpu: nodes ms':>13} {'direct ms':>9} {'ratio':>7}  {'image max|Δ|':>12}"
    )
    for r in report["sizes"]:
        w, c = r["wall_ms"], r["cpu_ms"]
        print(
            f"{r['size']:>4}² {r['repeats']:>3} {w['nodes']['total']:>9.1f} {w['direct']['total']:>9.1f} "
            f"{r['overhead_ms']:>7.1f} {r['ratio']:>6.3f}× {_mark(r.get('ratio_ok')):>11}  "
            f"{r['paired_ratio']:>6.3f}× {r['best_ratio']:>6.3f}×  {c['nodes']['total']:>13.1f} "
            f"{c['direct']['total']:>9.1f} {r['cpu_ratio']:>6.3f}×  {r['image_max_abs_diff']:>12.1e}"
            + ("" if r["images_match"] else "  IMAGES DIFFER")
        )
    print(
        "ms: medians of wall time; ratio: of the medians (what the target judges); paired: median of the "
        "per-repetition ratios; best: fastest nodes run / fastest direct run; cpu: CPU time of this process + rank 0"
    )
    print()
    print(
        "per stage, medians in ms (nodes: around each node call; direct: timers on the pipeline's encode_prompt, "
        "vae.decode + postprocess; the rest is denoise)"
    )
    print(
        f"{'size':>5} {'stage':>8}  {'wall: nodes':>11} {'direct':>8} {'Δ':>7}   "
        f"{'cpu: nodes':>10} {'direct':>8} {'Δ':>7}   {'page faults: nodes':>18} {'direct':>7}"
    )
    for r in report["sizes"]:
        for stage in (*STAGES, "total"):
            (wn, wd), (cn, cd) = ((r[k]["nodes"][stage], r[k]["direct"][stage]) for k in ("wall_ms", "cpu_ms"))
            fn, fd = r["page_faults"]["nodes"][stage], r["page_faults"]["direct"][stage]
            print(
                f"{r['size']:>4}² {stage:>8}  {wn:>11.1f} {wd:>8.1f} {wn - wd:>7.1f}   "
                f"{cn:>10.1f} {cd:>8.1f} {cn - cd:>7.1f}   {fn:>18.0f} {fd:>7.0f}"
            )
    print(
        "(each stage's median is taken on its own, so the stages need not add up to the total; page faults: "
        "minor faults, i.e. fresh 4 KiB pages the kernel had to zero and map, client + rank 0)"
    )
    print()
    verdict = [r for r in report["sizes"] if "ratio_ok" in r]
    if verdict:
        r = verdict[0]
        print(
            f"{TARGET_SIZE}²: nodes/direct {r['ratio']:.3f}× wall (target ≤ {TARGET_RATIO:.2f}×) "
            f"{_mark(r['ratio_ok'])}  [paired {r['paired_ratio']:.3f}×, best {r['best_ratio']:.3f}×, "
            f"cpu {r['cpu_ratio']:.3f}×]"
        )
    else:
        print(f"no {TARGET_SIZE}² row: the target is not judged")


def main() -> int:
    args = ARGS
    torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from diffusers import FluxPipeline
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="pd-overhead-") as root:
        model_dir = make_tiny_flux(os.path.join(root, MODEL), seed=0)
        os.environ["COMFY_PARALLEL_MODELS"] = os.pathsep.join(
            [root] + [p for p in os.environ.get("COMFY_PARALLEL_MODELS", "").split(os.pathsep) if p]
        )
        pipe = FluxPipeline.from_pretrained(model_dir)
        pipe.set_progress_bar_config(disable=True)
        spec = default_spec(ranks=1, device="cpu", memory_policy="resident")
        try:
            backend = get_backend(spec)
            backend.start()
            rank0_pid, shm_prefix = backend.worker_pids[0], backend.shm_prefix
            rank0_env = _env_of(rank0_pid)
            report = {
                "steps": args.steps,
                "guidance": args.guidance,
                "seed": args.seed,
                "cpus": os.cpu_count(),
                "client_threads": torch.get_num_threads(),
                "rank0_omp_num_threads": rank0_env.get("OMP_NUM_THREADS", "?"),
                "startup_s": backend.startup_s,
                "sizes": [],
            }
            for size in args.sizes:
                report["sizes"].append(bench_size(spec, rank0_pid, pipe, size, args, log))
            with open("/proc/loadavg") as f:  # at the end: how busy the machine was while it ran
                report["loadavg"] = " ".join(f.read().split()[:3])
            report["load_counts"] = backend.status().ranks[0].load_counts
        finally:
            shutdown_backend()
    # Warm runs must load nothing: each component once, in the first warm-up.
    report["loads_once"] = all(n == 1 for n in report["load_counts"].values())
    # The runtime promises that no shared-memory segment outlives a shutdown.
    report["leftover_segments"] = sorted(
        os.path.basename(p) for p in glob.glob(os.path.join(SHM_DIR, glob.escape(shm_prefix) + "*"))
    )

    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
        if not report["loads_once"]:
            print(f"warning: the backend reloaded models during the timed runs: {report['load_counts']}")
        if report["leftover_segments"]:
            print(f"warning: shared-memory segments left behind: {', '.join(report['leftover_segments'])}")
    ok = all(r["images_match"] for r in report["sizes"]) and report["loads_once"] and not report["leftover_segments"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
