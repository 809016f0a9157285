#!/usr/bin/env python3
"""A long session, compressed: N generations with seed changes, new prompts, strategy switches, cancels and injected
rank kills in a random (seeded) order, on a tiny FLUX.1 and a 2-rank CPU backend, through the nodes' steps (``jobs``).

    python bench/soak.py [--runs 200] [--seed 0] [--size 64] [--steps 2] [--every 20] [--json]

Every ``--every`` runs it prints the RSS and open file descriptors (and threads) of this process (the ComfyUI side)
and of each rank. At the end: the growth in percent from run 10 to the last run, for the client over the whole
session and for the ranks over the longest stretch without a restart (a kill restarts them), and every leftover after
shutdown: processes of this client's backends, shared-memory segments, run directories, torchelastic_* directories
in the temp folder that appeared during the session. Not part of the tests (it runs for minutes); exit status 1 when
something was left behind or a run failed in a way the drill did not ask for.
"""

from __future__ import annotations

import argparse
import atexit
import glob
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil

from parallel_runtime import BackendDied, Cancelled, default_spec, get_backend, jobs, shutdown_backend
from parallel_runtime.arena import SHM_DIR
from parallel_runtime.families.tiny import make_tiny_model
from parallel_runtime.launcher import RUN_DIR_PREFIX, SHM_PREFIX

MODEL = "tiny-flux"
PROMPTS = ["a red cat on a blue sky", "a lighthouse at night", "a green tree in the city", "a horse in the snow"]
STRATEGIES = [
    {"strategy": "device_map"},
    {"strategy": "context_parallel", "ulysses_degree": 2},
    {"strategy": "context_parallel", "ring_degree": 2, "ulysses_degree": 1},
    {"strategy": "tensor_parallel"},
    {"strategy": "data_parallel"},
]
# What each run does, with its weight.
EVENTS = {"seed": 62, "prompt": 10, "strategy": 15, "cancel": 8, "kill": 5}


def sample(process: psutil.Process) -> dict:
    with process.oneshot():
        return {
            "rss_mib": process.memory_info().rss / 2**20,
            "fds": process.num_fds(),
            "threads": process.num_threads(),
        }


def growth(first: dict, last: dict) -> dict:
    return {k: round(100.0 * (last[k] - first[k]) / first[k], 2) for k in first}


class Cancel(BaseException):
    """Raised from the progress callback, as ComfyUI's interrupt is."""


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    started = time.time()
    root = tempfile.mkdtemp(prefix="pd-soak-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    os.environ["COMFY_PARALLEL_MODELS"] = root
    make_tiny_model("flux", os.path.join(root, MODEL))
    spec = default_spec(device="cpu", ranks=2)
    me = psutil.Process()
    report: dict = {"runs": args.runs, "seed": args.seed, "events": {k: 0 for k in EVENTS}, "restarts": 0,
                    "unexpected": [], "samples": []}  # fmt: skip
    epoch: list[dict] = []  # the ranks' samples since the last (re)start
    epochs: list[list[dict]] = []
    strategy, prompt, seed = STRATEGIES[0], PROMPTS[0], 0
    positive = None
    try:
        for i in range(1, args.runs + 1):
            event = rng.choices(list(EVENTS), weights=list(EVENTS.values()))[0]
            report["events"][event] += 1
            seed += 1
            if event == "prompt" or positive is None:
                prompt = rng.choice(PROMPTS)
                positive = jobs.encode_prompt(spec, model=MODEL, prompt=prompt, max_sequence_length=16)
            if event == "strategy":
                strategy = rng.choice(STRATEGIES)
            handle = jobs.plan_transformer(spec, model=MODEL, **strategy)
            steps = args.steps * (20 if event in ("cancel", "kill") else 1)
            backend = get_backend(spec)
            progress = None
            if event == "cancel":

                def progress(step: int, total: int, text: str | None) -> None:
                    if step >= 1 and text is None:
                        raise Cancel

            if event == "kill":
                # Struck at a denoising step, not after a timer: a timer could fire after a fast run ended, killing a
                # rank in the next op, which the drill did not ask for. In the first half: the client's last step lags
                # the ranks', so a kill at the last one could land after the run.
                victim, at, struck = rng.choice(sorted(backend.worker_pids.values())), rng.randint(1, steps // 2), []

                def progress(step: int, total: int, text: str | None, victim=victim, at=at, struck=struck) -> None:
                    if step >= at and text is None and not struck:
                        struck.append(step)
                        os.kill(victim, signal.SIGKILL)

            try:
                latent = jobs.sample(handle, positive, seed=seed, steps=steps, guidance_scale=3.5, width=args.size,
                                     height=args.size, batch_size=2, on_progress=progress)  # fmt: skip
                if event in ("cancel", "kill"):
                    report["unexpected"].append(f"run {i}: the {event} did not take")
                jobs.decode(spec, model=MODEL, samples=latent)
            except Cancel:
                pass
            except (BackendDied, Cancelled) as e:
                if event != "kill":
                    report["unexpected"].append(f"run {i}: {type(e).__name__}: {e}")
                report["restarts"] += 1
                epochs.append(epoch)
                epoch = []
                positive = None  # a fresh backend re-encodes
                continue
            ranks = {rank: sample(psutil.Process(pid)) for rank, pid in get_backend(spec).worker_pids.items()}
            epoch.append(ranks)
            if i % args.every == 0 or i in (10, args.runs):
                row = {"run": i, "client": sample(me), "ranks": ranks}
                report["samples"].append(row)
                log(f"run {i:4d}: client {row['client']}; " + "; ".join(f"rank {r} {s}" for r, s in ranks.items()))
        epochs.append(epoch)
        first = next(s for s in report["samples"] if s["run"] >= 10)
        report["client_growth_pct"] = growth(first["client"], report["samples"][-1]["client"])
        longest = max(epochs, key=len)
        if len(longest) > 10:
            report["rank_growth_pct"] = {r: growth(longest[9][r], longest[-1][r]) for r in longest[-1]}
            report["longest_stretch_runs"] = len(longest)
    finally:
        shutdown_backend()
    time.sleep(1.0)
    report["leftovers"] = leftovers(me.pid, started)
    return report


def leftovers(client_pid: int, since: float) -> dict:
    processes = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get("COMFY_PARALLEL_CLIENT_PID") == str(
                    client_pid):  # fmt: skip
                processes.append(p.info["pid"])
        except psutil.Error:
            pass
    segments = [n for n in os.listdir(SHM_DIR) if n.startswith(f"{SHM_PREFIX}-{client_pid}-")]
    run_dirs = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), RUN_DIR_PREFIX + "*")):
        try:
            with open(os.path.join(path, "client.pid")) as f:
                if f.read().strip() == str(client_pid):
                    run_dirs.append(path)
        except OSError:
            pass
    elastic = [
        d for d in glob.glob(os.path.join(tempfile.gettempdir(), "torchelastic_*")) if os.path.getmtime(d) > since
    ]
    return {"processes": processes, "segments": segments, "run_dirs": run_dirs,
            "torchelastic_dirs_since_start": elastic}  # fmt: skip


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="the order of the events")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--every", type=int, default=20, help="print the processes' sizes every this many runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{args.runs} runs: {report['events']}; {report['restarts']} restarts after kills")
        print(f"growth from run 10 to the end: client {report.get('client_growth_pct')}")
        print(
            f"ranks, over their longest stretch without a restart ({report.get('longest_stretch_runs')} runs): "
            f"{report.get('rank_growth_pct')}"
        )
        print(f"left behind: {report['leftovers']}")
        for problem in report["unexpected"]:
            print(f"unexpected: {problem}")
    left = report["leftovers"]
    return 1 if report["unexpected"] or left["processes"] or left["segments"] or left["run_dirs"] else 0


if __name__ == "__main__":
    sys.exit(main())
