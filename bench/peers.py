#!/usr/bin/env python3
"""The pack side by side with bare diffusers and cache-dit: ms per step of the same generation, in one run.

    python bench/peers.py                        # CPU, 2 ranks: ulysses2, ring2, tp2; then the first-image timings
    python bench/peers.py --strategies ulysses2 --rounds 20 --no-first-image
    bench/gpu.sh peers                           # one rank per GPU, FLUX.1-dev's width, 1024², random weights

For each strategy, three sides make the same image (one FLUX.1 pipeline folder, seed, size, steps, guidance, text
embeddings and threads per process) on N ranks each:

* ``pack``: the nodes' steps in this process (``jobs.plan_transformer`` / ``jobs.sample``, what
  LoadShardedTransformer and ParallelSampler call) on the pack's N-rank backend;
* ``diffusers``: a bare torchrun script (``bench/peer_ranks.py --side diffusers``) parallelising the transformer with
  diffusers' own API (``ParallelConfig(context_parallel_config=ContextParallelConfig(...))``,
  ``from_pretrained(parallel_config=TensorParallelConfig(...))``) and calling ``FluxPipeline``; on CPU with the
  pack's CPU shims, which diffusers 0.42's parallel code needs there;
* ``cache-dit``: the same script with cache-dit's ``enable_cache(..., cache_config=None, parallelism_config=...)``
  (caching off), when cache-dit is installed (``pip install -e ".[peers]"``); otherwise the row says how to get it.

xDiT (xfuser) is reported, not run: on CPU it cannot start (the line under the table says why); on GPUs it is not
wired into this bench yet.

Each side loads once and makes one untimed warm-up image; then come ``--rounds`` rounds, each one image per side, the
sides in rotating order (A B C, B C A, C A B, ...) so that a noisy moment on a shared machine hits every side. On
CUDA the sides run one after another instead (each frees its model before the next loads: three FLUX.1-dev copies
per GPU would not fit), unless ``--interleave``.

The clock, the same on every side: this process reads ``time.perf_counter()`` as each step's message from rank 0
arrives, and rank 0 sends that message from the pipeline's ``callback_on_step_end``: the pack's progress event over
its control socket (the backend's "loading transformer" and "denoised" labels are not steps and are not counted), the
peers' one-line step message over this bench's unix socket. A run of S steps gives the S-1 intervals from the end of
step 1 to the end of step S, so the first step, loading, the text embeddings' trip, unpacking the latents and the
result's trip back are never timed, on any side. ms/step is the median of all of a side's intervals; ``paired`` is the
median over the rounds of (a side's median in the round ÷ bare diffusers' in the same round).

Every side's latents (the last round's, unpacked and scaled as ComfyUI's LATENT) are checked against every other's:
a pair further apart than the dtype's tolerance makes the exit status 1, as does the pack or bare diffusers failing.
A peer that cannot run a strategy (cache-dit's Ring and TP on CPU) is reported with its error, not counted as a
failure of the bench.

The first image (``--no-first-image`` skips it; on the first strategy), before the rounds: from this process with no
backend running (what an idle ComfyUI has: torch and the pack imported, nothing started) through encode,
transformer, sample and decode to the IMAGE tensor, against ``torchrun bench/peer_ranks.py --first-image`` from
launch to its first image (``FluxPipeline`` from the prompt to the image, as a user's script runs); ``--cold`` times
each (default 2), alternating which goes first, each alone on the machine, medians reported. Then warm images,
interleaved as the rounds are (``--first-images`` of each, default 3): the pack with a new seed (what ComfyUI
re-executes when only the seed changes: sampler and decoder) and the whole graph again (every node; under the
default ``staged`` memory policy the text encoders and the transformer reload), against the bare script's next image
from the prompt in its running torchrun group. The two first images are checked against each other too. That is the
pack's ``jobs`` path in this process; ``--comfyui DIR`` adds the same graph queued on a real ComfyUI server from
that checkout (its start not counted; from ``POST /prompt`` on the idle server to ``execution_success``, SaveImage's
PNG included), which adds ComfyUI's own share: validation, its queue, caching.

On 2 CPU cores these figures say what the pack costs against the peers on top of the same computation (overhead
parity), never what speed-up GPUs give: N ranks on N shared cores are never faster than one process.
"""

from __future__ import annotations

import argparse
import os
import sys

SIDES = ("pack", "diffusers", "cache-dit")
CACHE_DIT_TESTED = "1.5.3"  # the version pyproject.toml's [peers] extra pins


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of every side (default 2; on CUDA one per GPU)")
    parser.add_argument("--strategies", nargs="+", metavar="NAME", help="only these (default: ulyssesN ringN tpN)")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES), help="default: all three")
    parser.add_argument("--width", type=int, default=256, help="image width, a multiple of 16 (default 256)")
    parser.add_argument("--height", type=int, default=256, help="image height, a multiple of 16 (default 256)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per image, ≥ 3; the first is not timed")
    parser.add_argument("--rounds", type=int, default=10, help="timed images per side and strategy (default 10)")
    parser.add_argument("--max-sequence-length", type=int, default=64, help="text tokens (default 64)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch/OpenMP threads of each rank (default 1, torchrun's)"
    )
    parser.add_argument("--interleave", action="store_true", help="on CUDA too: all sides resident at once")
    parser.add_argument("--no-first-image", action="store_true", help="skip the cold-start / first-image timings")
    parser.add_argument(
        "--cold", type=int, default=2, help="first images per side from cold, in alternating order (default 2)"
    )
    parser.add_argument("--first-images", type=int, default=3, help="warm images per side, interleaved (default 3)")
    parser.add_argument(
        "--comfyui",
        nargs="?",
        const=os.environ.get("COMFYUI_DIR", ""),
        metavar="DIR",
        help="also time the first image through a real ComfyUI server from this checkout (default $COMFYUI_DIR)",
    )
    parser.add_argument(
        "--model-dir", help="a FLUX.1 pipeline folder; built there with random weights when it holds none"
    )
    parser.add_argument("--preset", default="bench", help="transformer config to build: bench (CPU) or flux1-dev")
    parser.add_argument("--double-blocks", type=int, help="build with this many double-stream blocks instead")
    parser.add_argument("--single-blocks", type=int, help="build with this many single-stream blocks instead")
    parser.add_argument("--guidance", type=float, default=3.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the whole path on FLUX.1's tiny test model, fast: 64², 3 steps, 1 round, 1 warm re-run",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if args.smoke:
        args.width = args.height = 64
        args.steps, args.rounds, args.first_images, args.cold, args.max_sequence_length = 3, 1, 1, 1, 16
    if min(args.rounds, args.threads, args.first_images, args.cold) < 1 or args.steps < 3 or args.ranks < 2:
        parser.error("--steps must be at least 3, --ranks 2, --rounds, --threads, --cold, --first-images 1")
    if min(args.width, args.height) < 16 or args.width % 16 or args.height % 16:
        parser.error("--width and --height must be multiples of 16")
    if args.comfyui is not None and not os.path.isfile(os.path.join(args.comfyui, "main.py")):
        parser.error(f"--comfyui {args.comfyui!r} is not a ComfyUI checkout (no main.py); give its directory")
    if "pack" not in args.sides or "diffusers" not in args.sides:
        parser.error("--sides must include pack and diffusers (the reference); cache-dit is optional")
    return args


ARGS = _parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    # Before torch is imported and before any rank starts (the pack's launcher and torchrun pass this environment
    # on, and torchrun leaves OMP_NUM_THREADS alone when it is set): every rank of every side alike.
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)

import dataclasses  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # runnable as a plain script from a checkout

from bench.strategies import PROMPT, check_request, load_average, prepare_model_dir, step_intervals, transformer_config  # noqa: E402
from parallel_runtime import BackendSpec, get_backend, jobs, shutdown_backend  # noqa: E402
from parallel_runtime.families.tiny import make_tiny_model  # noqa: E402

PEER_RANKS = os.path.join(REPO, "bench", "peer_ranks.py")
API_WORKFLOW = os.path.join(REPO, "example_workflows", "api", "flux1_context_parallel_api.json")
# Largest |Δ| allowed between two sides' latents: the same algorithm on the same inputs, so float32 sides should agree
# to rounding; bfloat16 through a deep model and different attention kernels (Ring: cuDNN or flash) less closely.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
# A PNG from SaveImage against a float image: SaveImage truncates 255·x to 8 bits.
PNG_TOLERANCE = 1 / 255 + 1e-4
START_TIMEOUT_S = 900.0  # a peer group's start and load (a FLUX.1-dev folder reads 22 GiB per rank)
RUN_TIMEOUT_S = 1800.0


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str  # as printed: ulysses2, ring2, tp2
    kind: str  # peer_ranks.py's --strategy
    pack: dict  # jobs.plan_transformer keyword arguments


def strategies_for(ranks: int) -> list[Strategy]:
    cp = {"strategy": "context_parallel"}
    return [
        Strategy(f"ulysses{ranks}", "ulysses", {**cp, "ring_degree": 1, "ulysses_degree": ranks}),
        Strategy(f"ring{ranks}", "ring", {**cp, "ring_degree": ranks, "ulysses_degree": 1}),
        Strategy(f"tp{ranks}", "tp", {"strategy": "tensor_parallel", "tp_degree": ranks}),
    ]


@dataclasses.dataclass
class Run:
    intervals: list[float]  # seconds, steps 2..S
    latents: torch.Tensor


class SideFailed(Exception):
    """A side could not load or run; the message is the error's own last line and where it was raised."""


def summarize_failure(text: str) -> str:
    """The last exception of a traceback or torchrun log (its first sentence) and where it was raised: the deepest
    frame outside torch itself, which is where a peer asked for what this machine lacks."""
    lines = text.splitlines()
    ranks = [line for line in lines if re.match(r"^\[rank\d+\]:", line)]
    # In a torchrun log the ranks' lines carry a [rankN]: prefix; torchrun's own ChildFailedError follows them.
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", line) for line in ranks or lines]
    errors = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt): ", line)]
    frames = [m.groups() for line in lines if (m := re.match(r'^\s*File "([^"]+)", line (\d+), in (\S+)', line))]
    if not errors:
        return " | ".join(line.strip() for line in lines[-3:] if line.strip()) or "no error text"
    error = errors[-1]
    sentence = re.match(r"^(.{40,}?[.!?])\s", error)
    error = sentence.group(1) if sentence else error
    frames = [(re.sub(r"^.*?/(site-packages|dist-packages)/", "", path), line, func) for path, line, func in frames]
    outside_torch = [frame for frame in frames if not frame[0].startswith("torch/")]
    if not (outside_torch or frames):
        return error
    path, line, func = (outside_torch or frames)[-1]
    return f"{error} (at {path}:{line}, {func})"


class PackSide:
    """The nodes' path: a transformer handle and ParallelSampler's call on the pack's backend."""

    name = "pack"

    def __init__(self, spec: BackendSpec, model: str, conditioning: jobs.Conditioning, args: argparse.Namespace):
        self.spec, self.model, self.conditioning, self.args = spec, model, conditioning, args
        self.handle: jobs.TransformerHandle | None = None
        self.load_s = 0.0

    def load(self, strategy: Strategy) -> None:
        self.handle = jobs.plan_transformer(self.spec, model=self.model, **strategy.pack)
        t0 = time.monotonic()
        self.run()  # loads the transformer on every rank: the warm-up image
        self.load_s = time.monotonic() - t0

    def run(self) -> Run:
        marks: list[float] = []

        def on_progress(step: int, total: int, text: str | None) -> None:
            if text is None:  # a step's event; "loading transformer" and "denoised" are labels
                marks.append(time.perf_counter())

        a = self.args
        latents = jobs.sample(
            self.handle,
            self.conditioning,
            seed=a.seed,
            steps=a.steps,
            guidance_scale=a.guidance,
            width=a.width,
            height=a.height,
            on_progress=on_progress,
        )
        return Run(step_intervals(marks, a.steps), latents)

    def close(self) -> None:
        get_backend(self.spec).free()


class PeerSide:
    """A peer's torchrun group (bench/peer_ranks.py --serve): rank 0 talks JSON lines over a unix socket."""

    def __init__(self, name: str, args: argparse.Namespace, model_dir: str, conditioning_file: str, run_dir: str):
        self.name, self.args, self.model_dir = name, args, model_dir
        self.conditioning_file, self.run_dir = conditioning_file, run_dir
        self.proc: subprocess.Popen | None = None
        self.conn: socket.socket | None = None
        self.log_path = ""
        self.load_s = 0.0
        self._buffer = b""

    def load(self, strategy: Strategy) -> None:
        path = os.path.join(self.run_dir, f"{self.name}.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        self.log_path = os.path.join(self.run_dir, f"{self.name}-{strategy.name}.log")
        a = self.args
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.ranks}", PEER_RANKS,
            "--side", self.name, "--strategy", strategy.kind, "--model-dir", self.model_dir, "--device", a.device,
            "--serve", path,
        ]  # fmt: skip
        t0 = time.monotonic()
        with open(self.log_path, "w") as log:
            # Its own session, so close() can end torchrun and its ranks together (and only them).
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while self.conn is None:
                if select.select([listener], [], [], 0.5)[0]:
                    self.conn, _ = listener.accept()
                elif self.proc.poll() is not None:
                    raise SideFailed(self._failure("exited while starting"))
                elif time.monotonic() > deadline:
                    raise SideFailed(f"did not start within {START_TIMEOUT_S:.0f} s (log: {self.log_path})")
        finally:
            listener.close()
            os.unlink(path)
        self._next(deadline)  # "ready": loaded
        self.run()  # the warm-up image
        self.load_s = time.monotonic() - t0

    def _next(self, deadline: float) -> tuple[dict, float]:
        """The next message from rank 0 and the clock when it arrived; SideFailed if the group failed or stopped."""
        while b"\n" not in self._buffer:
            if select.select([self.conn], [], [], 0.5)[0]:
                chunk = self.conn.recv(1 << 16)
                if not chunk:
                    self.proc.wait(timeout=60)
                    raise SideFailed(self._failure("closed its connection"))
                self._buffer += chunk
            elif self.proc.poll() is not None:
                raise SideFailed(self._failure("exited"))
            elif time.monotonic() > deadline:
                raise SideFailed(f"no answer within its deadline (log: {self.log_path})")
        arrived = time.perf_counter()
        line, self._buffer = self._buffer.split(b"\n", 1)
        message = json.loads(line)
        if "error" in message:
            raise SideFailed(summarize_failure(message["error"]))
        return message, arrived

    def _failure(self, what: str) -> str:
        with open(self.log_path, errors="replace") as f:
            text = f.read()
        return summarize_failure(text) if text.strip() else f"{what} with no output (log: {self.log_path})"

    def _request(self, op: str, **fields: object) -> tuple[list[float], float, dict]:
        """Send one request; the clock at each step line and at the "done" line, and the result's tensors."""
        a = self.args
        out = os.path.join(self.run_dir, f"{self.name}-{op}.safetensors")
        request = {"op": op, "steps": a.steps, "guidance": a.guidance, "width": a.width, "height": a.height}
        self.conn.sendall(json.dumps(dict(request, out=out, **fields)).encode() + b"\n")
        deadline = time.monotonic() + RUN_TIMEOUT_S
        marks: list[float] = []
        while True:
            message, arrived = self._next(deadline)
            if "step" in message:
                marks.append(arrived)
            elif "done" in message:
                from safetensors.torch import load_file

                return marks, arrived, load_file(out)

    def run(self) -> Run:
        marks, _, result = self._request("run", seed=self.args.seed, conditioning=self.conditioning_file)
        return Run(step_intervals(marks, self.args.steps), result["samples"])

    def image(self, seed: int) -> tuple[float, torch.Tensor]:
        """Seconds from the request to rank 0's "done" for a whole image from the prompt, and the image."""
        t0 = time.perf_counter()
        _, done, result = self._request("image", seed=seed, prompt=PROMPT, tokens=self.args.max_sequence_length)
        return done - t0, result["images"]

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.conn is not None and self.proc.poll() is None:
                self.conn.sendall(json.dumps({"op": "quit"}).encode() + b"\n")
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            _end_session(self.proc)
        finally:
            if self.conn is not None:
                self.conn.close()
            self.proc = self.conn = None
            self._buffer = b""


def _end_session(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the session this bench started for ``proc`` (torchrun and its ranks)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def cache_dit_problem() -> str | None:
    """Why cache-dit cannot take part, or None. Without einops (its [parallelism] extra) every model fails with "No
    planner registered under name: FluxTransformer2DModel" while the ImportError behind it is logged at debug level."""
    try:
        version = importlib.metadata.version("cache-dit")
    except importlib.metadata.PackageNotFoundError:
        return f'not installed: pip install -e ".[peers]" (cache-dit[parallelism]=={CACHE_DIT_TESTED})'
    if importlib.util.find_spec("einops") is None:
        return (
            f"cache-dit {version} is installed without its [parallelism] extra (einops), so every model would fail "
            '"No planner registered under name: FluxTransformer2DModel"; pip install -e ".[peers]" or '
            f'pip install "cache-dit[parallelism]=={version}"'
        )
    return None


def xfuser_status(device: str) -> str:
    """Why xDiT (xfuser) is not a side here, found out from the installed xfuser where there is one."""
    try:
        version = importlib.metadata.version("xfuser")
    except importlib.metadata.PackageNotFoundError:
        why = "on CPU it could not run anyway (bench/README.md says why)" if device == "cpu" else "not wired in yet"
        return f"not installed; {why}"
    if device != "cpu":
        return f"xfuser {version} is installed, but its side is not wired into this bench yet"
    from xfuser import envs

    name = envs.get_device_name()
    if name != "cpu":
        return (
            f"xfuser {version} cannot run on CPU: it takes its device from torch's build, not the machine "
            f"(xfuser.envs.get_device_name() is {name!r} for torch {torch.__version__}), so it initialises "
            "NCCL and calls torch.cuda.set_device, which fails without a GPU"
        )
    try:
        backend = envs.get_torch_distributed_backend()
    except NotImplementedError as e:
        return f"xfuser {version} cannot run on CPU: xfuser.envs.get_torch_distributed_backend() raises {e!r}"
    return f"xfuser {version} reports a {backend!r} backend on CPU, but its side is not wired into this bench yet"


def _versions() -> dict[str, str]:
    import diffusers
    import transformers

    found = {"torch": torch.__version__, "diffusers": diffusers.__version__, "transformers": transformers.__version__}
    for package in ("cache-dit", "xfuser"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return (a.float() - b.float()).abs().max().item()


def bench_strategy(
    strategy: Strategy, sides: list, interleave: bool, args: argparse.Namespace, log: Callable[[str], None]
) -> dict:
    """One strategy: every side loads, then ``args.rounds`` timed images per side (interleaved or side by side)."""
    row: dict = {"name": strategy.name, "sides": {}}
    runs: dict[str, list[Run]] = {}

    def load(side) -> bool:
        try:
            side.load(strategy)
        except Exception as e:  # a side that cannot run this strategy: report, go on with the others
            message = str(e) if isinstance(e, SideFailed) else f"{type(e).__name__}: {e}"
            row["sides"][side.name] = {"error": message}
            log(f"  {strategy.name} {side.name}: did not run: {message}")
            side.close()
            return False
        log(f"  {strategy.name} {side.name}: loaded and warmed up in {side.load_s:.1f} s")
        runs[side.name] = []
        return True

    def timed(side, r: int) -> None:
        try:
            runs[side.name].append(side.run())
        except Exception as e:
            message = str(e) if isinstance(e, SideFailed) else f"{type(e).__name__}: {e}"
            row["sides"][side.name] = {"error": f"round {r + 1}: {message}"}
            log(f"  {strategy.name} {side.name}: failed in round {r + 1}: {message}")
            del runs[side.name]
            side.close()

    if interleave:
        live = [side for side in sides if load(side)]
        for r in range(args.rounds):
            first = r % len(live) if live else 0
            for side in live[first:] + live[:first]:  # A B C, B C A, C A B, ...
                if side.name in runs:
                    timed(side, r)
            log(
                f"  {strategy.name} round {r + 1}/{args.rounds}: "
                + ", ".join(f"{n} {statistics.median(rs[-1].intervals) * 1e3:.1f}" for n, rs in runs.items())
                + " ms/step"
            )
        for side in live:
            side.close()
    else:
        for side in sides:
            if load(side):
                for r in range(args.rounds):
                    if side.name in runs:
                        timed(side, r)
                side.close()
    for name, rs in runs.items():
        row["sides"][name] = {
            "step_s": [run.intervals for run in rs],
            "ms_per_step": statistics.median(s for run in rs for s in run.intervals) * 1e3,
            "load_s": next(s.load_s for s in sides if s.name == name),
        }
    reference = runs.get("diffusers")
    for name, rs in runs.items():
        if reference is None:
            break
        side = row["sides"][name]
        side["ratio"] = side["ms_per_step"] / row["sides"]["diffusers"]["ms_per_step"]
        side["paired"] = statistics.median(
            statistics.median(a.intervals) / statistics.median(b.intervals) for a, b in zip(rs, reference)
        )
        side["max_diff"] = _max_diff(rs[-1].latents, reference[-1].latents)
    finals = {name: rs[-1].latents for name, rs in runs.items()}
    row["pairs"] = {f"{a}/{b}": _max_diff(finals[a], finals[b]) for a, b in itertools.combinations(finals, 2)}
    return row


def write_conditioning(conditioning: jobs.Conditioning, path: str) -> str:
    """The pack's embeddings for the peers' ``run`` requests: every side denoises the same inputs."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in conditioning.tensors.items()}, path)
    return path


def first_image(
    strategy: Strategy,
    spec: BackendSpec,
    model: str,
    model_dir: str,
    run_dir: str,
    interleave: bool,
    args: argparse.Namespace,
    log: Callable[[str], None],
) -> tuple[dict, jobs.Conditioning]:
    """Idle process to first image through the pack, against the bare script's launch to first image, ``--cold``
    times each in alternating order (pack first, then bare first, ...), each alone on the machine. Then warm images,
    interleaved like the rounds: the pack re-running the graph with a new seed and whole, against the bare script's
    next image from the prompt. Returns the pack's conditioning."""
    a = args
    sample = dict(steps=a.steps, guidance_scale=a.guidance, width=a.width, height=a.height)
    result: dict = {"strategy": strategy.name, "memory_policy": spec.memory_policy, "pack": [], "bare": []}
    found: dict = {}

    def graph(seed: int, conditioning: jobs.Conditioning | None = None) -> torch.Tensor:
        """The four nodes' steps; with ``conditioning``, what ComfyUI re-executes for a new seed (its encoder's
        output is cached)."""
        if conditioning is None:
            conditioning = jobs.encode_prompt(
                spec, model=model, prompt=PROMPT, max_sequence_length=a.max_sequence_length
            )
            found["conditioning"] = conditioning
        handle = jobs.plan_transformer(spec, model=model, **strategy.pack)
        latents = jobs.sample(handle, conditioning, seed=seed, **sample)
        return jobs.decode(spec, model=model, samples=latents)

    def pack() -> None:
        shutdown_backend()  # idle: nothing started
        t0 = time.monotonic()
        found["pack_image"] = graph(a.seed)
        took, up = time.monotonic() - t0, get_backend(spec).startup_s
        result["pack"].append({"first_s": took, "backend_up_s": up})
        log(f"first image: pack {took:.1f} s from an idle process (backend up after {up:.1f} s)")

    def bare() -> None:
        shutdown_backend()  # alone on the machine, and the devices' memory free for its own copy
        out = os.path.join(run_dir, "first-image.json")
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.ranks}", PEER_RANKS,
            "--side", "diffusers", "--strategy", strategy.kind, "--model-dir", model_dir, "--device", a.device,
            "--first-image", out, "--prompt", PROMPT, "--width", str(a.width), "--height", str(a.height),
            "--steps", str(a.steps), "--guidance", str(a.guidance), "--seed", str(a.seed),
            "--max-sequence-length", str(a.max_sequence_length),
        ]  # fmt: skip
        log_path = os.path.join(run_dir, "first-image.log")
        with open(log_path, "w") as f:
            t0 = time.monotonic()
            proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=START_TIMEOUT_S + RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _end_session(proc)
            raise SideFailed(f"the bare script did not finish (log: {log_path})") from None
        exited = time.monotonic() - t0
        if code != 0:
            with open(log_path, errors="replace") as f:
                raise SideFailed(f"the bare script failed: {summarize_failure(f.read())}")
        with open(out) as f:
            run = json.load(f)
        from safetensors.torch import load_file

        found["bare_image"] = load_file(run["image"])["images"]
        result["bare"].append(
            {
                "first_s": run["first_image_at"] - t0,
                "ranks_up_s": run["ranks_up_at"] - t0,
                "imported_s": run["imported_at"] - t0,
                "loaded_s": run["loaded_at"] - t0,
                "exit_s": exited,
            }
        )
        log(f"first image: bare script {run['first_image_at'] - t0:.1f} s from launch")

    for i in range(a.cold):
        for side in (pack, bare) if i % 2 == 0 else (bare, pack):
            side()
    result["image_max_diff"] = _max_diff(found["pack_image"], found["bare_image"])

    # Warm: every side loaded and past its first image (untimed), then --first-images rounds.
    graph(a.seed)
    conditioning_file = write_conditioning(found["conditioning"], os.path.join(run_dir, "conditioning.safetensors"))
    peer = PeerSide("diffusers", a, model_dir, conditioning_file, run_dir)
    warm: dict[str, list[float]] = {"new_seed": [], "whole_graph": [], "bare": []}

    def timed(name: str, seed: int) -> None:
        if name == "bare":
            warm[name].append(peer.image(seed)[0])
            return
        t0 = time.perf_counter()
        graph(seed, found["conditioning"] if name == "new_seed" else None)
        warm[name].append(time.perf_counter() - t0)

    try:
        if not interleave:  # CUDA: the pack's images first, then its models freed for the bare script's
            for i in range(a.first_images):
                timed("new_seed", a.seed + 1 + i)
                timed("whole_graph", a.seed + 1 + i)
            get_backend(spec).free()
        peer.load(strategy)
        peer.image(a.seed)
        for i in range(a.first_images):
            names = list(warm) if interleave else ["bare"]
            for name in names[i % len(names) :] + names[: i % len(names)]:
                timed(name, a.seed + 1 + i)
    finally:
        peer.close()
    result.update(pack_new_seed_s=warm["new_seed"], pack_whole_graph_s=warm["whole_graph"], bare_next_s=warm["bare"])
    med = statistics.median
    log(
        f"first image: warm, pack new seed {med(warm['new_seed']):.2f} s, whole graph {med(warm['whole_graph']):.2f} "
        f"s; bare script's next image {med(warm['bare']):.2f} s"
    )
    if a.comfyui is not None:
        shutdown_backend()  # the server starts its own backend: one backend owns the devices at a time
        result["comfyui"] = comfyui_first_image(strategy, model, model_dir, found["bare_image"], a, log)
    return result, found["conditioning"]


def comfyui_first_image(
    strategy: Strategy, model: str, model_dir: str, bare_image: torch.Tensor, args: argparse.Namespace, log
) -> dict:
    """The same graph queued on a real ComfyUI server (the shipped context-parallel API workflow, set to this model,
    strategy and size): from POST /prompt on an idle server (started, no backend) to the prompt's
    ``execution_success``, then warm re-runs with a new seed and with a new prompt. The saved PNG is checked against
    the bare script's first image (SaveImage truncates to 8 bits)."""
    import numpy as np
    from PIL import Image

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from comfyui_host import ComfyUIServer

    with open(API_WORKFLOW) as f:
        workflow = json.load(f)
    backend, encoder, transformer, sampler = (workflow[i]["inputs"] for i in ("1", "2", "3", "4"))
    for node in workflow.values():
        if "model" in node["inputs"]:
            node["inputs"]["model"] = model
    backend.update(ranks=args.ranks, device=args.device, memory_policy="staged")
    encoder.update(prompt=PROMPT, max_sequence_length=args.max_sequence_length)
    transformer.update({"ring_degree": 1, "ulysses_degree": 0, "tp_degree": 0, **strategy.pack})
    sampler.update(steps=args.steps, guidance_scale=args.guidance, width=args.width, height=args.height)

    def queue(seed: int, prompt: str = PROMPT) -> tuple[float, str]:
        sampler["seed"], encoder["prompt"] = seed, prompt
        t0 = time.monotonic()
        prompt_id = server.post_prompt(workflow)
        messages = server.follow(prompt_id, timeout=RUN_TIMEOUT_S)
        took = time.monotonic() - t0
        if messages[-1].get("type") != "execution_success":
            raise SideFailed(f"ComfyUI: the prompt ended with {messages[-1].get('type')}: {messages[-1].get('data')}")
        return took, prompt_id

    t0 = time.monotonic()
    with ComfyUIServer(args.comfyui, diffusers_dir=os.path.dirname(model_dir)) as server:
        started = time.monotonic() - t0
        first, prompt_id = queue(args.seed)
        png = server.view(**server.output_images(prompt_id)[0])
        new_seed = [queue(args.seed + 1 + i)[0] for i in range(args.first_images)]
        new_prompt = [queue(args.seed + 1 + i, f"{PROMPT}, take {i + 2}")[0] for i in range(args.first_images)]
        version = server.version
    import io

    image = torch.from_numpy(np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float32) / 255)
    result = {
        "version": version,
        "server_start_s": started,
        "first_s": first,
        "new_seed_s": new_seed,
        "new_prompt_s": new_prompt,
        "image_max_diff": _max_diff(image[None], bare_image),
    }
    log(
        f"first image: ComfyUI {version} {first:.1f} s from an idle server, warm new seed "
        f"{statistics.median(new_seed):.2f} s, new prompt {statistics.median(new_prompt):.2f} s"
    )
    return result


def run(args: argparse.Namespace, model_dir: str, run_dir: str, log: Callable[[str], None]) -> dict:
    model = os.path.basename(model_dir)
    os.environ["COMFY_PARALLEL_MODELS"] = os.pathsep.join(
        [os.path.dirname(model_dir)] + [p for p in os.environ.get("COMFY_PARALLEL_MODELS", "").split(os.pathsep) if p]
    )
    spec = BackendSpec(ranks=args.ranks, device=args.device, memory_policy="staged")
    interleave = args.interleave or args.device == "cpu"
    rows = [s for s in strategies_for(args.ranks) if not args.strategies or s.name in args.strategies]
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    report: dict = {
        "device": args.device,
        "ranks": args.ranks,
        "width": args.width,
        "height": args.height,
        "steps": args.steps,
        "rounds": args.rounds,
        "max_sequence_length": args.max_sequence_length,
        "threads": args.threads,
        "seed": args.seed,
        "dtype": dtype,
        "tolerance": TOLERANCE[dtype],
        "interleaved": interleave,
        "model_dir": model_dir,
        "transformer": {k: v for k, v in transformer_config(model_dir).items() if not k.startswith("_")},
        "cpus": os.cpu_count(),
        "versions": _versions(),
        "loadavg_start": load_average(),
        "xfuser": xfuser_status(args.device),
        "rows": [],
    }
    cache_dit = cache_dit_problem() if "cache-dit" in args.sides else "left out (--sides)"
    report["cache_dit"] = cache_dit
    if cache_dit:
        log(f"cache-dit: {cache_dit}")
    try:
        if args.no_first_image:
            conditioning = jobs.encode_prompt(
                spec, model=model, prompt=PROMPT, max_sequence_length=args.max_sequence_length
            )
        else:
            report["first_image"], conditioning = first_image(
                rows[0], spec, model, model_dir, run_dir, interleave, args, log
            )
        conditioning_file = write_conditioning(conditioning, os.path.join(run_dir, "conditioning.safetensors"))
        for strategy in rows:
            sides = [
                PackSide(spec, model, conditioning, args),
                PeerSide("diffusers", args, model_dir, conditioning_file, run_dir),
            ]
            if not cache_dit:
                sides.append(PeerSide("cache-dit", args, model_dir, conditioning_file, run_dir))
            try:
                report["rows"].append(bench_strategy(strategy, sides, interleave, args, log))
            finally:
                for side in sides:
                    if isinstance(side, PeerSide):
                        side.close()
    finally:
        shutdown_backend()
    report["loadavg_end"] = load_average()
    return report


def problems(report: dict) -> list[str]:
    """What makes the exit status 1: the pack or bare diffusers not running, or two sides' outputs disagreeing."""
    found = []
    for row in report["rows"]:
        for name in ("pack", "diffusers"):
            if "error" in row["sides"].get(name, {"error": "missing"}):
                found.append(f"{row['name']}: {name} did not run")
        found += [
            f"{row['name']}: {pair} differ by {diff:.2e}"
            for pair, diff in row["pairs"].items()
            if not diff <= report["tolerance"]
        ]
    first = report.get("first_image")
    if first and not first["image_max_diff"] <= report["tolerance"]:
        found.append(f"first image: pack and bare script differ by {first['image_max_diff']:.2e}")
    comfyui = (first or {}).get("comfyui")
    if comfyui and not comfyui["image_max_diff"] <= PNG_TOLERANCE:
        found.append(
            f"first image: ComfyUI's PNG and the bare script's image differ by {comfyui['image_max_diff']:.2e}"
        )
    return found


def print_report(report: dict) -> None:
    t = report["transformer"]
    print(
        f"peers benchmark: FLUX.1 transformer {t['num_layers']} double + {t['num_single_layers']} single blocks, "
        f"{t['num_attention_heads']}×{t['attention_head_dim']} wide, {report['dtype']}; "
        f"{report['width']}×{report['height']}, {report['max_sequence_length']} text tokens, {report['steps']} steps, "
        f"seed {report['seed']}; {report['rounds']} "
        + ("interleaved rounds" if report["interleaved"] else "runs per side, one side after another")
        + " (after one warm-up image per side)"
    )
    print(
        f"{report['device']}: {report['ranks']} ranks per side, {report['threads']} thread(s) per rank; "
        f"{report['cpus']} cpus; load average {report['loadavg_start']} at the start, "
        f"{report['loadavg_end']} at the end"
    )
    print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()))
    print()
    print(f"{'strategy':>9} {'side':>10} {'ms/step':>8} {'×diffusers':>10} {'paired':>7}  output vs diffusers")
    for row in report["rows"]:
        for i, name in enumerate(s for s in SIDES if s in row["sides"]):
            side = row["sides"][name]
            label = row["name"] if i == 0 else ""
            if "error" in side:
                print(f"{label:>9} {name:>10}  did not run: {side['error']}")
                continue
            if "ratio" not in side:
                print(f"{label:>9} {name:>10} {side['ms_per_step']:>8.1f}")
                continue
            paired = f"{side['paired']:>6.2f}×" if report["interleaved"] and name != "diffusers" else f"{'':>7}"
            if name == "diffusers":
                output = "(reference)"
            else:
                verdict = "equal" if side["max_diff"] <= report["tolerance"] else "DIFFERENT"
                output = f"{verdict}, max |Δ| {side['max_diff']:.1e}"
            print(f"{label:>9} {name:>10} {side['ms_per_step']:>8.1f} {side['ratio']:>9.2f}× {paired}  {output}")
        if row["pairs"]:
            worst = max(row["pairs"].items(), key=lambda kv: kv[1])
            print(f"{'':>9} {'':>10}  every pair of outputs: largest max |Δ| {worst[1]:.1e} ({worst[0]})")
    print(f"{'':>9} {'xfuser':>10}  {report['xfuser']}")
    if report["cache_dit"]:
        print(f"{'':>9} {'cache-dit':>10}  {report['cache_dit']}")
    print(
        f"ms/step: median of steps 2..{report['steps']} over every timed image, the clock read in this process as "
        "each step's message from rank 0's callback_on_step_end arrives (the same points on every side); "
        "×diffusers: ms/step ÷ bare diffusers'; "
        + ("paired: median over the rounds of the same ratio within a round; " if report["interleaved"] else "")
        + f"output: the last image's latents against bare diffusers' (tolerance {report['tolerance']:g})"
    )
    first = report.get("first_image")
    if not first:
        return
    med = statistics.median
    pack, bare, comfyui = first["pack"], first["bare"], first.get("comfyui")
    print()
    print(
        f"first image ({first['strategy']}, memory_policy {first['memory_policy']}): cold, this process with no "
        "backend running through the nodes' steps against torchrun's launch of the bare script to its first image "
        f"(median of {len(pack)} each, alternating which goes first); warm, "
        + ("interleaved" if report["interleaved"] else "one side after the other")
        + f" (median of {len(first['bare_next_s'])} each)"
    )
    print(
        f"{'':>40} {'pack':>8} {'bare script':>12} {'ratio':>7}" + (f" {'ComfyUI':>9} {'ratio':>7}" if comfyui else "")
    )
    bare_next = med(first["bare_next_s"])
    rows = [
        ("idle / launch to first image", med(r["first_s"] for r in pack), med(r["first_s"] for r in bare), "first_s"),
        ("warm, new seed (sampler + decoder)", med(first["pack_new_seed_s"]), bare_next, "new_seed_s"),
        ("warm, whole graph again (every node)", med(first["pack_whole_graph_s"]), bare_next, "new_prompt_s"),
    ]
    for label, pack_s, bare_s, key in rows:
        line = f"{label:>40} {pack_s:>7.2f}s {bare_s:>11.2f}s {pack_s / bare_s:>6.2f}×"
        if comfyui:
            server = comfyui[key] if key == "first_s" else med(comfyui[key])
            line += f" {server:>8.2f}s {server / bare_s:>6.2f}×"
        print(line)
    print(
        "cold runs, pack: "
        + ", ".join(f"{r['first_s']:.1f} s (backend up {r['backend_up_s']:.1f})" for r in pack)
        + "; bare: "
        + ", ".join(
            f"{r['first_s']:.1f} s (process group {r['ranks_up_s']:.1f}, diffusers imported {r['imported_s']:.1f}, "
            f"loaded {r['loaded_s']:.1f}, exited {r['exit_s']:.1f})"
            for r in bare
        )
    )
    print(
        "pack: backend up = ranks started with diffusers imported (the CPU shims patch it) and the client connected; "
        "bare warm: its next image from the prompt (text encoders, transformer, VAE) in the running torchrun group; "
        f"first images, pack against bare: max |Δ| {first['image_max_diff']:.1e}"
    )
    if comfyui:
        print(
            f"ComfyUI {comfyui['version']}: POST /prompt on an idle server (up after {comfyui['server_start_s']:.1f} "
            "s, not counted) to execution_success, SaveImage's PNG included, not interleaved; whole graph again: a "
            f"new prompt; its PNG against the bare script's first image: max |Δ| {comfyui['image_max_diff']:.1e} "
            "(8-bit)"
        )


def main() -> int:
    args = ARGS
    torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    check_request(args, [s.name for s in strategies_for(args.ranks)])
    with tempfile.TemporaryDirectory(prefix="pd-peers-") as scratch:
        if args.smoke:
            model_dir = make_tiny_model("flux", os.path.join(scratch, "flux-tiny"))
        else:
            model_dir = prepare_model_dir(args, scratch, log)
        run_dir = os.path.join(scratch, "run")
        os.mkdir(run_dir)
        try:
            report = run(args, model_dir, run_dir, log)
        except SideFailed as e:  # the first image's bare script or ComfyUI: nothing to compare against
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    found = problems(report)
    for problem in found:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
