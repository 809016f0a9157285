"""torchrun's agent with its TCP stores bound to one address: ``python -m parallel_runtime.worker.agent <torchrun
arguments>``.

torch's TCP store has no credentials and its server listens on every interface, whatever host it is given. The
agent hosts two of them (the rendezvous store, and the store it shares with the ranks, which carries the op protocol),
so anyone who could reach those ports could read and write the backend's keys. Here each store server listens on a
socket bound to ``COMFY_PARALLEL_BIND`` (loopback for a one-machine backend), handed to the store as its listening
socket (``master_listen_fd``). The records themselves are sealed with the backend's secret (``sealed``), so even a
local user who reaches loopback can neither read a prompt nor forge an op.

Over several machines (``COMFY_PARALLEL_NODE_RANK`` set) two more things change. Node 0's agent, which hosts the
rendezvous store, publishes the backend's sealed beacon in it (``rendezvous``; the launcher seals it into the run
directory's ``beacon`` file), so that only machines holding the cluster secret learn the rendezvous id. And the
rendezvous numbers the machines by their node rank instead of by host name and pid (torch sorts the participants'
descriptors), so rank 0 is always on node 0, the ComfyUI host that owns the shared memory: each descriptor's
process-local id carries its node rank in its high bits.

Everything else is torchrun's own ``main``. The places patched are torch's store constructors in its elastic
rendezvous (``c10d_rendezvous_backend.TCPStore`` and ``DynamicRendezvousHandler._create_tcp_store_server``) and its
participant numbering (``_NodeDescGenerator.generate``, ``_DistributedRendezvousOpExecutor._mark_rendezvous_complete``);
tests/test_faults.py and tests/test_nodes.py fail if torch renames them or the stores listen anywhere else.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any

import torch.distributed as dist
from torch.distributed import run
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

from ..processes import process_alive
from ..rendezvous import BEACON_KEY
from ..rundir import RunDir

_LISTENERS: list[socket.socket] = []  # the bound sockets live as long as the stores that listen on them
_NODE_BITS = 20  # a descriptor's local id is node_rank << _NODE_BITS | torch's own counter
# How long an agent stopped by a signal waits to see whether its client goes too.
CLIENT_GONE_S = 3.0


def _bound_store(host_name: str, port: int, *args: Any, is_master: bool = False, **kwargs: Any) -> dist.TCPStore:
    if is_master and kwargs.get("master_listen_fd") is None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((os.environ["COMFY_PARALLEL_BIND"], port))
        listener.listen(socket.SOMAXCONN)
        _LISTENERS.append(listener)
        kwargs["master_listen_fd"] = listener.fileno()
        port = listener.getsockname()[1]
    return dist.TCPStore(host_name, port, *args, is_master=is_master, **kwargs)


def _create_tcp_store_server(self: Any, master_addr: str, master_port: int) -> dist.TCPStore:
    return _bound_store(master_addr, master_port, is_master=True, multi_tenant=True)


def _rendezvous_store(host_name: str, port: int, *args: Any, is_master: bool = False, **kwargs: Any) -> dist.TCPStore:
    store = _bound_store(host_name, port, *args, is_master=is_master, **kwargs)
    beacon = os.path.join(os.environ.get("COMFY_PARALLEL_RUN_DIR", ""), "beacon")
    if is_master and os.path.isfile(beacon):
        with open(beacon, "rb") as f:
            store.set(BEACON_KEY, f.read())
    return store


_generate = dynamic_rendezvous._NodeDescGenerator.generate
_mark_complete = dynamic_rendezvous._DistributedRendezvousOpExecutor._mark_rendezvous_complete


def _generate_in_node(self: Any, local_addr: str | None = None) -> Any:
    desc = _generate(self, local_addr)
    node = int(os.environ["COMFY_PARALLEL_NODE_RANK"])
    return dataclasses.replace(desc, local_id=(node << _NODE_BITS) | desc.local_id)


def _mark_complete_in_node_order(self: Any) -> None:
    _mark_complete(self)
    participants = self._state.participants
    for rank, node in enumerate(sorted(participants, key=lambda n: (n.local_id >> _NODE_BITS, n))):
        participants[node] = rank


def _clean_up_if_the_client_went_too() -> None:
    """``systemctl stop`` signals every process of ComfyUI's service at once: the client dies without tearing its group
    down, and the ranks die before their orphan watch notices. The agent outlives its ranks (torch stops them before
    it re-raises the signal), so when the client is gone too it removes the group's segments and run directory. A
    client that stops the group itself says so first (``RunDir.stopping``) and does that itself."""
    run_dir = RunDir(os.environ["COMFY_PARALLEL_RUN_DIR"])
    client, deadline = int(os.environ["COMFY_PARALLEL_CLIENT_PID"]), time.monotonic() + CLIENT_GONE_S
    while process_alive(client):
        if os.path.exists(run_dir.stopping) or time.monotonic() > deadline:
            return
        time.sleep(0.05)
    run_dir.remove(os.environ.get("COMFY_PARALLEL_SHM_PREFIX"))


if __name__ == "__main__":
    c10d_rendezvous_backend.TCPStore = _rendezvous_store
    dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server = _create_tcp_store_server
    if "COMFY_PARALLEL_NODE_RANK" in os.environ:
        dynamic_rendezvous._NodeDescGenerator.generate = _generate_in_node
        dynamic_rendezvous._DistributedRendezvousOpExecutor._mark_rendezvous_complete = _mark_complete_in_node_order
    try:
        run.main()
    except SignalException:
        _clean_up_if_the_client_went_too()
        raise
