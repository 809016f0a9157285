"""A backend over several machines, simulated on one over 127.0.0.1: the ComfyUI side's backend is node 0 (this
process's client), and ``comfy-parallel join`` runs node 1 in a process of its own, as it would on another machine.

Real torchrun agents meeting in torchrun's rendezvous, real ranks, real collectives (gloo), the tiny FLUX.1 through
the nodes' steps. What is checked: images equal one process; a remote rank never opens shared memory; a wrong secret,
no secret or a node rank already taken is refused while the group in use goes on; a machine that never joins is
named, with its command, within the deadline; a machine killed mid-run is named in ``BackendDied`` and the next
prompt runs once it has joined again; nothing is left on either side. And the threat model (README, *Security*):
a stranger writing code-running pickles into every key of the store runs nothing (and so does another user of the
machine who lists a one-machine backend's keys); no process has a secret on its command line; the secret reaches
no HTTP client but one on this machine; ranks refuse object collectives.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import psutil
import pytest
import torch
from diffusers import FluxPipeline
from helpers import MODEL, TOKENS, at_step, generate, one_shot_images, wait_for

from parallel_runtime import (
    Backend,
    BackendDied,
    BackendSpec,
    BackendStartError,
    InvalidInput,
    ParallelRuntimeError,
    default_spec,
    get_backend,
    launcher,
)
from parallel_runtime.arena import SHM_DIR
from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux
from parallel_runtime.launcher import SHM_PREFIX
from parallel_runtime.machines import join_command
from parallel_runtime.processes import process_alive
from parallel_runtime.rendezvous import BEACON_KEY, SECRET_ENV, claim_key, cluster_secret, interface_of, route_to
from parallel_runtime.wire import StatusArgs, StepsArgs

pytestmark = pytest.mark.multirank

SECRET = "test-secret-" + os.urandom(8).hex()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Machine:
    """``comfy-parallel join`` as another machine would run it: its own process (and session), its own secret."""

    def __init__(self, endpoint: str, node_rank: int = 1, secret: str | None = SECRET, *args: str):
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        env["PYTHONPATH"] = ROOT
        if secret is not None:
            env[SECRET_ENV] = secret
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "parallel_runtime.cli", "join", endpoint, "--node-rank", str(node_rank), *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def processes(self) -> list[int]:
        """The join process and everything under it (its torchrun agent and ranks)."""
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    todo += [int(p) for p in f.read().split()]
            except OSError:
                pass
        return found

    def run_dirs(self) -> list[str]:
        dirs = set()
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    for item in f.read().split(b"\0"):
                        if item.startswith(b"COMFY_PARALLEL_RUN_DIR="):
                            dirs.add(item.split(b"=", 1)[1].decode())
            except OSError:
                pass
        return sorted(dirs)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout)

    def kill(self) -> None:
        """The machine is gone: every process of it at once."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture(scope="module")
def secret_env():
    old = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = SECRET
    yield SECRET
    if old is None:
        del os.environ[SECRET_ENV]
    else:
        os.environ[SECRET_ENV] = old


@pytest.fixture(scope="module")
def models_dir(models_root):
    make_tiny_flux(str(models_root / MODEL))
    return models_root


@pytest.fixture(scope="module")
def one_process(models_dir):
    """The one-shot diffusers pipeline in this process: the reference every strategy must match (as in
    test_strategies, on this module's model folder)."""
    return one_shot_images(
        FluxPipeline.from_pretrained(models_dir / MODEL), guidance_scale=3.5, max_sequence_length=TOKENS
    )


@pytest.fixture(scope="module")
def cluster(secret_env, models_dir):
    """Node 0 (this process's backend, 1 rank) and node 1 (``comfy-parallel join``, 1 rank) over 127.0.0.1."""
    spec, machine = _two_machines(ranks=1)
    state = {"machine": machine, "spec": spec, "endpoint": spec.rdzv_endpoint}
    yield state
    backend = get_backend(spec)
    remote_dirs, remote_pids = state["machine"].run_dirs(), state["machine"].processes()
    local = [backend.agent_pid, *backend.worker_pids.values()] if backend.running else []
    run_dir, prefix = backend.run_dir, backend.shm_prefix
    backend.shutdown()
    state["machine"].stop()
    assert_nothing_left(local + remote_pids, [d for d in [run_dir, *remote_dirs] if d], prefix)


def _two_machines(ranks: int, deadlines=None) -> tuple[BackendSpec, Machine]:
    """This process's backend (node 0) and a joined machine (node 1) of ``ranks`` ranks each, started on a port
    chosen free; chosen again when another process took it before torchrun's agent bound it."""
    attempts = 3
    while True:
        endpoint = f"127.0.0.1:{free_port()}"
        spec = default_spec(device="cpu", ranks=ranks, nnodes=2, rdzv_endpoint=endpoint)
        machine = Machine(endpoint)
        backend = get_backend(spec)
        if deadlines is not None:
            backend.deadlines = deadlines
        try:
            backend.start()
            return spec, machine
        except BackendStartError as e:
            machine.stop()
            attempts -= 1
            if not attempts or "address already in use" not in str(e).lower():
                raise


def assert_nothing_left(pids: list[int], run_dirs: list[str], prefix: str | None) -> None:
    """Nothing of a backend left on either side: processes, run directories (torchrun's logs live in them), arena
    segments."""
    assert [p for p in pids if process_alive(p)] == []
    assert [d for d in run_dirs if os.path.exists(d)] == []
    assert prefix is None or [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)] == []


def test_two_machines_context_parallel_matches_one_process(cluster, one_process):
    spec = cluster["spec"]
    status = get_backend(spec).status()
    assert status.world_size == 2 and [r.rank for r in status.ranks] == [0, 1]
    remote = get_backend(spec)._group.remote_ranks()
    assert list(remote) == [1] and remote[1]["node"] == 1  # rank 0 is on node 0, the ComfyUI host
    for args in ({"ulysses_degree": 2}, {"ring_degree": 2, "ulysses_degree": 1}):
        image = generate(spec, "context_parallel", **args)
        assert (image - one_process(3, 64, 64)).abs().max() <= 1e-4, args


def _arena_segments_of(pid: int) -> list[str]:
    """The backend arena segments (``pd-...`` in /dev/shm) ``pid`` maps or holds open. Other files there are not the
    arena's: a library's POSIX semaphores (``sem.*``) live there too."""
    paths = []
    with open(f"/proc/{pid}/maps") as f:
        paths += [line.split(maxsplit=5)[-1].strip() for line in f if SHM_DIR + "/" in line]
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    names = [os.path.basename(p.split(" (deleted)")[0]) for p in paths if p.startswith(SHM_DIR + "/")]
    return [n for n in names if n.startswith(SHM_PREFIX + "-")]


def test_a_remote_rank_opens_no_shared_memory(cluster):
    backend = get_backend(cluster["spec"])
    generate(cluster["spec"], "context_parallel", ulysses_degree=2)  # both arenas have carried tensors
    remote_pid = backend._group.remote_ranks()[1]["pid"]
    with open(f"/proc/{remote_pid}/environ", "rb") as f:
        environ = f.read()
    assert b"COMFY_PARALLEL_SHM_PREFIX" not in environ and b"COMFY_PARALLEL_NODE_RANK=1" in environ
    # The collectives' sockets stay on the interface that holds rdzv_endpoint's address (loopback here), on both sides.
    assert b"GLOO_SOCKET_IFNAME=lo\0" in environ and b"NCCL_SOCKET_IFNAME=lo\0" in environ
    assert _arena_segments_of(remote_pid) == []
    assert any(
        name.startswith(backend.shm_prefix) for name in _arena_segments_of(backend.worker_pids[0])
    )  # rank 0 does


def test_both_machines_listen_only_on_the_chosen_address(cluster):
    """Every socket either machine's agent or ranks listen on is bound to rdzv_endpoint's host, none to every
    interface (0.0.0.0)."""
    psutil = pytest.importorskip("psutil")
    backend = get_backend(cluster["spec"])
    pids = [backend.agent_pid, *backend.worker_pids.values(), *cluster["machine"].processes()]
    listening = [
        (pid, c.laddr.ip)
        for pid in pids
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening and all(ip == "127.0.0.1" for _, ip in listening), listening


def _other_address() -> str:
    """An address of this machine that is not loopback: a client connecting from it is, to a server, another
    machine."""
    try:
        address = route_to("192.0.2.1", 9)  # TEST-NET-1: nothing is sent, the kernel only picks the route
    except OSError:
        address = "127.0.0.1"
    if ipaddress.ip_address(address).is_loopback:
        pytest.skip("this machine has no address but loopback")
    return address


def test_the_secret_is_shown_only_to_a_browser_on_the_comfyui_host(cluster, nodes):
    """The status (GET /parallel_diffusers/status, and the same snapshot broadcast after every node run) carries the
    join command without the secret; POST /parallel_diffusers/join answers it with the secret to a client on this
    machine only. The pack's own handlers on a real aiohttp server listening on every interface, as ComfyUI's with
    ``--listen 0.0.0.0``."""
    import aiohttp
    from aiohttp import web

    from parallel_nodes import comfy, routes

    endpoint = cluster["endpoint"]
    broadcast = comfy.snapshot()
    assert broadcast["join"] == [join_command(endpoint, 1)] and SECRET not in json.dumps(broadcast)
    assert f"comfy-parallel join {endpoint} --node-rank 1" in broadcast["join"][0]
    assert "joining a backend of 2 machines × 1 cpu ranks as node 1" in cluster["machine"].output
    assert SECRET not in cluster["machine"].output  # never logged
    other = _other_address()

    async def ask() -> dict:
        app = web.Application()
        app.router.add_get("/parallel_diffusers/status", routes.status)
        app.router.add_post("/parallel_diffusers/join", routes.join)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "0.0.0.0", 0).start()  # the port the server binds: no other process can take it
        port = runner.addresses[0][1]
        answers = {}
        try:
            for client in ("127.0.0.1", other):
                connector = aiohttp.TCPConnector(local_addr=(client, 0))
                async with aiohttp.ClientSession(connector=connector) as session:
                    async with session.get(f"http://{client}:{port}/parallel_diffusers/status") as r:
                        answers[client, "status"] = (r.status, await r.text())
                    async with session.post(f"http://{client}:{port}/parallel_diffusers/join") as r:
                        answers[client, "join"] = (r.status, await r.text())
        finally:
            await runner.cleanup()
        return answers

    answers = asyncio.run(ask())
    for client in ("127.0.0.1", other):
        status, text = answers[client, "status"]
        assert status == 200 and SECRET not in text and json.loads(text)["join"] == broadcast["join"]
    status, text = answers["127.0.0.1", "join"]
    assert status == 200 and json.loads(text)["join"] == [join_command(endpoint, 1, SECRET)]
    status, text = answers[other, "join"]
    assert status == 403 and SECRET not in text and "only in a browser on the ComfyUI host" in text


def test_no_process_of_either_machine_has_a_secret_on_its_command_line(cluster):
    """/proc/<pid>/cmdline is readable by every user of a machine: the cluster secret, the backend's token and the
    rendezvous id are on none of the backend's (torchrun's agents, the ranks, ``comfy-parallel join``)."""
    backend = get_backend(cluster["spec"])
    group = backend._group
    machine = cluster["machine"].processes()
    pids = [backend.agent_pid, *backend.worker_pids.values(), *machine]
    assert len(machine) >= 3  # comfy-parallel join, its agent and its rank
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
        for name, value in [("secret", SECRET), ("token", group.token), ("rendezvous id", group.rdzv_id)]:
            assert value.encode() not in command, (pid, name, command)
    # The values looked for are the ones in use: both agents got this rendezvous id, through their environment.
    agents = [backend.agent_pid, *[p for p in machine if b"worker.agent" in open(f"/proc/{p}/cmdline", "rb").read()]]
    for pid in agents:
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert f"PET_RDZV_ID={group.rdzv_id}".encode() in f.read().split(b"\0"), pid
    assert len(agents) == 2


class _Payload:
    """What the review wrote into the store: a pickle that, once unpickled, runs code (here: creates ``marker``)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class Stranger:
    """A plain TCP store client without the secret, handed the rendezvous id of whichever backend is current: it
    writes ``payload`` into every key of node 0's store it can name, again and again, until stopped."""

    pause_s = 0.1  # between rounds of writes

    def __init__(self, endpoint: str, backend, payload: bytes):
        self.host, self.port = endpoint.rsplit(":", 1)
        self.backend, self.payload = backend, payload
        self.writes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def where(self) -> tuple[str, int] | None:
        """The store to write into, None while there is none to find."""
        return self.host, int(self.port)

    def keys(self, store: torch.distributed.TCPStore) -> list[str]:
        spec, group = self.backend.spec, self.backend._group
        ids = ["none"] + ([group.rdzv_id] if group is not None and group.rdzv_id else [])
        keys = [BEACON_KEY]
        for rdzv_id in ids:  # c10d's pickled state (no longer read), the claims, torchrun's own keys
            keys += [f"torch.rendezvous.{rdzv_id}", *(claim_key(rdzv_id, n) for n in range(spec.nnodes + 1))]
            for n in range(spec.nnodes):
                keys += [f"{rdzv_id}/torchelastic/role_info/{n}", f"{rdzv_id}/torchelastic/assigned_ranks/{n}"]
        ranks = "default_pg/0//parallel_diffusers/"  # the ranks' op protocol (see test_faults)
        for r in range(spec.world_size):
            keys += [f"{ranks}hello/{r}", f"comfy-parallel/beat/{r}", f"comfy-parallel/traceback/{r}"]
        for seq in range(1, 40):
            keys += [f"{ranks}op/{seq}", f"{ranks}ack/{seq}", *(f"{ranks}done/{seq}/{r}" for r in range(2))]
        return keys

    def value(self, key: str) -> bytes:
        """What goes into ``key``: the payload, base64-encoded where torch's c10d rendezvous keeps its state (which it
        decodes before unpickling)."""
        return base64.b64encode(self.payload) if key.startswith("torch.rendezvous.") else self.payload

    def _run(self) -> None:
        store = None
        while not self._stop.is_set():
            try:
                if store is None:
                    if (where := self.where()) is None:
                        raise OSError("no store to write into yet")
                    socket.create_connection(where, timeout=1.0).close()
                    store = torch.distributed.TCPStore(
                        *where, is_master=False, timeout=timedelta(seconds=2), wait_for_workers=False
                    )
                for key in self.keys(store):
                    store.set(key, self.value(key))
                    self.writes += 1
            except (OSError, RuntimeError):  # nothing listens (between backends), or the store went away
                store = None
            self._stop.wait(self.pause_s)

    def __enter__(self) -> Stranger:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


class LocalStranger(Stranger):
    """Another user of this machine, against a one-machine backend: it finds the store among the LISTEN sockets of
    the backend's agent (``ss -ltn`` shows every user the port), lists its keys (``TCPStore.list_keys``) and writes
    ``payload`` into each of them and into the key of torch's c10d rendezvous state for every prefix it sees, as fast
    as it can."""

    pause_s = 0.02

    def __init__(self, backend, payload: bytes):
        super().__init__("127.0.0.1:0", backend, payload)
        self.seen: set[str] = set()

    def where(self) -> tuple[str, int] | None:
        if (pid := self.backend.agent_pid) is None:
            return None
        try:
            sockets = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:  # the agent is gone
            return None
        ports = [c.laddr.port for c in sockets if c.status == psutil.CONN_LISTEN]
        return (self.host, ports[0]) if ports else None

    def keys(self, store: torch.distributed.TCPStore) -> list[str]:
        listed = store.list_keys()
        self.seen.update(listed)
        prefixes = {"none", *(key.split("/", 1)[0] for key in listed if "/" in key)}
        return [*listed, *(f"torch.rendezvous.{prefix}" for prefix in prefixes)]


def _attempt(outcomes: dict[str, str], what: str, action: Callable[[], object]) -> None:
    """Run ``action`` while a stranger writes; ``outcomes[what]``: "served", or the error it ended with."""
    try:
        action()
        outcomes[what] = "served"
    except ParallelRuntimeError as e:
        outcomes[what] = f"{type(e).__name__}: {e}"


def _forty_steps(backend) -> None:
    assert backend.call(StepsArgs(steps=40, seconds_per_step=0.05)).result.completed == 40


def _assert_served_or_clear(outcomes: dict[str, str]) -> None:
    """Each attacked start-up or run served, or ended with an error of the pack's (never a hang or a crash)."""
    for outcome in outcomes.values():
        assert outcome == "served" or outcome.split(":")[0] in ("BackendStartError", "BackendDied"), outcomes


def _next_run(backend, args, outcomes: dict, cluster: dict):
    try:
        return backend.call(args)
    except ParallelRuntimeError as e:
        pytest.fail(
            f"the run after the attack failed: {e}\nduring it: {outcomes}\nnode 1:\n{cluster['machine'].output}"
        )


def test_a_stranger_who_writes_pickles_into_every_key_runs_nothing(cluster, tmp_path, monkeypatch):
    """The review's attack (issue 21), during a start-up and during a run: the marker its pickle would write is never
    written (nothing of either machine unpickles what the store holds), the backend serves on or fails with an error,
    and the next run works with the same joined machine."""
    from parallel_runtime.watchdog import Deadlines

    marker, probe = tmp_path / "ran", tmp_path / "probe"
    pickle.loads(pickle.dumps(_Payload(str(probe))))
    assert probe.exists()  # the payload is live: unpickled anywhere, it writes its marker
    spec = cluster["spec"]
    backend = get_backend(spec)
    monkeypatch.setenv("COMFY_PARALLEL_JOIN_S", "45")  # a start-up the stranger spoils fails after this
    deadlines = backend.deadlines
    backend.deadlines = Deadlines(load_s=60, stall_floor_s=20, heartbeat_s=10, stopped_s=2, cancel_s=4)
    outcomes = {}
    try:
        backend.shutdown()
        with Stranger(cluster["endpoint"], backend, pickle.dumps(_Payload(str(marker)))) as stranger:
            _attempt(outcomes, "start-up", backend.start)
            written = stranger.writes
        assert written > 0
        assert _next_run(backend, StatusArgs(), outcomes, cluster).result.world_size == 2
        with Stranger(cluster["endpoint"], backend, pickle.dumps(_Payload(str(marker)))) as stranger:
            _attempt(outcomes, "run", lambda: _forty_steps(backend))
            wait_for(lambda: stranger.writes > written, 60, "the stranger writing into the running backend's store")
        assert _next_run(backend, StepsArgs(steps=2, seconds_per_step=0), outcomes, cluster).result.completed == 2
    finally:
        backend.deadlines = deadlines
        # The stranger's writes stay in the store of a backend that served on (its beacon among them, which a machine
        # joining later cannot open): the module's next test starts from a fresh backend and store.
        backend.shutdown()
    assert not marker.exists(), outcomes
    assert cluster["machine"].proc.poll() is None  # the joined machine serves on
    _assert_served_or_clear(outcomes)


def test_a_local_stranger_who_lists_a_one_machine_backends_keys_runs_nothing(tmp_path):
    """Issue 21 on one machine: its agent's store listens on loopback, where every user of the machine can find it
    and list its keys. Such a user writing code-running pickles into all of them, during a start-up and during a run,
    runs nothing (the agent runs torchrun's static rendezvous, which unpickles nothing, as over several machines); the
    backend serves on or fails with an error, and the next run works."""
    from parallel_runtime.watchdog import Deadlines

    marker, probe = tmp_path / "ran", tmp_path / "probe"
    pickle.loads(pickle.dumps(_Payload(str(probe))))
    assert probe.exists()  # the payload is live: unpickled anywhere, it writes its marker
    deadlines = Deadlines(load_s=60, stall_floor_s=20, heartbeat_s=10, stopped_s=2, cancel_s=4)
    backend = Backend(BackendSpec(ranks=2, device="cpu"), deadlines=deadlines)
    payload, outcomes, groups = pickle.dumps(_Payload(str(marker))), {}, []
    try:
        with LocalStranger(backend, payload) as stranger:
            _attempt(outcomes, "start-up", backend.start)
            written = stranger.writes
        assert not marker.exists(), outcomes
        assert written > 0, outcomes
        assert backend.call(StatusArgs()).result.world_size == 2, outcomes
        groups.append((backend.agent_pid, list(backend.worker_pids.values()), backend.run_dir, backend.shm_prefix))
        with LocalStranger(backend, payload) as stranger:
            _attempt(outcomes, "run", lambda: _forty_steps(backend))
            wait_for(
                lambda: stranger.writes > 0 and any("parallel_diffusers" in key for key in stranger.seen),
                60,
                f"the stranger writing into the ranks' op keys (it saw {stranger.seen})",
            )
        assert backend.call(StepsArgs(steps=2, seconds_per_step=0)).result.completed == 2, outcomes
        groups.append((backend.agent_pid, list(backend.worker_pids.values()), backend.run_dir, backend.shm_prefix))
    finally:
        backend.shutdown()
    assert not marker.exists(), outcomes
    _assert_served_or_clear(outcomes)
    for agent, ranks, run_dir, prefix in groups:
        assert_nothing_left([agent, *ranks], [run_dir], prefix)


def test_a_rank_refuses_object_collectives(tmp_path):
    """torch's object collectives unpickle what a peer sends (gloo and NCCL authenticate nobody): in a rank they fail
    instead; their weights_only form, which unpickles only plain data, still works."""
    from torch.distributed import distributed_c10d

    from parallel_runtime.worker.remote import refuse_object_collectives

    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    unpickler = distributed_c10d._unpickler
    try:
        gathered: list = [None]
        torch.distributed.all_gather_object(gathered, {"a": 1})
        assert gathered == [{"a": 1}]  # what the refusal replaces does unpickle
        refuse_object_collectives()
        with pytest.raises(RuntimeError, match="unpickle what another rank sends"):
            torch.distributed.all_gather_object(gathered, {"a": 1})
        torch.distributed.all_gather_object(gathered, {"a": 2}, weights_only=True)
        assert gathered == [{"a": 2}]
    finally:
        distributed_c10d._unpickler = unpickler
        torch.distributed.destroy_process_group()


REFUSALS = {  # (secret, node rank) → what the refused machine is told
    "wrong secret": ("not-the-secret", 1, "the backend holds a different secret"),
    "no secret": (None, 1, "refused: no secret"),
    "node rank taken": (SECRET, 1, "node rank 1 of this backend is already taken"),
    "node rank out of range": (SECRET, 5, "--node-rank 5 is not a node of this backend"),
}


def test_a_machine_that_may_not_join_is_refused_and_the_group_goes_on(cluster):
    """Four machines that may not take part, at once, while the group is in use: each is refused with the reason,
    none touches the group (same ranks, still answering), and no secret reaches their output."""
    backend = get_backend(cluster["spec"])
    backend.call(StatusArgs())  # started and joined before the intruders knock (an earlier test may have shut it down)
    pids = dict(backend.worker_pids)
    intruders = {case: Machine(cluster["endpoint"], node, secret) for case, (secret, node, _) in REFUSALS.items()}
    assert backend.call(StepsArgs(steps=20, seconds_per_step=0.05)).result.completed == 20
    for case, intruder in intruders.items():
        assert intruder.proc.wait(90) == 2, (case, intruder.output)
        assert "refused: " in intruder.output and REFUSALS[case][2] in intruder.output, (case, intruder.output)
        assert SECRET not in intruder.output
    assert backend.worker_pids == pids and backend.call(StatusArgs()).result.world_size == 2
    assert backend.call(StepsArgs(steps=2, seconds_per_step=0)).result.completed == 2


def test_rank_0_killed_is_named_and_the_joined_machine_rejoins_by_itself(cluster):
    """A failure on the ComfyUI host: rank 0 is named (not the machine whose heartbeats it relayed), the remote ranks
    leave, and the same ``comfy-parallel join`` serves the next backend without anyone touching that machine."""
    backend = get_backend(cluster["spec"])
    backend.call(StatusArgs())  # started, with node 1 joined (an earlier test may have shut it down)
    joined = cluster["machine"].output.count("joining a backend")
    remote_pid = backend._group.remote_ranks()[1]["pid"]
    rank0 = backend.worker_pids[0]
    with pytest.raises(BackendDied) as failure:
        backend.call(
            StepsArgs(steps=400, seconds_per_step=0.05), on_progress=at_step(3, os.kill, rank0, signal.SIGKILL)
        )
    assert failure.value.rank == 0 and "rank 0 (pid" in str(failure.value), str(failure.value)
    wait_for(lambda: not process_alive(remote_pid), 30, "the remote rank left")
    assert backend.call(StatusArgs()).result.world_size == 2  # a fresh backend: node 1 joined it by itself
    assert cluster["machine"].proc.poll() is None
    wait_for(lambda: cluster["machine"].output.count("joining a backend") == joined + 1, 30, "one join more")


def test_a_machine_killed_mid_run_is_named_and_the_next_prompt_runs_once_it_rejoined(cluster):
    spec = cluster["spec"]
    backend = get_backend(spec)
    remote = backend._group.remote_ranks()[1]
    dead_dirs = cluster["machine"].run_dirs()
    with pytest.raises(BackendDied) as failure:
        backend.call(StepsArgs(steps=400, seconds_per_step=0.05), on_progress=at_step(3, cluster["machine"].kill))
    message = str(failure.value)
    assert f"rank 1 on node 1 ({remote['host']}, pid {remote['pid']})" in message, message
    assert failure.value.rank == 1
    assert not backend.running
    cluster["machine"] = Machine(cluster["endpoint"])  # the machine is back
    status = backend.status()
    assert status.world_size == 2 and list(backend._group.remote_ranks()) == [1]
    # What the killed machine could not clean up, the next launch there swept away.
    assert dead_dirs and not any(os.path.exists(d) for d in dead_dirs)


def test_a_machine_that_never_joins_is_named_with_its_command(secret_env, monkeypatch):
    monkeypatch.setenv("COMFY_PARALLEL_JOIN_S", "4")
    from parallel_runtime import Backend

    endpoint = f"127.0.0.1:{free_port()}"
    backend = Backend(default_spec(device="cpu", ranks=1, nnodes=3, rdzv_endpoint=endpoint))
    launched, launch = [], launcher.launch

    def launch_and_keep(spec: BackendSpec, collective_timeout_s: float | None = None) -> launcher.LaunchedGroup:
        launched.append(launch(spec, collective_timeout_s))
        return launched[-1]

    monkeypatch.setattr(launcher, "launch", launch_and_keep)
    started = time.monotonic()
    with pytest.raises(BackendStartError) as failure:
        backend.start()
    assert time.monotonic() - started < 60
    (group,) = launched  # nothing of it is left: its torchrun agent (which hosted the rendezvous), its run directory
    assert not process_alive(group.proc.pid) and not os.path.exists(group.run_dir.path)
    message = str(failure.value)
    for node in (1, 2):
        assert f"node {node} of 3 did not join within 4 s" in message, message
        assert f"comfy-parallel join {endpoint} --node-rank {node}" in message
    assert SECRET not in message  # errors are logged: the command names where to find the secret instead
    assert not backend.running


@pytest.mark.parametrize(
    "widgets, widget, hint",
    [
        ({"nnodes": 2, "rdzv_endpoint": ""}, "rdzv_endpoint", "needs host:port"),
        ({"nnodes": 2, "rdzv_endpoint": "127.0.0.1"}, "rdzv_endpoint", "is not host:port"),
        ({"nnodes": 2, "rdzv_endpoint": "192.0.2.77:29400"}, "rdzv_endpoint", "is not an IPv4 address of this machine"),
        ({"nnodes": 0}, "nnodes", "the number of machines"),
    ],
)
def test_multi_machine_widgets_name_the_widget_and_the_fix(widgets, widget, hint):
    with pytest.raises(InvalidInput) as error:
        default_spec(device="cpu", ranks=1, **widgets)
    assert error.value.widget == widget and hint in str(error.value)


def _two_machines_of_two_ranks(deadlines=None):
    """A started backend of 2 machines × 2 ranks (ranks 0 and 1 on node 0, the ComfyUI host) and the joined
    machine."""
    spec, machine = _two_machines(ranks=2, deadlines=deadlines)
    return spec, machine, get_backend(spec)


def test_two_machines_of_two_ranks_match_one_process_and_a_stopped_machine_is_named(secret_env, one_process):
    """2 machines × 2 ranks, Unified ring 2 × Ulysses 2 (each ring step crosses the machines) against one process.
    Then a network partition, played by stopping every process of the joined machine: not a hang, but BackendDied
    naming the machine once its heartbeat is older than the deadline; once it runs again it serves the next backend,
    and nothing of either is left after."""
    from parallel_runtime.watchdog import Deadlines

    spec, machine, backend = _two_machines_of_two_ranks(
        Deadlines(load_s=60, stall_floor_s=30, heartbeat_s=6, stopped_s=2, cancel_s=4)
    )
    stopped: list[int] = []
    try:
        assert sorted(backend._group.remote_ranks()) == [2, 3]
        image = generate(spec, "context_parallel", ring_degree=2, ulysses_degree=2)
        assert (image - one_process(3, 64, 64)).abs().max() <= 1e-4
        remote = backend._group.remote_ranks()[2]
        stopped = machine.processes()
        started = time.monotonic()
        with pytest.raises(BackendDied) as failure:
            stop = at_step(3, lambda: [os.kill(p, signal.SIGSTOP) for p in stopped])
            backend.call(StepsArgs(steps=400, seconds_per_step=0.05), on_progress=stop)
        message = str(failure.value)
        assert f"on node 1 ({remote['host']}, pid " in message and "no heartbeat for" in message, message
        assert time.monotonic() - started < 30  # a liveness bound: the heartbeat deadline is 6 s
        for p in stopped:
            os.kill(p, signal.SIGCONT)
        assert backend.call(StatusArgs()).result.world_size == 4
        local = [backend.agent_pid, *backend.worker_pids.values()]
        run_dir, prefix = backend.run_dir, backend.shm_prefix
        remote_pids, remote_dirs = machine.processes(), machine.run_dirs()
    finally:
        for p in stopped:  # a failed check above must not leave stopped processes that no SIGTERM reaches
            if process_alive(p):
                os.kill(p, signal.SIGCONT)
        backend.shutdown()
        machine.stop()
    assert_nothing_left(local + remote_pids, [run_dir, *remote_dirs], prefix)


@pytest.mark.slow  # the default run has Unified attention over 2 × 2 above
def test_two_machines_of_two_ranks_match_one_process(secret_env, one_process):
    """2 machines × 2 ranks: the other strategies whose collectives cross the machines (Ulysses 4, tensor parallel 4,
    data parallel over a batch of 4) against one process."""
    spec, machine, backend = _two_machines_of_two_ranks()
    try:
        reference = one_process(3, 64, 64)
        for strategy, args in [("context_parallel", {"ulysses_degree": 4}), ("tensor_parallel", {"tp_degree": 4})]:
            image = generate(spec, strategy, **args)
            assert (image - reference).abs().max() <= 1e-4, (strategy, args)
        images = generate(spec, "data_parallel", batch_size=4)
        batch = one_process(3, 64, 64, batch_size=4)
        for i in range(4):  # one image per rank, each from its own seed; see test_strategies for the tolerance
            assert (images[i] - batch[i]).abs().max() <= 1e-5, i
        local = [backend.agent_pid, *backend.worker_pids.values()]
        run_dir, prefix = backend.run_dir, backend.shm_prefix
        remote_pids, remote_dirs = machine.processes(), machine.run_dirs()
    finally:
        backend.shutdown()
        machine.stop()
    assert_nothing_left(local + remote_pids, [run_dir, *remote_dirs], prefix)


def test_the_interface_of_an_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: no interface of this machine holds it


def test_the_cluster_secret_is_made_once_and_kept_private(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    first = cluster_secret()
    path = tmp_path / "comfyui-parallel-diffusers" / "secret"
    assert len(first) == 64 and path.read_text() == first
    assert path.stat().st_mode & 0o777 == 0o600
    assert cluster_secret() == first  # joined machines stay valid across ComfyUI restarts
    monkeypatch.setenv(SECRET_ENV, "from-the-environment")
    assert cluster_secret() == "from-the-environment"


def test_the_backend_node_shows_the_join_command_and_checks_the_endpoint(nodes, secret_env, caplog):
    with caplog.at_level(logging.INFO, logger="parallel_nodes"):
        (spec,) = (
            nodes["ParallelBackend"]
            .execute(ranks=1, device="cpu", memory_policy="staged", nnodes=2, rdzv_endpoint="127.0.0.1:29400")
            .args
        )
    assert (spec.nnodes, spec.rdzv_endpoint, spec.world_size) == (2, "127.0.0.1:29400", 2)
    # The node's text goes to whoever queued the prompt and into the log, both served over HTTP: no secret in it.
    (text,) = [r.getMessage() for r in caplog.records if "On each other machine run" in r.getMessage()]
    assert join_command("127.0.0.1:29400", 1) in text and f"the {SECRET_ENV} this ComfyUI was started with" in text
    assert SECRET not in text
    with pytest.raises(InvalidInput) as error:
        nodes["ParallelBackend"].execute(
            ranks=1, device="cpu", memory_policy="staged", nnodes=2, rdzv_endpoint="192.0.2.77:29400"
        )
    assert error.value.widget == "rdzv_endpoint"
    (spec,) = nodes["ParallelBackend"].execute(ranks=1, device="cpu", memory_policy="staged").args
    assert spec.nnodes == 1 and spec.rdzv_endpoint is None  # a workflow saved before these widgets
