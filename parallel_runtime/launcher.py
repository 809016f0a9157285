"""Process lifecycle: start the torchrun group, find its ranks, read their logs, tear it all down.

The group lives in a private run directory (0700, ``rundir``): the control socket, the token, one log, pid and
heartbeat file per rank. torchrun starts each rank in a session of its own, so teardown signals the agent's process
group and every rank's pid; nothing it started is left running, and the run directory (torchrun's own logs
included) is removed.

torchrun runs as ``python -m parallel_runtime.worker.agent``: the same agent, with its TCP stores bound to one address
(loopback on one machine) instead of every interface, and the collectives' sockets on that interface too. Its
rendezvous is torchrun's static one, on one machine as on several, so that it unpickles nothing a stranger writes into
its store (``worker/agent.py``); on one machine its store listens on a free loopback port that the agent binds.

Over several machines (``spec.nnodes`` > 1) this machine is node 0: its agent hosts the store of torchrun's static
rendezvous on ``spec.rdzv_endpoint`` (and binds nothing else), and publishes there the backend's beacon, sealed with
the cluster secret (``rendezvous``), which tells the joining machines the token. No command line carries the token, the
secret or the rendezvous id (``/proc/<pid>/cmdline`` is readable by every local user): the token is a 0600 file of
the run directory, the rendezvous id is in torchrun's environment.
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

from . import rendezvous
from .arena import SHM_DIR, remove_segments
from .processes import process_alive
from .rendezvous import BEACON_KEY, Beacon, seal, split_endpoint
from .rundir import RunDir
from .spec import BackendSpec, visible_gpu_uuids

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHM_PREFIX = "pd"
RUN_DIR_PREFIX = "comfy-parallel-"
LOOPBACK = "127.0.0.1"


@dataclasses.dataclass
class LaunchedGroup:
    spec: BackendSpec
    proc: subprocess.Popen  # torchrun's agent
    run_dir: RunDir
    token: str
    shm_prefix: str
    # Every rank pid seen so far: teardown must reach them even once their pid files are gone.
    known_pids: dict[int, int] = dataclasses.field(default_factory=dict)
    rdzv_id: str | None = None  # over several machines: this backend's rendezvous id (never on a command line)

    def remote_ranks(self) -> dict[int, dict]:
        """Rank → {node, host, pid} for the ranks on other machines (rank 0 writes them once they proved the secret)."""
        return self.run_dir.remote_ranks()

    def describe(self, rank: int) -> str:
        """A rank in words: its pid, and for a rank on another machine, that machine."""
        remote = self.remote_ranks().get(rank)
        if remote is not None:
            return f"rank {rank} on node {remote['node']} ({remote['host']}, pid {remote['pid']})"
        return f"rank {rank} (pid {self.known_pids.get(rank) or self.run_dir.rank_pids().get(rank)})"

    def worker_pids(self) -> dict[int, int]:
        """Rank → pid for the ranks of this machine that have started."""
        self.known_pids.update(self.run_dir.rank_pids())
        return dict(self.known_pids)

    def log_tail(self, rank: int | None = None, lines: int = 30) -> str:
        """The end of a rank's log (None: torchrun's)."""
        return self.run_dir.tail(self.run_dir.launcher_log if rank is None else self.run_dir.rank_log(rank), lines)

    def traceback_of(self, rank: int) -> str:
        return self.run_dir.tail(self.run_dir.rank_traceback(rank), lines=200)

    def start_spoiled_by_store(self) -> bool:
        """Whether torchrun's agent died reading back the records it wrote into its own store to number the ranks
        (``_assign_worker_ranks``): only a stranger's writes into the store, which has no credentials, change them."""
        return "in _assign_worker_ranks" in self.log_tail(lines=400)

    def failed_rank(self) -> int | None:
        """The rank that failed first: the earliest to leave a traceback, else torchrun's "Root Cause"."""
        first = self.run_dir.first_traceback()
        if first is not None:
            return first
        launcher_log = self.log_tail(lines=400)
        root = launcher_log.rfind("Root Cause")
        if root >= 0 and (m := re.search(r"rank\s*:\s*(\d+)", launcher_log[root:])):
            return int(m.group(1))
        return None


def sweep_stale() -> list[str]:
    """Remove what backends of clients that no longer run left behind (a group killed with SIGKILL cannot clean
    up after itself): arena segments (named ``pd-<client pid>-...``) and run directories whose client and
    ranks are all gone."""
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, f"{SHM_PREFIX}-*-*")):
        m = re.match(rf"{SHM_PREFIX}-(\d+)-", os.path.basename(path))
        if m and not process_alive(int(m.group(1))):
            removed += remove_segments(os.path.basename(path))
    for path in glob.glob(os.path.join(tempfile.gettempdir(), RUN_DIR_PREFIX + "*")):
        run_dir = RunDir(path)
        try:
            with open(run_dir.client_pid) as f:
                pids = [int(f.read())]
        except (OSError, ValueError):
            continue  # not ours, or still being created
        pids += run_dir.rank_pids().values()
        if not any(process_alive(p) for p in pids):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def torchrun_command(spec: BackendSpec, run_dir: RunDir, rendezvous_args: list[str]) -> list[str]:
    """torchrun's command for this machine's ranks, with its rendezvous arguments (``rendezvous_arguments``)."""
    # torchrun's own logs go into the run directory, which teardown removes: by default it leaves a torchelastic_*
    # directory in /tmp behind for every launch.
    cmd = [
        sys.executable,
        "-m",
        "parallel_runtime.worker.agent",
        "--nproc-per-node",
        str(spec.ranks),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.2",
        "--log-dir",
        run_dir.torchelastic,
        *rendezvous_args,
    ]
    return [*cmd, "-m", "parallel_runtime.worker"]


# The CUDA caching allocator the ranks run with, unless COMFY_PARALLEL_CUDA_ALLOC_CONF says otherwise. ComfyUI sets
# PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync in its own process (cuda_malloc.py); its children would inherit it,
# and the ranks' NCCL communicators are tested by torch with its native allocator. So the ranks get that one, on
# purpose, and the pack's override is the one place to change it.
RANK_CUDA_ALLOC_CONF = "backend:native"


def gpu_environment(spec: BackendSpec) -> dict[str, str]:
    """Which GPUs a cuda backend's ranks see and in which order: ``spec.gpus`` (nvidia-smi's numbers, which are PCI
    bus order), or else the GPUs this process sees, by UUID so that the ranks' PCI bus order cannot swap them.
    Empty without CUDA in this process: the ranks then inherit its ``CUDA_VISIBLE_DEVICES`` as it is."""
    if spec.device != "cuda":
        return {}
    visible = [str(g) for g in spec.gpus] if spec.gpus else visible_gpu_uuids()
    if not visible:
        return {}
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(visible)}


def _environment(
    spec: BackendSpec, run_dir: RunDir, shm_prefix: str, collective_timeout_s: float | None = None
) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(rendezvous.SECRET_ENV, None)  # the ranks seal with the token; the cluster secret stays with the client
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(
        {
            "COMFY_PARALLEL_RUN_DIR": run_dir.path,
            "COMFY_PARALLEL_CLIENT_PID": str(os.getpid()),
            "COMFY_PARALLEL_DEVICE": spec.device,
            "COMFY_PARALLEL_MEMORY_POLICY": spec.memory_policy,
            "COMFY_PARALLEL_SHM_PREFIX": shm_prefix,
            "COMFY_PARALLEL_BIND": LOOPBACK,
            "PYTHONUNBUFFERED": "1",
            # Anything torchrun or a rank writes to a temporary file lands in the run directory, which teardown removes.
            "TMPDIR": run_dir.path,
        }
    )
    if collective_timeout_s is not None:
        env["COMFY_PARALLEL_COLLECTIVE_TIMEOUT_S"] = f"{collective_timeout_s:g}"
    if spec.nnodes == 1:
        # The collectives' sockets (gloo pairs, NCCL's bootstrap) listen on loopback too: nothing of the backend is
        # reachable from another machine.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    else:
        env.update(rendezvous.node_environment(split_endpoint(spec.rdzv_endpoint)[0], node_rank=0))
    # c10d's warnings stay in the rank logs (the ranks wait on torchrun's store without timeouts that expire while
    # idle, so polling leaves none there), and so do NCCL's own: without NCCL_DEBUG it prints nothing at all, and a
    # broken link then looks like a hang with an empty log. Over several machines the ranks poll the store with short
    # timeouts (relayed heartbeats, worker/remote.py), and c10d would log a warning for each.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "WARNING" if spec.nnodes == 1 else "ERROR")
    env.setdefault("NCCL_DEBUG", "WARN")
    alloc_conf = env.get("COMFY_PARALLEL_CUDA_ALLOC_CONF") or RANK_CUDA_ALLOC_CONF
    env["PYTORCH_CUDA_ALLOC_CONF"] = env["PYTORCH_ALLOC_CONF"] = alloc_conf  # torch ≥ 2.9 reads the second name
    # torchrun gives each rank 1 thread when unset, which starves whatever runs on the CPU (tokenizers, a CPU decode,
    # the latents' packing); share the cores out instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // spec.ranks)))
    if spec.device == "cpu":
        # CPU ranks must not see GPUs: diffusers builds its device mesh on the accelerator torch reports.
        env["CUDA_VISIBLE_DEVICES"] = ""
        # glibc returns large activation buffers to the kernel after every run and faults them in again on the
        # next (tens of thousands of faults per VAE decode, measured by bench/overhead.py). A persistent backend
        # runs the same shapes again and again, so it keeps them.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(16 << 30))
    env.update(gpu_environment(spec))
    return env


def _new_run_dir(token: str) -> RunDir:
    run_dir = RunDir(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))  # mode 0700
    with open(run_dir.client_pid, "w") as f:
        f.write(str(os.getpid()))
    fd = os.open(run_dir.token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return run_dir


def _popen(cmd: list[str], env: dict[str, str], run_dir: RunDir) -> subprocess.Popen:
    log = open(run_dir.launcher_log, "ab")
    try:
        return subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=run_dir.path,
        )
    finally:
        log.close()


def launch_joined(beacon: Beacon, rdzv_endpoint: str, node_rank: int, address: str) -> LaunchedGroup:
    """Start this machine's part (node ``node_rank``) of the backend ``beacon`` describes, for ``comfy-parallel
    join``: its agent joins node 0's rendezvous from ``address``. Its ranks get no shared-memory prefix: only rank 0,
    on node 0, has an arena."""
    sweep_stale()
    run_dir = _new_run_dir(beacon.token)
    spec = BackendSpec(ranks=beacon.ranks, device=beacon.device, memory_policy=beacon.memory_policy)
    env = _environment(spec, run_dir, shm_prefix="")
    del env["COMFY_PARALLEL_SHM_PREFIX"]
    for name in rendezvous.IFNAMES:  # not loopback: the interface that reaches node 0, or the user's choice
        env.pop(name, None)
    env.update(rendezvous.node_environment(address, node_rank))
    if "TORCH_CPP_LOG_LEVEL" not in os.environ:  # this machine's ranks poll node 0's store (see _environment)
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    env.update(rendezvous.rendezvous_environment(beacon.rdzv_id))
    args = rendezvous.rendezvous_arguments(rdzv_endpoint, beacon.nnodes, node_rank)
    proc = _popen(torchrun_command(spec, run_dir, args), env, run_dir)
    return LaunchedGroup(
        spec=spec,
        proc=proc,
        run_dir=run_dir,
        token=beacon.token,
        shm_prefix=f"{SHM_PREFIX}-{os.getpid()}-none-",  # names nothing: teardown removes no segment
        rdzv_id=beacon.rdzv_id,
    )


def launch(spec: BackendSpec, collective_timeout_s: float | None = None) -> LaunchedGroup:
    """Start the group in a fresh private run directory. Returns at once; the ranks come up on their own.
    ``collective_timeout_s`` bounds each collective of the ranks (torch's process-group timeout)."""
    sweep_stale()
    token = secrets.token_hex(32)
    run_dir = _new_run_dir(token)
    shm_prefix = f"{SHM_PREFIX}-{os.getpid()}-{secrets.token_hex(4)}"
    rdzv_id = None
    env = _environment(spec, run_dir, shm_prefix, collective_timeout_s)
    # One machine alone runs the static rendezvous too (nothing unpickled, worker/agent.py), on loopback; port 0: its
    # agent binds a free one and tells the ranks which.
    args = rendezvous.rendezvous_arguments(f"{LOOPBACK}:0", nnodes=1, node_rank=0)
    if spec.nnodes > 1:
        rdzv_id = secrets.token_hex(16)
        args = rendezvous.rendezvous_arguments(spec.rdzv_endpoint, spec.nnodes, node_rank=0)
        env.update(rendezvous.rendezvous_environment(rdzv_id))
        beacon = Beacon(rdzv_id, token, spec.nnodes, spec.ranks, spec.device, spec.memory_policy)
        fd = os.open(run_dir.beacon, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(seal(rendezvous.cluster_secret(), BEACON_KEY, beacon))
    proc = _popen(torchrun_command(spec, run_dir, args), env, run_dir)
    return LaunchedGroup(spec=spec, proc=proc, run_dir=run_dir, token=token, shm_prefix=shm_prefix, rdzv_id=rdzv_id)


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
    while True:
        agent_done = group.proc.poll() is not None
        if agent_done and not any(process_alive(p) for p in group.worker_pids().values()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def kill(group: LaunchedGroup) -> None:
    """SIGKILL every process of the group at once: for a group that is stuck (a stopped process ignores SIGTERM)."""
    _signal_all(group, signal.SIGKILL)


def terminate(group: LaunchedGroup, grace: float = 5.0) -> None:
    """Stop every process of the group (SIGTERM, then SIGKILL after ``grace``), remove its shared-memory segments
    and its run directory."""
    if not wait_exit(group, 0):
        try:  # the agent need not wait to see whether this client goes too (worker/agent.py)
            open(group.run_dir.stopping, "w").close()
        except OSError:
            pass
        _signal_all(group, signal.SIGTERM)
        if not wait_exit(group, grace):
            kill(group)
            wait_exit(group, 5.0)
    try:
        group.proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        pass
    group.run_dir.remove(group.shm_prefix)
