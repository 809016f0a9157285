"""Process lifecycle: start the torchrun group, find its ranks, read their logs, tear it all down.

The group lives in a private run directory (0700): the control socket, the token, one log per rank and
one pid file per rank. torchrun starts each rank in a session of its own, so teardown signals the
agent's process group and every rank's pid; nothing it started is left running.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .arena import SHM_DIR, remove_segments
from .processes import process_alive
from .spec import BackendSpec

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHM_PREFIX = "pd"


@dataclasses.dataclass
class LaunchedGroup:
    spec: BackendSpec
    proc: subprocess.Popen
    run_dir: str
    token: str
    shm_prefix: str

    @property
    def socket_path(self) -> str:
        return os.path.join(self.run_dir, "control.sock")

    def worker_pids(self) -> dict[int, int]:
        """Rank → pid for the ranks of this machine that have started."""
        return _worker_pids(self.run_dir)

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            with open(os.path.join(self.run_dir, name), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def traceback_of(self, rank: int) -> str:
        return self.log_tail(f"rank{rank}.traceback", lines=200)

    def failed_rank(self) -> int | None:
        """The rank that failed first: the earliest to leave a traceback, else torchrun's "Root Cause"."""
        tracebacks = glob.glob(os.path.join(self.run_dir, "rank*.traceback"))
        if tracebacks:
            first = min(tracebacks, key=os.path.getmtime)
            return int(re.search(r"rank(\d+)\.traceback$", first).group(1))
        launcher_log = self.log_tail("launcher.log", lines=400)
        root = launcher_log.rfind("Root Cause")
        if root >= 0 and (m := re.search(r"rank\s*:\s*(\d+)", launcher_log[root:])):
            return int(m.group(1))
        return None


def _worker_pids(run_dir: str) -> dict[int, int]:
    pids = {}
    for path in glob.glob(os.path.join(run_dir, "rank*.pid")):
        rank = int(re.search(r"rank(\d+)\.pid$", path).group(1))
        try:
            with open(path) as f:
                pids[rank] = int(f.read().strip())
        except (OSError, ValueError):
            pass
    return pids


RUN_DIR_PREFIX = "comfy-parallel-"


def sweep_stale() -> list[str]:
    """Remove what backends of clients that no longer run left behind (a group killed with SIGKILL cannot clean
    up after itself): arena segments (named ``pd-<client pid>-...``) and run directories whose client and
    ranks are all gone."""
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, f"{SHM_PREFIX}-*-*")):
        m = re.match(rf"{SHM_PREFIX}-(\d+)-", os.path.basename(path))
        if m and not process_alive(int(m.group(1))):
            removed += remove_segments(os.path.basename(path))
    for run_dir in glob.glob(os.path.join(tempfile.gettempdir(), RUN_DIR_PREFIX + "*")):
        try:
            with open(os.path.join(run_dir, "client.pid")) as f:
                pids = [int(f.read())]
        except (OSError, ValueError):
            continue  # not ours, or still being created
        pids += _worker_pids(run_dir).values()
        if not any(process_alive(p) for p in pids):
            shutil.rmtree(run_dir, ignore_errors=True)
            removed.append(run_dir)
    return removed


def torchrun_command(spec: BackendSpec, run_dir: str) -> list[str]:
    # torchrun's own logs go into the run directory, which teardown removes: by default it leaves a torchelastic_*
    # directory in /tmp behind for every launch.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(spec.ranks),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.2",
        "--log-dir",
        os.path.join(run_dir, "torchelastic"),
    ]
    if spec.nnodes == 1:
        cmd += ["--standalone"]
    else:
        cmd += [
            "--nnodes",
            str(spec.nnodes),
            "--node-rank",
            str(spec.node_rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            spec.rdzv_endpoint,
        ]
    return cmd + ["-m", "parallel_runtime.worker"]


def launch(spec: BackendSpec) -> LaunchedGroup:
    """Start the group in a fresh private run directory. Returns at once; the ranks come up on their own."""
    sweep_stale()
    run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)  # mode 0700
    with open(os.path.join(run_dir, "client.pid"), "w") as f:
        f.write(str(os.getpid()))
    token = secrets.token_hex(32)
    fd = os.open(os.path.join(run_dir, "token"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    shm_prefix = f"{SHM_PREFIX}-{os.getpid()}-{secrets.token_hex(4)}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(
        {
            "COMFY_PARALLEL_RUN_DIR": run_dir,
            "COMFY_PARALLEL_CLIENT_PID": str(os.getpid()),
            "COMFY_PARALLEL_DEVICE": spec.device,
            "COMFY_PARALLEL_MEMORY_POLICY": spec.memory_policy,
            "COMFY_PARALLEL_SHM_PREFIX": shm_prefix,
            "PYTHONUNBUFFERED": "1",
        }
    )
    # The ranks wait on torchrun's store with short timeouts by design; c10d would log a warning for each.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if spec.device == "cpu":
        # CPU ranks must not see GPUs: diffusers builds its device mesh on the accelerator torch reports.
        env["CUDA_VISIBLE_DEVICES"] = ""
        # torchrun gives each rank 1 thread when unset; on CPU share the cores out instead.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // spec.ranks)))
        # glibc returns large activation buffers to the kernel after every run and faults them in again on the
        # next (tens of thousands of faults per VAE decode, measured by bench/overhead.py). A persistent backend
        # runs the same shapes again and again, so it keeps them.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(16 << 30))
    log = open(os.path.join(run_dir, "launcher.log"), "ab")
    try:
        proc = subprocess.Popen(
            torchrun_command(spec, run_dir),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=run_dir,
        )
    finally:
        log.close()
    return LaunchedGroup(spec=spec, proc=proc, run_dir=run_dir, token=token, shm_prefix=shm_prefix)


def _signal_all(group: LaunchedGroup, sig: int) -> None:
    try:
        os.killpg(group.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in group.worker_pids().values():
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait_exit(group: LaunchedGroup, timeout: float) -> bool:
    """Wait until the agent and every rank have exited; False if some are still running at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        agent_done = group.proc.poll() is not None
        if agent_done and not any(process_alive(p) for p in group.worker_pids().values()):
            return True
        time.sleep(0.05)
    return False


def terminate(group: LaunchedGroup, grace: float = 5.0, keep_run_dir: bool = False) -> None:
    """Stop every process of the group (SIGTERM, then SIGKILL after ``grace``) and remove its segments."""
    if not wait_exit(group, 0):
        _signal_all(group, signal.SIGTERM)
        if not wait_exit(group, grace):
            _signal_all(group, signal.SIGKILL)
            wait_exit(group, 5.0)
    try:
        group.proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        pass
    remove_segments(group.shm_prefix)
    if not keep_run_dir:
        shutil.rmtree(group.run_dir, ignore_errors=True)
