#!/usr/bin/env python3
"""A prepared check for a machine with one GPU: what the CPU tests cannot show, in one run of a few minutes.

    bench/gpu_check.sh [--out gpu_check.json] [--only attention doctor ...]   # the wrapper: a hard time limit
    python bench/gpu_check.py --device cpu --smoke                            # the same code on CPU, tiny sizes

Each check has its own deadline and reports ``ok``, ``FAILED`` (with why) or ``skipped``; one that fails does not
stop the others, and a check that hangs is ended at its deadline (the ones that start a backend run as a child
process, or clean their backend up on the way out). Everything is printed as one table at the end and saved as JSON.

* ``gpu``: torch, CUDA, cuDNN, NCCL, the GPU, its compute capability and memory. Without a GPU the run stops here.
* ``attention``: every attention backend the pack offers, by the pack's own check (what LoadShardedTransformer would
  refuse, and why) and by a real call through diffusers' dispatcher on the GPU at FLUX.1-dev's head shape in
  bfloat16 (does the kernel run, how long), and what ``auto`` picks for Ring on this GPU.
* ``doctor``: ``comfy-parallel doctor --device cuda --ranks 1`` (status, a timed all-reduce, peer checks, the
  shared-memory round trip), each step with a deadline.
* ``demo``: ``comfy-parallel demo --device cuda --ranks 1``: the nodes' steps on a tiny offline FLUX.1.
* ``nodes``: the nodes' path (encode → sample → decode on a 1-rank CUDA backend, ``device_map`` placement,
  bfloat16) against diffusers' own ``FluxPipeline`` call in this process on the same tiny model: wall time of one
  warm generation both ways (medians, alternating), their ratio, the two images' largest difference (bfloat16:
  equal to rounding, not bitwise), where the transformer was placed, and each stage's peak GPU memory on rank 0.
* ``width``: FLUX.1-dev's real width (24 heads × 128, 3072 wide, 512 text tokens, 1024²) in a few blocks with random
  weights built on the GPU: each double and single block timed with CUDA events, and the whole 19 + 38 block
  transformer's step estimated from them, against the published single-GPU figure (one H100, ≈ 240 ms/step).
* ``host_rss``: that width in 2 + 4 blocks (2.6 GiB, built once on the GPU one block at a time) loaded the way context
  and data parallel ranks load (straight to the rank's GPU): the rank's peak host RSS growth against the model's size.
* ``strategies``: bench/strategies.py on 1 rank on that folder at 1024²: the pack's per-step time on a CUDA rank
  against the same denoise loop in one process (both synchronised with the GPU at every step).
* ``compile``: bench/compile.py on 1 rank on that folder at 1024²: ``compile regional`` (inductor) against eager,
  per step, and the compile time.

Exit status: 0 when every check that ran passed, 1 otherwise, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # runnable as a plain script from a checkout

# One H100, FLUX.1-dev at 1024², 28 steps in 6.71 s (xDiT's published single-GPU figure; bench/README.md).
PUBLISHED_MS_PER_STEP = {"one H100 (xDiT)": 6710 / 28}
FLUX1_DEV = {"num_layers": 19, "num_single_layers": 38, "heads": 24, "head_dim": 128, "text": 4096, "pooled": 768}
PROMPT = "a photo of a red cat on a blue sky"


class CheckFailed(Exception):
    """A check's own finding: it ran, and what it measured is wrong."""


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """TimeoutError in this (main) thread after ``seconds``: a check that hangs in Python is ended; one stuck in a
    driver call is ended by gpu_check.sh's outer limit instead."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"{what} took longer than {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- the checks -----------------------------------------------------------------------------------------------------
def check_gpu(args: argparse.Namespace) -> dict:
    facts: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if args.device == "cpu":
        return {**facts, "summary": "CPU run (--device cpu): the GPU checks run on the CPU at tiny sizes"}
    if not torch.cuda.is_available():
        raise CheckFailed("torch sees no GPU (check the driver, CUDA_VISIBLE_DEVICES, and that torch is a CUDA build)")
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    facts.update(
        gpus=torch.cuda.device_count(),
        name=props.name,
        capability=f"{props.major}.{props.minor}",
        memory_gib=round(total / 2**30, 1),
        free_gib=round(free / 2**30, 1),
        cudnn=torch.backends.cudnn.version(),
        nccl=".".join(map(str, torch.cuda.nccl.version())),
        visible=os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"),
    )
    facts["summary"] = f"{props.name}, sm {facts['capability']}, {facts['free_gib']} of {facts['memory_gib']} GiB free"
    return facts


def check_attention(args: argparse.Namespace) -> dict:
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    from parallel_runtime.errors import InvalidInput
    from parallel_runtime.strategy import (
        ATTENTION_BACKENDS,
        Strategy,
        StrategyPlan,
        TransformerFacts,
        check_attention,
        check_attention_on_gpu,
        ring_attention_backend,
    )

    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    capability = torch.cuda.get_device_capability(0) if cuda else None
    facts = TransformerFacts("FluxTransformer2DModel", heads=24, has_cp_plan=True, has_tp_plan=True)
    tokens = 512 if args.smoke else 4608  # FLUX.1-dev at 1024²: 4096 image + 512 text tokens
    q, k, v = (torch.randn(1, tokens, 24, 128, dtype=getattr(torch, dtype), device=args.device) for _ in range(3))
    rows, ran = {}, 0
    for name in ATTENTION_BACKENDS:
        row: dict = {}
        for ring in (2, 1):
            plan = StrategyPlan(Strategy.CONTEXT_PARALLEL, 2, facts, ring_degree=ring, ulysses_degree=2 // ring,
                                attention_backend=name)  # fmt: skip
            try:
                check_attention(plan, dtype, args.device)
                if capability is not None:
                    check_attention_on_gpu(plan, capability, "GPU 0")
                row["ring" if ring > 1 else "ulysses"] = "offered"
            except InvalidInput as e:
                row["ring" if ring > 1 else "ulysses"] = f"refused ({e.widget}): {e}"
        kernel = None if name == "auto" else name
        if name == "auto":
            kernel = ring_attention_backend(capability) if cuda else "native"
            row["auto_ring_picks"] = kernel
        try:
            backend = AttentionBackendName(kernel)
            dispatch_attention_fn(q, k, v, backend=backend)  # the first call compiles or loads the kernel
            synchronize(args.device)
            t0 = time.perf_counter()
            for _ in range(5):
                out = dispatch_attention_fn(q, k, v, backend=backend)
            synchronize(args.device)
            row["ms"] = round((time.perf_counter() - t0) / 5 * 1e3, 3)
            row["runs"] = bool(torch.isfinite(out).all())
            ran += 1
        except Exception as e:  # not installed, not for this GPU or dtype: what a user would hit
            row["runs"] = False
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows[name] = row
    # What the pack offers must run: a backend it lets through that then fails on the GPU is a bug in its check.
    wrong = [n for n, r in rows.items() if "offered" in (r.get("ring"), r.get("ulysses")) and not r["runs"]]
    result = {"backends": rows, "summary": f"{ran} of {len(rows)} kernels run; offered: " + ", ".join(
        n for n, r in rows.items() if "offered" in (r.get("ring"), r.get("ulysses"))
    )}  # fmt: skip
    if wrong:
        raise CheckFailed(f"offered but failed to run here: {', '.join(wrong)} ({json.dumps(result)})")
    return result


def _tail(output: str | bytes | None, chars: int) -> str:
    """The end of a child's output (TimeoutExpired gives bytes even for a text-mode run)."""
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    return (output or "")[-chars:]


def _cli(args: argparse.Namespace, *argv: str, timeout: float) -> subprocess.CompletedProcess:
    """``comfy-parallel ARGV`` as a child process with a deadline: a hang cannot take the check down with it."""
    cmd = [sys.executable, "-m", "parallel_runtime.cli", *argv]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise CheckFailed(f"{argv[0]} did not finish within {timeout:.0f} s: {_tail(e.stdout, 800)}") from None
    if done.returncode != 0:
        raise CheckFailed(f"{' '.join(argv[:1])} exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
    return done


def check_doctor(args: argparse.Namespace) -> dict:
    done = _cli(args, "doctor", "--device", args.device, "--ranks", "1", "--json", "--step-timeout", "60", timeout=200)
    report = json.loads(done.stdout[done.stdout.index("{") :])
    if not report["ok"]:
        raise CheckFailed(f"doctor: {report['errors']} {report['advice']}")
    return {
        "startup_s": report["startup_s"],
        "collective_s": report.get("collective_s"),
        "roundtrip_s": report.get("roundtrip_s"),
        "summary": f"ok: up in {report['startup_s']} s, all-reduce {report.get('collective_s')} s, round trip "
        f"{report.get('roundtrip_s')} s",
    }


def check_demo(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="pd-gpu-check-demo-") as tmp:
        out = os.path.join(tmp, "demo.png")
        done = _cli(args, "demo", "--device", args.device, "--ranks", "1", "--models", tmp, "--out", out, timeout=240)
        if not os.path.isfile(out):
            raise CheckFailed(f"demo wrote no image: {done.stdout[-800:]}")
    return {"output": done.stdout.strip().splitlines(), "summary": done.stdout.strip().splitlines()[0]}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def check_nodes(args: argparse.Namespace) -> dict:
    """The nodes' steps on a warm 1-rank backend against FluxPipeline in this process, same model, same arguments."""
    from diffusers import FluxPipeline
    from diffusers.utils import logging as diffusers_logging

    from parallel_runtime import BackendSpec, get_backend, jobs, shutdown_backend
    from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux

    diffusers_logging.disable_progress_bar()
    size, steps, repeats = (64, 3, 2) if args.smoke else (512, 8, 3)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    result: dict = {"size": size, "steps": steps, "repeats": repeats, "dtype": str(dtype).removeprefix("torch.")}
    with tempfile.TemporaryDirectory(prefix="pd-gpu-check-nodes-") as root:
        model_dir = make_tiny_flux(os.path.join(root, "tiny-flux"), seed=0)
        os.environ["COMFY_PARALLEL_MODELS"] = root
        pipe = FluxPipeline.from_pretrained(model_dir, dtype=dtype).to("cuda:0" if args.device == "cuda" else "cpu")
        pipe.set_progress_bar_config(disable=True)
        spec = BackendSpec(ranks=1, device=args.device, memory_policy="resident")
        backend = get_backend(spec)
        peaks: dict[str, float] = {}

        def peak(stage: str) -> None:
            memory = backend.status().ranks[0].memory
            if memory.peak_bytes is not None:
                peaks[stage] = max(peaks.get(stage, 0.0), round(memory.peak_bytes / 2**20, 1))

        def nodes() -> torch.Tensor:
            positive = jobs.encode_prompt(spec, model="tiny-flux", prompt=PROMPT)
            peak("encode")
            handle = jobs.plan_transformer(spec, model="tiny-flux", strategy="device_map")
            latent = jobs.sample(handle, positive, seed=0, steps=steps, guidance_scale=3.5, width=size, height=size)
            peak("sample")
            image = jobs.decode(spec, model="tiny-flux", samples=latent)
            peak("decode")
            return image[0].permute(2, 0, 1)

        def direct() -> torch.Tensor:
            out = pipe(PROMPT, num_inference_steps=steps, guidance_scale=3.5, width=size, height=size,
                       generator=torch.Generator("cpu").manual_seed(0), output_type="pt").images  # fmt: skip
            return out[0].float().cpu()

        try:
            backend.start()
            result["startup_s"] = round(backend.startup_s, 2)
            images = {"nodes": nodes(), "direct": direct()}  # warm: the node path loads its models here
            walls: dict[str, list[float]] = {"nodes": [], "direct": []}
            sides = [("nodes", nodes), ("direct", direct)]
            for r in range(repeats):
                for name, run in sides if r % 2 == 0 else sides[::-1]:  # alternate which side goes first
                    synchronize(args.device)
                    t0 = time.perf_counter()
                    images[name] = run()
                    walls[name].append(time.perf_counter() - t0)
            resident = backend.status().ranks[0].resident
        finally:
            shutdown_backend()
    result["wall_ms"] = {k: round(_median(v) * 1e3, 1) for k, v in walls.items()}
    result["ratio"] = round(_median(walls["nodes"]) / _median(walls["direct"]), 3)
    result["max_abs_diff"] = float((images["nodes"] - images["direct"]).abs().max())
    result["placement"] = {m.component: m.placement for m in resident}
    result["peak_mib_by_stage"] = peaks
    result["summary"] = (
        f"nodes {result['wall_ms']['nodes']} ms vs diffusers {result['wall_ms']['direct']} ms (×{result['ratio']}), "
        f"images differ by {result['max_abs_diff']:.4f}, transformer {result['placement'].get('transformer')}, "
        f"peak MiB {peaks}"
    )
    tolerance = 0.03 if dtype == torch.bfloat16 else 1e-5  # bfloat16 kernels: equal to rounding, not bitwise
    if result["max_abs_diff"] > tolerance:
        raise CheckFailed(f"the two images differ by {result['max_abs_diff']} (> {tolerance}): {result}")
    return result


def check_width(args: argparse.Namespace) -> dict:
    """FLUX.1-dev's width in 2 + 4 blocks on the GPU, each block timed with CUDA events; the full model estimated."""
    from diffusers import FluxTransformer2DModel

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, head_dim, text_dim = (4, 32, 64) if args.smoke else (FLUX1_DEV["heads"], FLUX1_DEV["head_dim"], 4096)
    size, text_tokens, double, single = (128, 32, 1, 1) if args.smoke else (1024, 512, 2, 4)
    rope = (head_dim // 8, head_dim * 7 // 16, head_dim * 7 // 16)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # drawn in bfloat16 on the GPU: never a float32 copy first
    try:
        with torch.device(args.device):
            torch.manual_seed(0)
            model = FluxTransformer2DModel(
                num_layers=double, num_single_layers=single, num_attention_heads=heads, attention_head_dim=head_dim,
                joint_attention_dim=text_dim, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=rope,
            ).eval()  # fmt: skip
    finally:
        torch.set_default_dtype(default_dtype)
    image_tokens = (size // 16) ** 2
    inputs = {
        "hidden_states": torch.randn(1, image_tokens, 64, dtype=dtype, device=args.device),
        "encoder_hidden_states": torch.randn(1, text_tokens, text_dim, dtype=dtype, device=args.device),
        "pooled_projections": torch.randn(1, 768, dtype=dtype, device=args.device),
        "timestep": torch.tensor([0.5], device=args.device),
        "guidance": torch.tensor([3.5], device=args.device),
        "img_ids": torch.zeros(image_tokens, 3, device=args.device),
        "txt_ids": torch.zeros(text_tokens, 3, device=args.device),
        "return_dict": False,
    }
    times: dict[str, list[float]] = {}
    pending: list = []  # CUDA events of this forward, read once it has finished

    def timer(kind: str) -> tuple[Callable, Callable]:
        marks: list = []

        def before(module: torch.nn.Module, *_: object) -> None:
            marks.append(torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter())
            if cuda:
                marks[-1].record()

        def after(module: torch.nn.Module, *_: object) -> None:
            start = marks.pop()
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                pending.append((kind, start, end))
            else:
                times.setdefault(kind, []).append((time.perf_counter() - start) * 1e3)

        return before, after

    for kind, blocks in (("double", model.transformer_blocks), ("single", model.single_transformer_blocks)):
        before, after = timer(kind)
        for block in blocks:
            block.register_forward_pre_hook(before)
            block.register_forward_hook(after)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    steps: list[float] = []
    with torch.inference_mode():
        for i in range(2 + (2 if args.smoke else 6)):  # two warm-up forwards
            synchronize(args.device)
            t0 = time.perf_counter()
            model(**inputs)
            synchronize(args.device)
            if i >= 2:
                steps.append((time.perf_counter() - t0) * 1e3)
            for kind, start, end in pending:
                if i >= 2:
                    times.setdefault(kind, []).append(start.elapsed_time(end))
            pending.clear()
            if i < 2:
                times.clear()
    per_block = {kind: _median(v) for kind, v in times.items()}
    measured = _median(steps)
    rest = measured - double * per_block["double"] - single * per_block["single"]
    full = rest + FLUX1_DEV["num_layers"] * per_block["double"] + FLUX1_DEV["num_single_layers"] * per_block["single"]
    result = {
        "blocks": f"{double} double + {single} single",
        "size": size,
        "text_tokens": text_tokens,
        "measured_ms_per_step": round(measured, 2),
        "ms_per_double_block": round(per_block["double"], 3),
        "ms_per_single_block": round(per_block["single"], 3),
        "estimated_full_ms_per_step": round(full, 1),
        "published_ms_per_step": PUBLISHED_MS_PER_STEP,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }
    ((name, published),) = PUBLISHED_MS_PER_STEP.items()
    result["vs_published"] = round(full / published, 3)
    result["summary"] = (
        f"double block {per_block['double']:.2f} ms, single {per_block['single']:.2f} ms: FLUX.1-dev ≈ {full:.0f} "
        f"ms/step here (×{result['vs_published']} of {name}'s {published:.0f} ms)"
    )
    del model
    return result


def _width_model(args: argparse.Namespace) -> str:
    """FLUX.1-dev's width in 2 double + 4 single blocks (2.6 GiB in bfloat16), built once per run on the GPU, one
    block at a time (bench/random_flux.py), for ``host_rss`` and ``strategies``."""
    from bench.random_flux import PRESET_DTYPES, build, preset_config

    preset, blocks = ("bench", (1, 1)) if args.smoke else ("flux1-dev", (2, 4))
    model_dir = os.path.join(args.scratch, f"flux-{preset}-{blocks[0]}x{blocks[1]}")
    if not os.path.isfile(os.path.join(model_dir, "model_index.json")):
        build(model_dir, preset_config(preset, *blocks), dtype=PRESET_DTYPES[preset], device=args.device)
    return model_dir


def _proc_bytes(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def check_host_rss(args: argparse.Namespace) -> dict:
    """Host memory of a CUDA rank while it loads a transformer the way context and data parallel ranks do (straight
    to its GPU): its peak RSS growth against the transformer's size. Loading on the host and moving it afterwards
    would grow it by the whole model."""
    from parallel_runtime import BackendSpec, get_backend, jobs, shutdown_backend
    from parallel_runtime.worker.memory import parameters_in

    model_dir = _width_model(args)
    name = os.path.basename(model_dir)
    os.environ["COMFY_PARALLEL_MODELS"] = os.path.dirname(model_dir)
    model_bytes = parameters_in(os.path.join(model_dir, "transformer")) * (2 if args.device == "cuda" else 4)
    spec = BackendSpec(ranks=1, device=args.device, memory_policy="staged")
    try:
        backend = get_backend(spec)
        backend.start()
        pid = backend.worker_pids[0]
        positive = jobs.encode_prompt(spec, model=name, prompt=PROMPT, max_sequence_length=64)
        handle = jobs.plan_transformer(spec, model=name, strategy="data_parallel")  # 1 rank: the CP/DP load path
        before = _proc_bytes(pid, "VmRSS")
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:  # the rank's peak RSS counts from here
                f.write("5")
            since = "the load"
        except OSError:
            since = "the rank's start (clear_refs refused)"
        jobs.sample(handle, positive, seed=0, steps=1, guidance_scale=3.5, width=256, height=256)
        growth = _proc_bytes(pid, "VmHWM") - before
    finally:
        shutdown_backend()
    result = {
        "model_gib": round(model_bytes / 2**30, 2),
        "rss_before_gib": round(before / 2**30, 2),
        "peak_growth_gib": round(growth / 2**30, 2),
        "share_of_model": round(growth / model_bytes, 3),
        "peak_since": since,
    }
    result["summary"] = (
        f"rank 0's host RSS grew by {result['peak_growth_gib']} GiB at most while loading a {result['model_gib']} GiB "
        f"transformer straight to {args.device} ({result['share_of_model']:.0%} of it)"
    )
    if args.device == "cuda" and growth > 0.5 * model_bytes:
        raise CheckFailed(f"the load went through host memory: {result}")
    return result


def _one_rank_json(args: argparse.Namespace, script: str, model_dir: str, sizing: list[str]) -> dict:
    """The JSON report of a bench script's ``device_map`` row on one rank (a child process with a deadline)."""
    cmd = [sys.executable, os.path.join(HERE, script), "--device", args.device, "--ranks", "1",
           "--strategies", "device_map", "--steps", "5", "--repeats", "2", "--json", "--model-dir", model_dir,
           *sizing]  # fmt: skip
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=270)
    except subprocess.TimeoutExpired as e:
        raise CheckFailed(f"{script} did not finish within 270 s: {_tail(e.stderr, 800)}") from None
    if done.returncode != 0 and "{" not in done.stdout:
        raise CheckFailed(f"{script} exited {done.returncode}: {done.stderr[-1500:]}")
    return json.loads(done.stdout[done.stdout.index("{") :])


def check_strategies(args: argparse.Namespace) -> dict:
    """bench/strategies.py on one rank at FLUX.1-dev's width (2 + 4 blocks): the pack against one process."""
    model_dir = _width_model(args)
    if args.smoke:
        sizing = ["--width", "64", "--height", "64", "--max-sequence-length", "16", "--preset", "bench",
                  "--double-blocks", "1", "--single-blocks", "1"]  # fmt: skip
    else:
        sizing = ["--preset", "flux1-dev", "--double-blocks", "2", "--single-blocks", "4", "--width", "1024",
                  "--height", "1024", "--max-sequence-length", "512"]  # fmt: skip
    report = _one_rank_json(args, "strategies.py", model_dir, sizing)
    (row,) = report["rows"]
    if "ms_per_image_step" not in row:
        raise CheckFailed(f"device_map on one rank: {row.get('error') or row.get('skipped')}")
    if "ratio" not in row:
        raise CheckFailed(f"the one-process baseline: {report.get('one_error')}")
    result = {
        "one_process_ms": round(report["one_ms"], 2),
        "device_map_ms": round(row["ms_per_image_step"], 2),
        "ratio": round(row["ratio"], 3),
        "startup_s": round(report["startup_s"], 1),
    }
    result["summary"] = (
        f"one {args.device} rank {result['device_map_ms']} ms/step vs one process {result['one_process_ms']} ms/step "
        f"(×{result['ratio']})"
    )
    return result


def check_compile(args: argparse.Namespace) -> dict:
    """bench/compile.py on one rank (``device_map``) at FLUX.1-dev's width (2 + 4 blocks): compiled / eager per step,
    and the compile time, with inductor."""
    model_dir = _width_model(args)
    if args.smoke:
        sizing = ["--size", "64", "--max-sequence-length", "16", "--preset", "bench", "--double-blocks", "1",
                  "--single-blocks", "1", "--backend", "aot_eager"]  # fmt: skip
    else:
        sizing = ["--preset", "flux1-dev", "--double-blocks", "2", "--single-blocks", "4", "--size", "1024",
                  "--max-sequence-length", "512"]  # fmt: skip
    (row,) = _one_rank_json(args, "compile.py", model_dir, sizing)["rows"]
    result = {k: round(v, 3) for k, v in row.items() if isinstance(v, float)}
    result["summary"] = (
        f"compiled {result['compiled_ms']} ms/step vs eager {result['eager_ms']} ms/step (×{result['ratio']}); "
        f"compile ≈ {result['compile_s']} s"
    )
    return result


CHECKS: dict[str, tuple[Callable[[argparse.Namespace], dict], float]] = {
    "gpu": (check_gpu, 30),
    "attention": (check_attention, 90),
    "doctor": (check_doctor, 210),
    "demo": (check_demo, 250),
    "nodes": (check_nodes, 240),
    "width": (check_width, 120),
    "host_rss": (check_host_rss, 200),
    "strategies": (check_strategies, 280),
    "compile": (check_compile, 280),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (for trying the script on a CPU)")
    parser.add_argument("--only", nargs="+", choices=sorted(CHECKS), help="run only these checks")
    parser.add_argument("--out", default="gpu_check.json", help="where to save the JSON report")
    args = parser.parse_args()
    report: dict = {"device": args.device, "smoke": args.smoke, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "checks": {}}  # fmt: skip
    scratch = tempfile.TemporaryDirectory(prefix="pd-gpu-check-")  # the width model, built once, removed at the end
    args.scratch = scratch.name
    for name, (check, seconds) in CHECKS.items():
        if args.only and name not in args.only and name != "gpu":
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            with deadline(seconds, name):
                entry = {"status": "ok", **check(args)}
        except Exception as e:
            entry = {"status": "FAILED", "summary": f"{type(e).__name__}: {e}"}
            if not isinstance(e, (CheckFailed, TimeoutError)):
                entry["traceback"] = traceback.format_exc()
        entry["seconds"] = round(time.monotonic() - t0, 1)
        report["checks"][name] = entry
        with open(args.out, "w") as f:  # after every check: a run ended by the outer limit keeps what it had
            json.dump(report, f, indent=2, default=str)
        print(f"    {entry['status']}: {str(entry['summary'])[:300]}", file=sys.stderr, flush=True)
        if name == "gpu" and entry["status"] != "ok":
            break
    scratch.cleanup()
    print()
    print(f"{'check':<11} {'status':<7} {'s':>6}  result")
    for name, entry in report["checks"].items():
        print(f"{name:<11} {entry['status']:<7} {entry['seconds']:>6.1f}  {entry['summary']}")
    print(f"\nsaved: {os.path.abspath(args.out)}")
    if report["checks"]["gpu"]["status"] != "ok":
        return 2
    return 0 if all(e["status"] == "ok" for e in report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
