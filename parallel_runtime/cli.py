"""``comfy-parallel``: check a backend, advise a strategy, build tiny offline models, run the demo, join another
machine's backend."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .advisor import GPUS_SYNTAX
from .comfy_files import NO_FILE, WIDGETS
from .families import REGISTRY

DOCTOR_STEP_S = 60.0
P2P_ADVICE = (
    "peer-to-peer between these GPUs is broken here (wrong bytes arrived, or a transfer hung): start ComfyUI with "
    "NCCL_P2P_DISABLE=1 in its environment (the ranks inherit it) so that NCCL goes through host memory instead; "
    "the usual cause is the IOMMU or PCIe ACS, which the machine's BIOS or kernel settings control"
)
COPY_ADVICE = (
    "copies between two GPUs in one process came back wrong: device_map placement moves activations that way, so "
    "prefer data_parallel or context_parallel (with NCCL_P2P_DISABLE=1) until the peer-to-peer path is fixed"
)


def advice_for(pairs: list, failed_step: str | None, device: str) -> list[str]:
    """What to do about the peer-to-peer check's findings (``PeerCopy`` pairs), or about a GPU collective that hung
    (``failed_step``: the step the deadline ended)."""
    advice = []
    if any(not p.ok for p in pairs if p.kind == "collective") or (
        device == "cuda" and failed_step in ("all-reduce", "peer-to-peer")
    ):
        advice.append(P2P_ADVICE)
    if any(not p.ok for p in pairs if p.kind == "copy"):
        advice.append(COPY_ADVICE)
    return advice


def doctor(ranks: int, device: str, step_s: float = DOCTOR_STEP_S) -> dict:
    """Start a backend, run status, a timed all-reduce, a peer-to-peer check of every rank pair (and of every GPU
    pair of rank 0) and a shared-memory round trip, then shut it down; a report dict. Every step has a deadline of
    ``step_s`` (starting, twice that): a step that hangs fails the report, naming the step, instead of waiting."""
    from . import Backend, ParallelRuntimeError
    from .arena import shm_free_bytes
    from .spec import default_spec
    from .watchdog import Deadlines
    from .wire import AllreduceArgs, EchoArgs, PeersArgs

    spec = default_spec(device=device, ranks=ranks)
    pairs: list = []
    report: dict = {
        "world_size": None,
        "device": spec.device,
        "ranks": [],
        "startup_s": None,
        "collective_ok": False,
        "peers_ok": False,
        "peers": [],
        "roundtrip_ok": False,
        "shm_free_gib": round(shm_free_bytes() / 2**30, 2),
        "errors": [],
        "advice": [],
    }
    backend = Backend(
        spec, startup_timeout=2 * step_s, deadlines=Deadlines(load_s=step_s, stall_floor_s=step_s, cancel_s=step_s)
    )
    step = "start"
    last_progress: list[str] = []

    def timed_call(name: str, args: object, **kwargs: Any) -> Any:
        nonlocal step
        step = name
        return backend.call(
            args, timeout=step_s, on_progress=lambda s, t, text: text and last_progress.append(text), **kwargs
        )

    try:
        backend.start()
        report["startup_s"] = round(backend.startup_s, 3)
        step = "status"
        status = backend.status()
        report["world_size"] = status.world_size
        report["ranks"] = [
            {
                "rank": r.rank,
                "device": r.device,
                "device_name": r.device_name,
                "pid": r.pid,
                "hostname": r.hostname,
                "memory_free_gib": round(r.memory.free_bytes / 2**30, 2),
                "memory_total_gib": round(r.memory.total_bytes / 2**30, 2),
            }
            for r in status.ranks
        ]
        x = torch.arange(1024, dtype=torch.float32)
        t0 = time.perf_counter()
        reduced = timed_call("all-reduce", AllreduceArgs(), tensors={"x": x})
        report["collective_s"] = round(time.perf_counter() - t0, 4)
        report["collective_ok"] = torch.equal(reduced.tensors["x"], x * reduced.result.expected_factor)
        pairs = [p for r in timed_call("peer-to-peer", PeersArgs()).per_rank if r is not None for p in r.pairs]
        report["peers"] = [dataclasses.asdict(p) for p in pairs]
        report["peers_ok"] = all(p.ok for p in pairs)
        sent = {
            "float32": torch.randn(64, 64),
            "bfloat16": torch.randn(8, 8).bfloat16(),
            "uint8": torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8),
            "bool": torch.rand(9) > 0.5,
            "int64": torch.arange(5),
            "big": torch.randn(16 << 20 >> 2),
        }
        t0 = time.perf_counter()
        back = timed_call("shared-memory round trip", EchoArgs(), tensors=sent).tensors
        report["roundtrip_s"] = round(time.perf_counter() - t0, 4)
        report["roundtrip_ok"] = all(torch.equal(back[k], v) for k, v in sent.items())
    except ParallelRuntimeError as e:
        where = f" (at {last_progress[-1]})" if step == "peer-to-peer" and last_progress else ""
        report["errors"].append(f"{step}{where}: {e}")
        report["failed_step"] = step
    finally:
        backend.shutdown()
    report["advice"] = advice_for(pairs, report.get("failed_step"), spec.device)
    report["ok"] = (
        not report["errors"]
        and report["collective_ok"]
        and report["peers_ok"]
        and report["roundtrip_ok"]
        and report["world_size"] == spec.world_size
    )
    return report


def _print_doctor(report: dict) -> None:
    print(f"backend: {report['world_size']} ranks on {report['device']}, up in {report['startup_s']} s")
    for r in report["ranks"]:
        print(
            f"  rank {r['rank']}: {r['device']} ({r['device_name']}) pid {r['pid']} on {r['hostname']}, "
            f"{r['memory_free_gib']} of {r['memory_total_gib']} GiB free"
        )
    timing = f" ({report['collective_s'] * 1000:.1f} ms)" if "collective_s" in report else ""
    print(f"collective (all-reduce): {'ok' if report['collective_ok'] else 'FAILED'}{timing}")
    for p in report["peers"]:
        between = f"ranks {p['source']} and {p['target']}" if p["kind"] == "collective" else (
            f"GPU {p['source']} to GPU {p['target']} (one process"
            + (", direct peer access)" if p["peer_access"] else ", through the host)")
        )  # fmt: skip
        rate = p["nbytes"] / p["seconds"] / 1e9 if p["seconds"] else 0.0
        print(f"peer-to-peer, {between}: " + (f"ok, {rate:.2f} GB/s" if p["ok"] else f"FAILED: {p['error']}"))
    print(f"/dev/shm free: {report['shm_free_gib']} GiB (tensors to and from the backend live there)")
    print(
        f"shared-memory round trip: {'ok' if report['roundtrip_ok'] else 'FAILED'}"
        + (f" ({report['roundtrip_s'] * 1000:.1f} ms for 16 MB + small tensors)" if "roundtrip_s" in report else "")
    )
    for e in report["errors"]:
        print(f"error: {e}")
    for a in report["advice"]:
        print(f"advice: {a}")
    print("OK" if report["ok"] else "FAILED")


T = TypeVar("T")
DEFAULT_MODELS_DIR = os.path.join(os.path.expanduser("~"), ".cache", "comfyui-parallel-diffusers", "models")
# Beside the tiny model, not in the folder it is run from (often the pack's own checkout, which it littered).
DEFAULT_DEMO_OUT = os.path.join(os.path.dirname(DEFAULT_MODELS_DIR), "demo.png")
DEMO_MODEL = "tiny-flux"


def demo(ranks: int, device: str, out: str, models_dir: str, steps: int, size: int, seed: int) -> dict:
    """The nodes' steps (``jobs``, what each node calls) on a tiny random FLUX.1 (built offline if missing): writes
    ``out`` and returns timings."""
    from . import current_backend, default_spec, get_backend, jobs, shutdown_backend
    from .families.tiny import make_tiny_model  # diffusers' models: only for the demo

    timings: dict[str, float] = {}
    model_dir = os.path.join(models_dir, DEMO_MODEL)
    if not os.path.isfile(os.path.join(model_dir, "model_index.json")):
        t0 = time.perf_counter()
        make_tiny_model("flux", model_dir)
        timings["build tiny model"] = time.perf_counter() - t0
    os.environ["COMFY_PARALLEL_MODELS"] = os.pathsep.join(
        [models_dir] + [p for p in os.environ.get("COMFY_PARALLEL_MODELS", "").split(os.pathsep) if p]
    )

    def timed(stage: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        timings[stage] = time.perf_counter() - t0
        return result

    try:
        backend = default_spec(device=device, ranks=ranks, memory_policy="staged")
        timed("start backend", lambda: get_backend(backend).start())
        positive = timed(
            "encode (text encoders)", jobs.encode_prompt, backend, model=DEMO_MODEL, prompt="a red cat on a blue sky"
        )
        transformer = timed(
            "validate transformer", jobs.plan_transformer, backend, model=DEMO_MODEL, strategy="device_map"
        )
        latent = timed(
            "sample (load + denoise)",
            jobs.sample,
            transformer,
            positive,
            seed=seed,
            steps=steps,
            guidance_scale=3.5,
            width=size,
            height=size,
        )
        image = timed("decode (VAE)", jobs.decode, backend, model=DEMO_MODEL, samples=latent)
        status = current_backend().status()
    finally:
        shutdown_backend()
    from PIL import Image

    pixels = (image[0].clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    Image.fromarray(pixels).save(out)
    return {
        "out": os.path.abspath(out),
        "timings_s": timings,
        "world_size": status.world_size,
        "devices": [r.device for r in status.ranks],
        "image_shape": list(image.shape),
        "load_counts": status.ranks[0].load_counts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="comfy-parallel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="start a backend, check ranks, collectives and shared memory, shut down")
    p.add_argument("--ranks", type=int, default=0, help="ranks on this machine (default: one per GPU, or 2 on CPU)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--step-timeout", type=float, default=DOCTOR_STEP_S, help="seconds each check may take (start: twice that)"
    )
    p = sub.add_parser(
        "advise",
        help="which strategy suits a model on this machine's GPUs (or declared ones): memory, traffic, step time",
        description="Reads the model's safetensors headers (nothing loads) and lists each strategy with its memory "
        "per GPU, the bytes it sends per step and its expected step time against one GPU, best first. Without "
        "--gpus it measures this machine's GPUs with doctor's checks.",
    )
    p.add_argument("--model", help="a diffusers folder: its path, or its name in ComfyUI's models")
    # ComfyUI's single files take one option per widget of ParallelModelFromComfyFiles, not a comma list: a file name
    # may hold a comma, and each error then names the same input the node has.
    for widget in WIDGETS:
        p.add_argument(
            "--" + widget.replace("_", "-"),
            dest=widget,
            default=NO_FILE,
            help=f"instead of --model: ComfyUI's {widget} file, as ParallelModelFromComfyFiles' widget names it",
        )
    p.add_argument(
        "--comfy-models",
        help="ComfyUI's models directory the files are in (default: COMFY_PARALLEL_COMFY_MODELS, or ComfyUI's own)",
    )
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--length", type=int, default=1, help="a video model's clip in frames, 4k + 1 (Wan: 81)")
    p.add_argument("--gpus", help="declare the GPUs instead of measuring them: " + GPUS_SYNTAX)
    p = sub.add_parser("demo", help="generate an image with the nodes' steps on a tiny offline FLUX.1 model")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu")
    p.add_argument("--out", default=DEFAULT_DEMO_OUT, help="where to write the PNG (default: %(default)s)")
    p.add_argument(
        "--models", default=DEFAULT_MODELS_DIR, help="folder of diffusers models (the tiny one is built here)"
    )
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--size", type=int, default=256, help="width and height, a multiple of 16")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("make-tiny-model", help="build a tiny random-weight pipeline offline (for tests and demos)")
    p.add_argument("family", help="one of: " + ", ".join(f"{a.key} ({a.name})" for a in REGISTRY))
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser(
        "join",
        help="serve as node K of the backends a ComfyUI host starts (the command its Parallel Backend node shows)",
        description="Runs this machine's ranks of every backend the ComfyUI host at RDZV_ENDPOINT starts, until "
        "interrupted. The secret comes from COMFY_PARALLEL_SECRET (or --secret-file), never the command line.",
    )
    p.add_argument("rdzv_endpoint", help="host:port of the ComfyUI host (its Parallel Backend node's rdzv_endpoint)")
    p.add_argument("--node-rank", type=int, required=True, help="this machine's node rank, 1..nnodes-1")
    p.add_argument("--address", help="this machine's address the others reach (default: the one routed to the host)")
    p.add_argument("--secret-file", help="read the secret from this file instead of COMFY_PARALLEL_SECRET")
    p.add_argument("--once", action="store_true", help="leave after one backend instead of waiting for the next")
    args = parser.parse_args(argv)

    if args.command == "join":
        from .machines import main_join

        return main_join(args.rdzv_endpoint, args.node_rank, args.address, args.secret_file, args.once)

    if args.command == "make-tiny-model":
        if args.family not in {a.key for a in REGISTRY}:
            parser.error(f"unknown family {args.family!r}; choose one of {', '.join(a.key for a in REGISTRY)}")
        from .families.tiny import make_tiny_model

        print(make_tiny_model(args.family, args.dir, args.seed))
        return 0
    if args.command == "demo":
        result = demo(args.ranks, args.device, args.out, args.models, args.steps, args.size, args.seed)
        print(
            f"wrote {result['out']} ({result['image_shape'][2]}x{result['image_shape'][1]}) on "
            f"{result['world_size']} ranks ({', '.join(result['devices'])})"
        )
        for stage, seconds in result["timings_s"].items():
            print(f"  {stage:<26} {seconds:7.2f} s")
        print(f"  weights loaded: {result['load_counts']}")
        return 0

    if args.command == "advise":
        from .advisor import advise, measured_box, parse_gpus, read_files, read_model
        from .errors import InvalidInput

        if (args.model is None) == (args.diffusion_model == NO_FILE):
            parser.error("advise takes --model (a diffusers folder) or --diffusion-model with ComfyUI's other files")
        if args.comfy_models:
            os.environ["COMFY_PARALLEL_COMFY_MODELS"] = args.comfy_models
        try:
            if args.model is None:
                model = read_files(*(getattr(args, widget) for widget in WIDGETS))
            else:
                model = read_model(args.model)
            box = parse_gpus(args.gpus) if args.gpus else measured_box(doctor(0, "cuda"))
            print(advise(model, box, args.width, args.height, args.length).text())
        except InvalidInput as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "doctor":
        report = doctor(args.ranks, args.device, args.step_timeout)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_doctor(report)
        return 0 if report["ok"] else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
