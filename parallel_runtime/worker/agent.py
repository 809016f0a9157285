"""torchrun's agent with its TCP stores bound to one address: ``python -m parallel_runtime.worker.agent <torchrun
arguments>``.

torch's TCP store has no credentials and its server listens on every interface, whatever host it is given. The
agent hosts the store the ranks share (it carries the op protocol), so anyone who could reach its port could read and
write the backend's keys. Here each store server listens on a socket bound to ``COMFY_PARALLEL_BIND`` (loopback for a
one-machine backend), handed to the store as its listening socket (``master_listen_fd``). The records themselves are
sealed with the backend's secret (``sealed``), so even a local user who reaches loopback can neither read a prompt nor
forge an op.

What the agent unpickles: nothing, on one machine or several. Every agent runs torchrun's static rendezvous
(``rendezvous.rendezvous_arguments``), with which torchrun reads only JSON and counters from the store
(``rendezvous``'s docstring). torch's c10d rendezvous (``--standalone``) keeps its state in the store as a pickle
and unpickles what it finds there; its key is no secret from a local user (``TCPStore.list_keys`` lists every key, and
the store's port is in ``ss -ltn``), so on a one-machine backend any user of the machine could have run code as
ComfyUI's user.

A one-machine backend's agent asks for port 0: ``_bound_store`` binds a free port itself and hands the listening
socket to the store, and ``_next_rendezvous`` tells the ranks the port the store really listens on (torch's static
rendezvous would tell them the port it was given). The launcher picking a free port instead would leave a window in
which another process can take it, and a start-up to retry. Over several machines node 0's agent hosts its store on
``rdzv_endpoint`` and publishes the backend's sealed beacon there, which the launcher sealed into the run directory's
``beacon`` file.

The places patched are torch's static rendezvous's store constructor (``static_tcp_rendezvous.TCPStore``) and
``StaticTCPRendezvous.next_rendezvous``; ``internals`` checks them before they are patched, and tests/test_faults.py
and tests/test_nodes.py fail if the stores listen anywhere else.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import run
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous import RendezvousInfo, static_tcp_rendezvous

from ..internals import check
from ..processes import process_alive
from ..rendezvous import BEACON_KEY
from ..rundir import RunDir

check("worker/agent.py")  # before torch is patched: one error naming what torch renamed

_LISTENERS: list[socket.socket] = []  # the bound sockets live as long as the stores that listen on them
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


def _static_store(
    host_name: str, port: int, world_size: int, is_master: bool, timeout: timedelta, **kwargs: Any
) -> dist.TCPStore:
    """The static rendezvous's store. Node 0's does not wait for the other machines' agents to connect (torch's
    default): they learn that a backend is starting only from the beacon, published here as soon as the store
    listens (one machine alone has nobody to tell)."""
    if not is_master:
        return dist.TCPStore(host_name, port, world_size, is_master=False, timeout=timeout, **kwargs)
    store = _bound_store(host_name, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False, **kwargs)
    if world_size > 1:
        with open(RunDir(os.environ["COMFY_PARALLEL_RUN_DIR"]).beacon, "rb") as f:
            store.set(BEACON_KEY, f.read())
    return store


_static_next_rendezvous = static_tcp_rendezvous.StaticTCPRendezvous.next_rendezvous


def _next_rendezvous(self: static_tcp_rendezvous.StaticTCPRendezvous) -> RendezvousInfo:
    """torch's, telling the ranks (``MASTER_PORT``) the port the store listens on: a one-machine backend asks for
    port 0, a free one that ``_bound_store`` binds, and torch would pass the 0 on."""
    info = _static_next_rendezvous(self)
    info.bootstrap_store_info.master_port = info.store.underlying_store.port
    return info


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
    static_tcp_rendezvous.TCPStore = _static_store
    static_tcp_rendezvous.StaticTCPRendezvous.next_rendezvous = _next_rendezvous
    try:
        run.main()
    except SignalException:
        _clean_up_if_the_client_went_too()
        raise
