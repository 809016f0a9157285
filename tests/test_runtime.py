"""The runtime core on real torchrun ranks (CPU, gloo): transport, ops, progress, cancel, failures, cleanup."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

from parallel_runtime import Backend, BackendDied, BackendSpec, Cancelled, OpFailed, launcher
from parallel_runtime.arena import SHM_DIR
from parallel_runtime.client import last_error
from parallel_runtime.processes import process_alive
from parallel_runtime.protocol import Channel, Hello, Refused
from parallel_runtime.wire import AllreduceArgs, EchoArgs, FailArgs, FailMode, StepsArgs

pytestmark = pytest.mark.multirank


def _segments(prefix: str) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]


@pytest.fixture(scope="module")
def backend():
    b = Backend(BackendSpec(ranks=2, device="cpu"))
    b.start()
    yield b
    b.shutdown()


def test_status_shows_two_ranks(backend):
    s = backend.status()
    assert s.world_size == 2
    assert [r.rank for r in s.ranks] == [0, 1]
    assert all(r.device == "cpu" for r in s.ranks)
    assert len({r.pid for r in s.ranks}) == 2
    assert set(backend.worker_pids.values()) == {r.pid for r in s.ranks}
    assert all(r.memory.total_bytes > 0 for r in s.ranks)


def test_socket_directory_is_private(backend):
    assert stat.S_IMODE(os.stat(backend.run_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(backend.run_dir, "token")).st_mode) == 0o600
    for name in _segments(backend.shm_prefix):
        assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, name)).st_mode) == 0o600


ROUND_TRIP = {
    "float32": torch.randn(3, 5, 7),
    "float16": torch.randn(4, 9).half(),
    "bfloat16": torch.randn(2, 3, 8).bfloat16(),
    "int64": torch.arange(-50, 50, dtype=torch.int64).reshape(10, 10),
    "int32": torch.randint(-(2**31), 2**31 - 1, (17,), dtype=torch.int32),
    "uint8": torch.randint(0, 256, (4, 4, 3), dtype=torch.uint8),
    "bool": torch.rand(33) > 0.5,
    "zero_d": torch.tensor(2.5),
    "empty": torch.empty(0, 4),
    "non_contiguous": torch.randn(6, 4).t(),
}


def test_every_dtype_round_trips_bit_exact(backend):
    out = backend.call(EchoArgs(), tensors=ROUND_TRIP).tensors
    assert set(out) == set(ROUND_TRIP)
    for key, t in ROUND_TRIP.items():
        assert out[key].dtype == t.dtype and out[key].shape == t.shape, key
        assert torch.equal(out[key], t), key  # bit-exact: no NaNs in the inputs


def test_large_tensor_round_trips(backend):
    # 16 MiB: 16 × the arena's first segment and over its huge-page threshold, and both ways (client in, rank out)
    # well inside Docker's default /dev/shm of 64 MiB.
    big = torch.randint(0, 2**31 - 1, (16 * 1024 * 1024 // 4,), dtype=torch.int32)
    out = backend.call(EchoArgs(), tensors={"big": big}).tensors["big"]
    assert torch.equal(out, big)
    del out, big
    assert backend.call(EchoArgs(), tensors={"small": torch.ones(3)}).tensors["small"].sum() == 3  # segment reused


def test_collective_result(backend):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    r = backend.call(AllreduceArgs(), tensors={"x": x})
    assert r.result.expected_factor == 3
    assert torch.equal(r.tensors["x"], x * 3)


def test_progress_events_arrive_in_order(backend):
    seen = []
    r = backend.call(StepsArgs(steps=6, seconds_per_step=0.01), on_progress=lambda s, t, _: seen.append((s, t)))
    assert r.result.completed == 6
    assert seen == [(i, 6) for i in range(1, 7)]


def test_cancel_stops_every_rank_at_the_same_step(backend):
    seen = []

    def on_progress(step, total, text):
        seen.append(step)
        if step == 3:
            backend.cancel()

    with pytest.raises(Cancelled) as info:
        backend.call(StepsArgs(steps=200, seconds_per_step=0.02), on_progress=on_progress)
    steps, reached = info.value.steps_by_rank, info.value.reached_at_step
    assert len(steps) == 2 and steps[0] == steps[1], steps
    # Asked at step 3: rank 0 had reported that step or a later one when the Cancel reached it, and every rank
    # stopped there or one step later (how many steps the socket lags by is the machine's load, not tested).
    assert 3 <= reached <= steps[0] <= reached + 1 < 200, (reached, steps)
    assert backend.call(StepsArgs(steps=2, seconds_per_step=0)).result.completed == 2  # still usable


def test_exception_in_progress_callback_cancels_and_is_reraised(backend):
    class Interrupt(BaseException):  # like ComfyUI's InterruptProcessingException
        pass

    def on_progress(step, total, text):
        if step == 2:
            raise Interrupt()

    with pytest.raises(Interrupt):
        backend.call(StepsArgs(steps=100, seconds_per_step=0.02), on_progress=on_progress)
    assert backend.status().world_size == 2


def test_error_on_one_rank_names_it_and_keeps_the_backend(backend):
    pids = backend.worker_pids
    with pytest.raises(OpFailed) as info:
        backend.call(FailArgs(rank=1, how=FailMode.RAISE))
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in str(info.value)
    assert "Traceback" in info.value.traceback
    assert backend.worker_pids == pids
    assert backend.status().world_size == 2
    # The status panel shows it; kept process-wide, so it outlives the backend that failed.
    assert backend.snapshot()["last_error"]["rank"] == 1
    assert last_error()["message"] == str(info.value)


def test_wrong_token_is_refused(backend):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.path.join(backend.run_dir, "control.sock"))
    ch = Channel(sock)
    ch.send(Hello(token="0" * 64))
    assert isinstance(ch.recv(5.0), Refused)
    ch.close()
    assert backend.status().world_size == 2  # the real client is unaffected


def _gone(pids) -> bool:
    return not any(process_alive(p) for p in pids)


def test_shutdown_leaves_nothing_behind():
    b = Backend(BackendSpec(ranks=2, device="cpu"))
    b.call(EchoArgs(), tensors={"x": torch.ones(10)})
    pids, prefix, run_dir, agent = list(b.worker_pids.values()), b.shm_prefix, b.run_dir, b._group.proc.pid
    assert _segments(prefix)
    b.shutdown()
    assert _gone(pids + [agent])
    assert _segments(prefix) == []
    assert not os.path.exists(run_dir)


def test_rank_stuck_in_collective_after_another_failed_is_torn_down():
    b = Backend(BackendSpec(ranks=2, device="cpu"))
    try:
        with pytest.raises(BackendDied) as info:
            b.call(FailArgs(rank=1, how=FailMode.RAISE_BEFORE_COLLECTIVE))
        assert info.value.rank == 1
        assert "deliberate failure on rank 1" in info.value.traceback
        assert b.call(AllreduceArgs(), tensors={"x": torch.ones(2)}).tensors["x"].tolist() == [3.0, 3.0]
    finally:
        b.shutdown()


CLIENT = textwrap.dedent("""
    import sys, time, torch
    from parallel_runtime import Backend, BackendSpec
    from parallel_runtime.wire import EchoArgs
    b = Backend(BackendSpec(ranks=2, device="cpu"))
    b.call(EchoArgs(), tensors={"x": torch.ones(4)})
    print(b.shm_prefix, b.run_dir, *b.worker_pids.values(), flush=True)
    time.sleep(600)
""")


def test_killing_the_client_makes_the_workers_exit():
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": launcher.PACKAGE_ROOT},
    )
    try:
        prefix, run_dir, *pids = proc.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert len(pids) == 2 and _segments(prefix)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while not _gone(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(pids)
        assert _segments(prefix) == []  # rank 0 removed them on its way out
        assert not os.path.exists(run_dir)
    finally:
        proc.kill()


def test_leftovers_of_a_dead_client_are_swept_at_the_next_launch(tmp_path):
    """A group killed with SIGKILL cannot clean up; the next launch removes what it left."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_dir = tempfile.mkdtemp(prefix=launcher.RUN_DIR_PREFIX)
    with open(os.path.join(run_dir, "client.pid"), "w") as f:
        f.write(str(dead.pid))
    segment = os.path.join(SHM_DIR, f"{launcher.SHM_PREFIX}-{dead.pid}-deadbeef-in-0")
    open(segment, "wb").close()
    mine = tempfile.mkdtemp(prefix=launcher.RUN_DIR_PREFIX)  # a live client's run directory stays
    with open(os.path.join(mine, "client.pid"), "w") as f:
        f.write(str(os.getpid()))
    try:
        removed = launcher.sweep_stale()
        assert run_dir in removed and not os.path.exists(run_dir)
        assert not os.path.exists(segment)
        assert os.path.exists(mine)
    finally:
        shutil.rmtree(mine, ignore_errors=True)
