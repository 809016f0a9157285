"""torchrun's agent with its TCP stores bound to one address: ``python -m parallel_runtime.worker.agent <torchrun
arguments>``.

torch's TCP store has no credentials and its server listens on every interface, whatever host it is given. The
agent hosts two of them (the rendezvous store, and the store it shares with the ranks, which carries the op protocol),
so anyone who could reach those ports could read and write the backend's keys. Here each store server listens on a
socket bound to ``COMFY_PARALLEL_BIND`` (loopback for a one-machine backend), handed to the store as its listening
socket (``master_listen_fd``). The records themselves are sealed with the backend's secret (``sealed``), so even a
local user who reaches loopback can neither read a prompt nor forge an op.

Everything else is torchrun's own ``main``. The two places patched are torch's store constructors in its elastic
rendezvous (``c10d_rendezvous_backend.TCPStore`` and ``DynamicRendezvousHandler._create_tcp_store_server``);
tests/test_faults.py fails if torch renames them or the stores listen anywhere else.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch.distributed as dist
from torch.distributed import run
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

_LISTENERS: list[socket.socket] = []  # the bound sockets live as long as the stores that listen on them


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


if __name__ == "__main__":
    c10d_rendezvous_backend.TCPStore = _bound_store
    dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server = _create_tcp_store_server
    run.main()
