#!/usr/bin/env python3
"""How fast tensors and ops travel between the client and the backend, as ratios measured in one run.

    python bench/transport.py [--ranks 2] [--repeats 10] [--sizes 1 16 256] [--json]

For each size, three ways of sending a float32 tensor to another process and getting it back:

* ``arena``: the backend's ``echo`` op, a rank-0 op that returns its inputs. Client → input segment →
  rank 0 → output segment → client: each direction is a copy in and a copy out of reused /dev/shm.
* ``2×memcpy``: ``dst.copy_(src)`` on one thread into a preallocated tensor, doubled because a round
  trip moves the data twice. The floor a shared-memory transport is held to, and a strict one: it
  allocates nothing, while a transport that hands back a new tensor also faults in its fresh pages.
* ``pipe``: how peer projects move tensors: pickle, send through a ``multiprocessing`` Pipe to a child
  that unpickles, re-pickles and sends it back.

Then the latency of a whole op with no tensors: ``status`` (every rank runs it) and ``echo`` (rank 0 only).

Absolute times on a shared machine swing by 2× from one minute to the next, so the three transports are
measured interleaved (one of each per repetition, so a noisy moment hits all three alike) and the report
is in ratios. Targets: pipe/arena ≥ 5× at 256 MB, arena/2×memcpy ≤ 3× from 16 MB, status p50 < 2 ms.
Exit status 1 if the backend left a shared-memory segment behind; a missed target is reported, not fatal
(on a shared machine it can be noise: run it again before believing it).
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable

import torch

# Runnable as a plain script from a checkout: the package is not necessarily installed in the venv.
# (The backend's ranks find it on their own: the launcher puts the package root on their PYTHONPATH.)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel_runtime import Backend, BackendSpec
from parallel_runtime.arena import SHM_DIR
from parallel_runtime.wire import EchoArgs, StatusArgs

MB = 1 << 20
# Where the ratio targets apply. Below ~16 MB a round trip costs the op's fixed latency (~1 ms, measured
# separately) rather than its bytes, so a ratio to a 0.1 ms memcpy says nothing about the transport.
MEMCPY_TARGET_MIN_MB = 16
PIPE_TARGET_MIN_MB = 256
PIPE_OVER_ARENA_MIN = 5.0
ARENA_OVER_MEMCPY_MAX = 3.0
STATUS_P50_MAX_MS = 2.0


def _pipe_echo_child(conn: multiprocessing.connection.Connection) -> None:
    """The peer-project worker: unpickle each tensor, pickle it again, send it back; b"" ends the loop."""
    while data := conn.recv_bytes():
        conn.send_bytes(pickle.dumps(pickle.loads(data)))
    conn.close()


class PipeEcho:
    """A child process that echoes pickled tensors through a ``multiprocessing.Pipe``.

    The tensor goes through ``pickle.dumps`` + ``send_bytes``, never ``conn.send(t)``: importing torch
    registers ForkingPickler reductions (torch.multiprocessing) that would move a tensor into shared memory
    and send only a file descriptor, which is not what a pickling transport costs.
    """

    def __init__(self) -> None:
        # spawn, not fork: libgomp is not fork-safe, and the child copies tensors (OpenMP) after the parent
        # has started its thread pool.
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_pipe_echo_child, args=(child_conn,), daemon=True)
        self.proc.start()
        child_conn.close()

    def round_trip(self, t: torch.Tensor) -> torch.Tensor:
        self.conn.send_bytes(pickle.dumps(t))
        return pickle.loads(self.conn.recv_bytes())

    def close(self) -> None:
        try:
            self.conn.send_bytes(b"")
        except OSError:
            pass  # the child is already gone
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile: with 300 samples p99 is the 297th, a measured value, not an interpolation."""
    ordered = sorted(samples)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))]


def bench_size(backend: Backend, pipe: PipeEcho, size_mb: int, repeats: int) -> dict:
    """Median ms per round trip of the three transports for one tensor size."""
    src = torch.rand(size_mb * MB // 4)
    dst = torch.empty_like(src)

    # Warm-up, discarded: the first echo of a size grows both arena segments and faults their pages in.
    # It also checks that the data really made the trip, so what is timed is a working transport.
    if not torch.equal(backend.call(EchoArgs(), tensors={"x": src}).tensors["x"], src):
        raise AssertionError(f"arena echo of {size_mb} MB came back different")

    def arena() -> float:
        return _seconds(lambda: backend.call(EchoArgs(), tensors={"x": src}))

    def memcpy() -> float:
        # On one thread, as the ranks copy (torchrun sets OMP_NUM_THREADS=1 for them). On a busy machine a
        # copy split over the client's threads waits whole 4 ms scheduler ticks for the thread that lost its
        # core (a 1 MB copy then takes 4-40 ms): that measures the scheduler, not the memory.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _seconds(lambda: dst.copy_(src))
        finally:
            torch.set_num_threads(threads)

    def pipe_round_trip() -> float:
        # No discarded warm-up for the pipe: it has no state to warm (every call allocates fresh buffers on
        # both sides), and at 256 MB one call takes seconds. The median absorbs a slow first call.
        t0 = time.perf_counter()
        out = pipe.round_trip(src)
        seconds = time.perf_counter() - t0
        if not torch.equal(out, src):
            raise AssertionError(f"pipe echo of {size_mb} MB came back different")
        return seconds

    # Interleaved, one of each per repetition, so that a noisy moment of the machine hits all three alike.
    times: dict[str, list[float]] = {"arena": [], "memcpy": [], "pipe": []}
    for _ in range(repeats):
        for name, measure in (("arena", arena), ("memcpy", memcpy), ("pipe", pipe_round_trip)):
            times[name].append(measure())

    arena_ms, memcpy_ms, pipe_ms = (statistics.median(times[k]) * 1e3 for k in ("arena", "memcpy", "pipe"))
    row = {
        "size_mb": size_mb,
        "repeats": repeats,
        "arena_ms": arena_ms,
        "two_memcpy_ms": 2 * memcpy_ms,
        "pipe_ms": pipe_ms,
        "pipe_over_arena": pipe_ms / arena_ms,
        "arena_over_two_memcpy": arena_ms / (2 * memcpy_ms),
        "arena_gb_per_s": 2 * size_mb * MB / (arena_ms / 1e3) / 1e9,
    }
    if size_mb >= MEMCPY_TARGET_MIN_MB:
        row["arena_over_two_memcpy_ok"] = row["arena_over_two_memcpy"] <= ARENA_OVER_MEMCPY_MAX
    if size_mb >= PIPE_TARGET_MIN_MB:
        row["pipe_over_arena_ok"] = row["pipe_over_arena"] >= PIPE_OVER_ARENA_MIN
    return row


def bench_latency(backend: Backend, calls: int) -> dict:
    """p50/p99 ms of whole ops without tensors, alternating so both see the same machine load."""
    for _ in range(10):  # warm-up: first calls pay for imports and store connections on the ranks
        backend.call(StatusArgs())
        backend.call(EchoArgs())
    times: dict[str, list[float]] = {"status": [], "echo": []}
    for _ in range(calls):
        for op in times:
            times[op].append(_seconds(functools.partial(backend.call, op)))
    out = {
        op: {"calls": calls, "p50_ms": _percentile(ts, 50) * 1e3, "p99_ms": _percentile(ts, 99) * 1e3}
        for op, ts in times.items()
    }
    out["status"]["p50_ok"] = out["status"]["p50_ms"] < STATUS_P50_MAX_MS
    return out


def _mark(ok: bool | None) -> str:
    return "" if ok is None else ("PASS" if ok else "MISS")


def print_report(report: dict) -> None:
    print(
        f"transport benchmark: {report['ranks']} cpu ranks, client torch threads {report['client_threads']}, "
        f"{report['cpus']} cpus (load average {report['load_average']:.1f}), "
        f"backend start {report['startup_s']:.1f} s"
    )
    print()
    print(
        f"{'size':>7} {'n':>3} {'arena ms':>9} {'2×memcpy ms':>12} {'pipe ms':>9} {'arena GB/s':>10}  "
        f"{'pipe/arena (≥5× @256MB)':>24}  {'arena/2×memcpy (≤3× @16MB+)':>28}"
    )
    for r in report["sizes"]:
        pipe_ratio = f"{r['pipe_over_arena']:.1f}× {_mark(r.get('pipe_over_arena_ok'))}"
        memcpy_ratio = f"{r['arena_over_two_memcpy']:.2f}× {_mark(r.get('arena_over_two_memcpy_ok'))}"
        print(
            f"{r['size_mb']:>4} MB {r['repeats']:>3} {r['arena_ms']:>9.2f} {r['two_memcpy_ms']:>12.2f} "
            f"{r['pipe_ms']:>9.2f} {r['arena_gb_per_s']:>10.2f}  {pipe_ratio:>24}  {memcpy_ratio:>28}"
        )
    print()
    lat = report["latency"]
    for op, note in (("status", f"(every rank; target p50 < {STATUS_P50_MAX_MS:g} ms)"), ("echo", "(rank 0 only)")):
        s = lat[op]
        print(
            f"{op:>6} op, no tensors, {s['calls']} calls: p50 {s['p50_ms']:.2f} ms  p99 {s['p99_ms']:.2f} ms  "
            f"{note} {_mark(s.get('p50_ok'))}"
        )
    print()
    print(f"shm segments left behind: {', '.join(report['leftover_segments']) or 'none'}")


def _repeats_for(size_mb: int, repeats: int) -> int:
    """Fewer repetitions for big tensors: a 256 MB pipe round trip alone takes seconds on a busy machine."""
    return max(3, repeats * 16 // size_mb) if size_mb > 16 else repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks of the backend (default 2)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=10,
        help="timed round trips per size up to 16 MB (fewer above, at least 3; default 10)",
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1, 16, 256], metavar="MB", help="tensor sizes in MB (default 1 16 256)"
    )
    parser.add_argument("--latency-calls", type=int, default=300, help="calls per op for p50/p99 (default 300)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if min(args.sizes) < 1 or args.repeats < 1 or args.latency_calls < 1 or args.ranks < 1:
        parser.error("sizes, repeats, latency calls and ranks must be at least 1")

    backend = Backend(BackendSpec(ranks=args.ranks, device="cpu"))
    pipe = PipeEcho()
    try:
        backend.start()
        shm_prefix = backend.shm_prefix
        report = {
            "ranks": args.ranks,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg()[0],  # how busy the machine was: read the timings in its light
            "client_threads": torch.get_num_threads(),
            "startup_s": backend.startup_s,
            "targets": {
                "pipe_over_arena_min": PIPE_OVER_ARENA_MIN,
                "pipe_target_from_mb": PIPE_TARGET_MIN_MB,
                "arena_over_two_memcpy_max": ARENA_OVER_MEMCPY_MAX,
                "memcpy_target_from_mb": MEMCPY_TARGET_MIN_MB,
                "status_p50_max_ms": STATUS_P50_MAX_MS,
            },
            "sizes": [bench_size(backend, pipe, mb, _repeats_for(mb, args.repeats)) for mb in args.sizes],
            "latency": bench_latency(backend, args.latency_calls),
        }
    finally:
        pipe.close()
        backend.shutdown()
    # The runtime promises that no segment outlives a shutdown: hold it to that. Only this backend's prefix
    # is checked, because other backends (tests, other users) may be running on the same machine.
    report["leftover_segments"] = sorted(
        os.path.basename(p) for p in glob.glob(os.path.join(SHM_DIR, glob.escape(shm_prefix) + "*"))
    )

    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 1 if report["leftover_segments"] else 0


if __name__ == "__main__":
    sys.exit(main())
