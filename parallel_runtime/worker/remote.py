"""The ranks of a backend over several machines: each proves the backend's secret before rank 0 serves anyone, and
the ranks on other machines (which have no run directory on the ComfyUI host) keep rank 0 informed through the store.

    hello/<rank>                         RankHello  sealed with the token: who the rank is, where it runs
    comfy-parallel/beat/<rank>/<name>    sealed     a remote rank's heartbeat: a count it raises every second
    comfy-parallel/traceback/<rank>      sealed     why a remote rank left the group

The heartbeat is a sealed count that must grow, under a key named with the token (``Sealer.name``), not the store's
own counter (``add``): a stranger cannot keep a dead machine alive by replaying an old beat, nor drown a live one's in
forged records. A remote rank that loses node 0's store leaves the group at once: the backend ended there (or the
network between the machines failed), and without the store it can be told nothing more; its agent, which torchrun's
static rendezvous does not tell, then ends too, and ``comfy-parallel join`` waits for the next backend.

What a rank unpickles: nothing. Every record above is sealed text, and torch's object collectives
(``all_gather_object``, ``broadcast_object_list``, ...), which unpickle what a peer sends over gloo or NCCL (neither
authenticates its peers), refuse to run in a rank (``refuse_object_collectives``); the pack calls none of them.

Rank 0 checks every hello (one that does not open ends the start-up, naming the rank), writes ``rank<N>.node`` for
each remote rank and, from a thread of its own, renews that rank's heartbeat file in the run directory whenever its
counter moves and copies its traceback there: the client's watchdog and its death report then treat a remote rank as
they treat a local one (``watchdog``, ``launcher.LaunchedGroup.describe``), and name its machine. Heartbeats use
connections of their own, so a long store wait of the op protocol never delays one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d

from ..rundir import RunDir
from ..sealed import Sealer, Tampered
from .group import Group
from .heartbeat import HEARTBEAT_S

log = logging.getLogger(__name__)

HELLO_S = 60.0  # every rank has passed init_process_group (a barrier) before it says hello: seconds, not minutes


@dataclasses.dataclass(frozen=True)
class RankHello:
    """A rank's proof that it holds the backend's token, and where it runs.

    Args:
        rank: its global rank.
        node: its machine's node rank (0: the ComfyUI host).
        host: its machine's host name.
        pid: its process id (on that machine).
    """

    rank: int
    node: int
    host: str
    pid: int


class _NoUnpickling:
    """torch's unpickler for the object collectives, replaced: bytes a peer sent are never unpickled."""

    def __init__(self, file: object) -> None:
        pass

    def load(self) -> object:
        raise RuntimeError(
            "an object collective (all_gather_object, broadcast_object_list, ...) ran in a rank of the parallel "
            "backend: they unpickle what another rank sends, which over a network could be anyone's code, so the "
            "backend refuses them; use a tensor collective"
        )


def refuse_object_collectives() -> None:
    """Make torch's object collectives in this process fail instead of unpickling what they receive (their
    ``weights_only=True`` form, which ``torch.load`` restricts to tensors and plain data, still works)."""
    distributed_c10d._unpickler = _NoUnpickling


def node_rank() -> int:
    return int(os.environ.get("COMFY_PARALLEL_NODE_RANK", "0"))


def _connection(timeout_s: float = 30.0) -> dist.TCPStore:
    """A connection of its own to the ranks' store (torchrun's agent on node 0 hosts it)."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def introduce(group: Group) -> None:
    """Say hello: sealed, so only a rank that holds the token can."""
    me = RankHello(group.rank, node_rank(), socket.gethostname(), os.getpid())
    group.put(f"hello/{group.rank}", me)


def check_in(group: Group, run_dir: RunDir) -> dict[int, RankHello]:
    """Rank 0: every rank's hello, checked; the remote ranks are written to the run directory. Raises naming the
    rank that did not prove the secret, or did not say hello in time."""
    keys = [f"hello/{r}" for r in range(group.world_size)]
    try:
        group.store.wait(keys, timedelta(seconds=HELLO_S))
    except (RuntimeError, dist.DistError):
        missing = [r for r, key in enumerate(keys) if not group.store.check([key])]
        raise RuntimeError(f"ranks {missing} did not say hello within {HELLO_S:.0f} s of joining the group") from None
    remote = {}
    for r, key in enumerate(keys):
        try:
            hello = group.get(key, RankHello)
        except Tampered as e:
            raise RuntimeError(
                f"rank {r} joined the group but did not prove the backend's secret ({e}); it was refused and the "
                "backend stopped: only machines started with the join command the ComfyUI host shows may join"
            ) from None
        if hello.rank != r:
            raise RuntimeError(f"rank {r} said hello as rank {hello.rank}")
        if hello.node != node_rank():
            remote[r] = hello
    for r, hello in remote.items():
        with open(run_dir.rank_heartbeat(r), "w"):
            pass
        with open(run_dir.rank_node(r) + ".tmp", "w") as f:
            json.dump({"node": hello.node, "host": hello.host, "pid": hello.pid}, f)
        os.rename(run_dir.rank_node(r) + ".tmp", run_dir.rank_node(r))
    if remote:
        threading.Thread(target=_relay, args=(run_dir, sorted(remote), group.sealer), name="relay", daemon=True).start()
    return remote


def beat(rank: int, sealer: Sealer) -> None:
    """A remote rank: raise its heartbeat count every second, from a thread and a connection of its own."""

    def run() -> None:
        store = _connection()
        key = _beat_key(rank, sealer)
        count = 0
        while True:
            count += 1
            try:
                store.set(key, sealer.seal(key, str(count).encode()))
            except (RuntimeError, dist.DistError):
                log.error("node 0's store is gone (the backend ended there, or the network failed): rank %d left", rank)
                os._exit(1)
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=run, name="remote-heartbeat", daemon=True).start()


def leave(rank: int, sealer: Sealer, text: str) -> None:
    """A remote rank leaving the group: tell rank 0 why (best effort: the store may be gone already)."""
    key = f"comfy-parallel/traceback/{rank}"
    try:
        _connection(timeout_s=3.0).set(key, sealer.seal(key, text.encode()))
    except (RuntimeError, dist.DistError):
        pass


def _beat_key(rank: int, sealer: Sealer) -> str:
    return f"comfy-parallel/beat/{rank}/{sealer.name(f'beat/{rank}')}"


def _beat_count(store: dist.TCPStore, key: str, sealer: Sealer) -> int:
    """The heartbeat count at ``key``; 0 when there is none yet or it is a stranger's record."""
    if not store.check([key]):
        return 0
    try:
        return int(sealer.open(key, store.get(key)))
    except (Tampered, ValueError):
        return 0


def _relay(run_dir: RunDir, ranks: list[int], sealer: Sealer) -> None:
    store = _connection()
    counts: dict[int, int] = {}
    told: set[int] = set()
    while True:
        try:
            for r in ranks:
                count = _beat_count(store, _beat_key(r, sealer), sealer)
                if count > counts.get(r, 0):
                    counts[r] = count
                    os.utime(run_dir.rank_heartbeat(r))
                key = f"comfy-parallel/traceback/{r}"
                if r not in told and store.check([key]):
                    try:
                        text = sealer.open(key, store.get(key)).decode(errors="replace")
                    except Tampered as e:  # the rank's own may still overwrite it
                        log.error("ignored a forged traceback of rank %d: %s", r, e)
                        continue
                    told.add(r)
                    with open(run_dir.rank_traceback(r), "w") as f:
                        f.write(text)
        except OSError:
            return  # the run directory is gone: the backend is being torn down
        except (RuntimeError, dist.DistError):
            return  # the store is gone
        time.sleep(HEARTBEAT_S / 4)
