"""Several machines: the command that joins a machine, and what that command runs (``comfy-parallel join``).

The ComfyUI host is node 0: rank 0 and the shared memory stay there, and its torchrun agent hosts the store of
torchrun's static rendezvous on ``rdzv_endpoint``. Every other machine runs ``comfy-parallel join <rdzv_endpoint>
--node-rank <k>`` with the cluster secret in ``COMFY_PARALLEL_SECRET`` (or ``--secret-file``, or typed at its prompt).
That command stays up and serves every backend the ComfyUI host starts: it waits for node 0's beacon
(``rendezvous``), opens it with the secret, claims its node rank, runs torchrun's agent for that backend, and when
that backend ends (shut down, a rank died) waits for the next one, so a restart needs nobody at the other machine.

The secret never travels over the network and is never logged or put on a command line. The ComfyUI host keeps it in
``COMFY_PARALLEL_SECRET`` or in a 0600 file of its own (``rendezvous.cluster_secret``); the join commands the node's
text and the status show carry a placeholder and say where the secret is (``where_the_secret_is``); only the Parallel
tab in a browser on the host itself shows the commands with it (``parallel_nodes/routes.py``). The joining machine
reads it from its environment, a file or a prompt, never from its command line, which other users of that machine
could read.

A record in node 0's store that does not open with the secret is a stranger's (the store has no credentials): a
machine that has opened a beacon there before ignores a forged one and waits for the next, and a forged claim of its
node rank is overwritten. Only a machine that never opened one is refused, as its secret is then the likely culprit.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from . import launcher
from .processes import children
from .rendezvous import (
    BEACON_KEY,
    SECRET_ENV,
    Beacon,
    Claim,
    claim_key,
    cluster_secret,
    route_to,
    seal,
    secret_file,
    split_endpoint,
    unseal,
)
from .sealed import Tampered

POLL_S = 1.0  # how often a joining machine looks for the next backend


def join_command(rdzv_endpoint: str, node_rank: int, secret: str | None = None) -> str:
    """The command to run on the machine of node ``node_rank``; ``secret`` None leaves a placeholder (what every view
    but the host's own browser gets, and errors and logs, which must not carry it)."""
    value = secret if secret is not None else "<the cluster secret>"
    return f"{SECRET_ENV}={value} comfy-parallel join {rdzv_endpoint} --node-rank {node_rank}"


def join_commands(rdzv_endpoint: str, nnodes: int, with_secret: bool = False) -> list[str]:
    secret = cluster_secret() if with_secret else None
    return [join_command(rdzv_endpoint, k, secret) for k in range(1, nnodes)]


def where_the_secret_is() -> str:
    """Where the user finds the cluster secret that the join commands leave out."""
    source = (
        f"the {SECRET_ENV} this ComfyUI was started with"
        if os.environ.get(SECRET_ENV)
        else f"in {secret_file()} on this machine"
    )
    return (
        f"<the cluster secret> is {source}; the Parallel tab shows the commands with it only in a browser on this "
        "machine. Keep it private: it lets a machine join"
    )


def _store(rdzv_endpoint: str, timeout_s: float):  # a TCPStore (torch.distributed is imported lazily)
    import torch.distributed as dist

    host, port = split_endpoint(rdzv_endpoint)
    return dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False, use_libuv=True
    )


def claims(rdzv_endpoint: str, rdzv_id: str, nnodes: int, secret: str) -> dict[int, Claim]:
    """The machines that claimed a node rank of backend ``rdzv_id`` (forged claims left out); empty when the store
    cannot be reached."""
    try:
        store = _store(rdzv_endpoint, 2.0)
    except Exception:  # the store is gone (its agent exited)
        return {}
    found = {}
    for node in range(1, nnodes):
        key = claim_key(rdzv_id, node)
        try:
            if store.check([key]):
                found[node] = unseal(secret, key, store.get(key), Claim)
        except (Tampered, RuntimeError):
            continue
    return found


class JoinRefused(Exception):
    """This machine cannot take part in the backend it found; the message says why and what to do."""


class ForeignBeacon(JoinRefused):
    """The beacon does not open with this machine's secret: sealed with another one, or written by a stranger."""


def _read_beacon(rdzv_endpoint: str, secret: str) -> Beacon | None:
    """The beacon of the backend node 0 is starting; None when there is none (node 0 is not up, or between
    backends). ForeignBeacon when it does not open with ``secret``."""
    host, port = split_endpoint(rdzv_endpoint)
    try:  # a plain connection first: torch's store client logs every failed attempt, and node 0 may be down for hours
        socket.create_connection((host, port), timeout=2.0).close()
        store = _store(rdzv_endpoint, 2.0)
        if not store.check([BEACON_KEY]):
            return None
        record = store.get(BEACON_KEY)
    except Exception:  # refused, timed out, or the store went away: no backend to join yet
        return None
    try:
        return unseal(secret, BEACON_KEY, record, Beacon)
    except Tampered:
        raise ForeignBeacon(
            f"the backend at {rdzv_endpoint} published a beacon this machine's secret does not open, so this machine "
            "may not join it: either the backend holds a different secret (copy the join command again from the "
            "Parallel Backend node, or the Parallel tab, on the ComfyUI host), or something other than the ComfyUI "
            "host wrote that beacon into its store (a stranger on the network: check who can reach that port)"
        ) from None


def _claim(rdzv_endpoint: str, beacon: Beacon, node_rank: int, secret: str) -> None:
    key = claim_key(beacon.rdzv_id, node_rank)
    mine = seal(secret, key, Claim(node_rank, socket.gethostname(), os.getpid()))
    store = _store(rdzv_endpoint, 5.0)
    held = store.compare_set(key, "", mine)
    if held != mine:
        try:
            other = unseal(secret, key, held, Claim)
        except Tampered:  # a stranger's record, not a machine's: the node rank is free
            store.set(key, mine)
            return
        holder = f"{other.host} (pid {other.pid})"
        raise JoinRefused(
            f"node rank {node_rank} of this backend is already taken by {holder}: give each machine its "
            "own --node-rank (1..nnodes-1)"
        )


def join(
    rdzv_endpoint: str,
    node_rank: int,
    secret: str,
    address: str | None = None,
    *,
    once: bool = False,
    say: Callable[[str], None] = print,
) -> int:
    """Serve node ``node_rank`` of every backend the ComfyUI host at ``rdzv_endpoint`` starts, until SIGINT/SIGTERM
    (or after one backend with ``once``). Returns the exit status: 0, or 2 when this machine was refused."""
    host, port = split_endpoint(rdzv_endpoint)
    address = address or route_to(host, port)
    stopping: list[int] = []
    previous = {s: signal.signal(s, lambda sig, _: stopping.append(sig)) for s in (signal.SIGINT, signal.SIGTERM)}
    last, waiting, ignored = None, False, False
    try:
        while not stopping:
            try:
                try:
                    beacon = _read_beacon(rdzv_endpoint, secret)
                except ForeignBeacon:
                    if last is None:  # never opened one: this machine's secret is the likely culprit
                        raise
                    if not ignored:
                        say(f"ignored a beacon at {rdzv_endpoint} that does not open with this machine's secret")
                        ignored = True
                    beacon = None
                if beacon is None or beacon.rdzv_id == last:
                    if not waiting:
                        say(f"waiting for a backend at {rdzv_endpoint} (node {node_rank}, this machine at {address})")
                        waiting = True
                    time.sleep(POLL_S)
                    continue
                if not 1 <= node_rank < beacon.nnodes:
                    raise JoinRefused(
                        f"--node-rank {node_rank} is not a node of this backend ({beacon.nnodes} machines: use "
                        f"1..{beacon.nnodes - 1}; node 0 is the ComfyUI host)"
                    )
                _claim(rdzv_endpoint, beacon, node_rank, secret)
            except JoinRefused as e:
                say(f"refused: {e}")
                return 2
            last, waiting, ignored = beacon.rdzv_id, False, False
            first = node_rank * beacon.ranks
            say(
                f"joining a backend of {beacon.nnodes} machines × {beacon.ranks} {beacon.device} ranks as node "
                f"{node_rank} (ranks {first}..{first + beacon.ranks - 1})"
            )
            group = launcher.launch_joined(beacon, rdzv_endpoint, node_rank, address)
            try:
                _serve(group, rdzv_endpoint, secret, stopping)
            finally:
                launcher.terminate(group)
            say(f"the backend ended; node {node_rank} left it" + ("" if stopping else " and waits for the next one"))
            if once:
                return 0
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(group: launcher.LaunchedGroup, rdzv_endpoint: str, secret: str, stopping: list[int]) -> None:
    """Wait for this machine's part of one backend to end. Until its ranks start (the rendezvous), a beacon that
    changed means node 0 gave up on that backend and started another: leave it for the next. Once they have ended,
    torchrun's agent may still wait for node 0's in its exit barrier: that is the end too."""
    next_look = time.monotonic() + 2.0
    started = False
    while group.proc.poll() is None and not stopping:
        time.sleep(0.2)
        ranks = children(group.proc.pid)
        started = started or bool(ranks)
        if (started and not ranks) or (not ranks and time.monotonic() > next_look):
            next_look = time.monotonic() + 2.0
            try:
                beacon = _read_beacon(rdzv_endpoint, secret)
            except ForeignBeacon:
                continue  # a stranger's record, not node 0 giving up
            if beacon is None or beacon.rdzv_id != group.rdzv_id:
                return


def main_join(rdzv_endpoint: str, node_rank: int, address: str | None, secret_path: str | None, once: bool) -> int:
    """``comfy-parallel join``: read the secret (``COMFY_PARALLEL_SECRET``, ``--secret-file``, or a prompt)."""
    if secret_path:
        with open(secret_path) as f:
            secret = f.read().strip()
        if os.stat(secret_path).st_mode & 0o077:
            print(f"warning: other users may read {secret_path} (chmod 600 it): it lets a machine join", flush=True)
    elif os.environ.get(SECRET_ENV):
        secret = os.environ[SECRET_ENV]
    elif sys.stdin.isatty():
        import getpass

        secret = getpass.getpass("the cluster secret (the ComfyUI host's Parallel tab shows it): ").strip()
    else:
        secret = ""
    if not secret:
        print(f"refused: no secret; set {SECRET_ENV} as the join command shown on the ComfyUI host does", flush=True)
        return 2
    try:
        split_endpoint(rdzv_endpoint)
    except ValueError as e:
        print(f"rdzv_endpoint: {e}", flush=True)
        return 2
    return join(rdzv_endpoint, node_rank, secret, address, once=once, say=lambda line: print(line, flush=True))
