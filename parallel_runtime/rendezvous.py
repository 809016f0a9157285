"""What the machines of a backend over several tell each other in node 0's store, before any rank starts, and how
torchrun's rendezvous is run so that nothing a stranger can write into that store is ever unpickled (on one machine
too: its agent's store is on loopback, but every local user can reach it and list its keys).

The store (a TCP store hosted by node 0's torchrun agent, on the ``rdzv_endpoint`` the user chose) has no
credentials: anyone who reaches its port can read, write and delete keys, and key names travel in clear. So:

- **torchrun's rendezvous is the static one** (``--rdzv-backend static``, each machine's ``--node-rank``). torch's
  default c10d rendezvous keeps its state in the store as a pickle and unpickles whatever it finds there
  (``dynamic_rendezvous``): a stranger who knew the key ran code in every machine's agent (issue 21). The static
  rendezvous pickles nothing, and torchrun's agent then reads only JSON (``_assign_worker_ranks``) and counters
  (``store_util.barrier``) from the store. The cost is that it cannot number the machines itself; the pack's own
  sealed exchange below does, and it also tells each machine where node 0 is and when a backend starts.
- **everything of the pack's in the store that matters is sealed** (``sealed``) with the cluster secret, which only
  the ComfyUI host and the machines given the secret hold:

    comfy-parallel/beacon                    Beacon  node 0 publishes the backend it is starting
    comfy-parallel/claim/<rdzv id>/<node>    Claim   a joining machine takes its node rank (one compare-and-set)

  A machine without the secret cannot open the beacon, so it never learns the backend's token, the node ranks taken
  or the rendezvous id; a forged beacon or claim does not open and is ignored (``machines``). The backend's token
  (which seals the ranks' op protocol and their hellos, ``worker/remote.py``) travels only inside the beacon.
- **nothing that enables is on a command line** (``/proc/<pid>/cmdline`` is readable by every local user): torchrun
  gets the rendezvous id in its environment (``PET_RDZV_ID``, which only the owner can read), the ranks read the
  token from the 0700 run directory, and ``comfy-parallel join`` reads the secret from its environment, a file or a
  prompt. The rendezvous id is no longer a key to anything (nothing unpickles): it only keeps one backend's
  torchrun keys apart from the next one's.

What is not protected here: availability (anyone who reaches the port can delete or overwrite keys and so make a
start-up fail or a run end, with an error naming what failed), and the collectives' traffic between the machines
(gloo and NCCL have no authentication and no encryption: the README's threat model says what that allows).

Also here, because node 0's launcher and a joining machine (``machines``) both need them: the cluster secret
(``cluster_secret``), torchrun's rendezvous arguments for one machine, and the environment that keeps its sockets on
the chosen interface.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import secrets
import socket
import struct
from typing import Any, TypeVar

from .sealed import Sealer, Tampered
from .serial import WireError, from_json, to_json

BEACON_KEY = "comfy-parallel/beacon"
SECRET_ENV = "COMFY_PARALLEL_SECRET"
IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# How long the ComfyUI host waits for every machine to join a backend it starts (COMFY_PARALLEL_JOIN_S).
JOIN_S = 120.0
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Beacon:
    """The backend node 0 is starting, as the joining machines need it.

    Args:
        rdzv_id: torchrun's rendezvous id for this backend (fresh for each): it keeps one backend's keys in the store
            apart from the next one's, and names the joining machines' claims.
        token: the backend's token, which seals the ranks' op headers and outcomes.
        nnodes: machines in the backend.
        ranks: ranks on each machine.
        device: cpu or cuda.
        memory_policy: staged, resident or auto.
    """

    rdzv_id: str
    token: str
    nnodes: int
    ranks: int
    device: str
    memory_policy: str


@dataclasses.dataclass(frozen=True)
class Claim:
    """A joining machine's hold on its node rank in one backend.

    Args:
        node_rank: the node rank it takes (1..nnodes-1).
        host: its host name, to name it in errors.
        pid: its ``comfy-parallel join`` process.
    """

    node_rank: int
    host: str
    pid: int


def claim_key(rdzv_id: str, node_rank: int) -> str:
    return f"comfy-parallel/claim/{rdzv_id}/{node_rank}"


def seal(secret: str, key: str, value: Any) -> bytes:
    """``value`` (a dataclass) sealed with ``secret`` for the store key ``key``."""
    return Sealer(secret).seal(key, json.dumps(to_json(value)).encode())


def unseal(secret: str, key: str, record: bytes, kind: type[T]) -> T:
    """The ``kind`` sealed at ``key``; Tampered when it was sealed with another secret, or is not a ``kind``."""
    plain = Sealer(secret).open(key, record)
    try:
        return from_json(kind, json.loads(plain))
    except (ValueError, WireError) as e:
        raise Tampered(f"{key}: {e}") from None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` → (host, port); ValueError naming what is wrong."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{endpoint!r} is not host:port (for example 192.168.1.10:29400)")
    return host.strip("[]"), int(port)


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds the IPv4 ``address`` (``lo`` for 127.0.0.1), or None.

    gloo and NCCL pick an interface of their own unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name one; the
    backend names the one its store listens on, so the collectives travel on the network the user chose.
    """
    try:
        wanted = socket.inet_aton(socket.gethostbyname(address))
    except OSError:
        return None
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                # SIOCGIFADDR: the interface's IPv4 address, at bytes 20..24 of the returned ifreq.
                ifreq = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if ifreq[20:24] == wanted:
                return name
    finally:
        probe.close()
    return None


def route_to(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what the other machines reach it at)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((socket.gethostbyname(host), port))  # UDP: sends nothing, only picks the route
        return probe.getsockname()[0]
    finally:
        probe.close()


def join_deadline() -> float:
    return float(os.environ.get("COMFY_PARALLEL_JOIN_S") or JOIN_S)


def secret_file() -> str:
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(config, "comfyui-parallel-diffusers", "secret")


def cluster_secret() -> str:
    """The secret a machine proves to join this host's backends: ``COMFY_PARALLEL_SECRET``, else the host's own,
    made once and kept (0600) in ``secret_file()`` so that joined machines stay valid across ComfyUI restarts."""
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    path = secret_file()
    try:
        with open(path) as f:
            if secret := f.read().strip():
                return secret
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    secret = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return secret


def rendezvous_arguments(rdzv_endpoint: str, nnodes: int, node_rank: int) -> list[str]:
    """torchrun's arguments for machine ``node_rank`` of a backend (node 0 hosts the store; port 0 in
    ``rdzv_endpoint``: any free one, ``worker/agent.py``): the static rendezvous, which pickles nothing (module
    docstring). Nothing secret: the rendezvous id goes in ``rendezvous_environment``."""
    # The store waits for the other machines a little past the host's own deadline, so no agent outlives it for long.
    timeout = int(join_deadline() + 30)
    return [
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--rdzv-backend",
        "static",
        "--rdzv-endpoint",
        rdzv_endpoint,
        "--rdzv-conf",
        f"timeout={timeout}",
    ]


def rendezvous_environment(rdzv_id: str) -> dict[str, str]:
    """The rendezvous id for torchrun through its environment (``PET_RDZV_ID`` is ``--rdzv-id``), which only this
    user can read, not its command line."""
    return {"PET_RDZV_ID": rdzv_id}


def node_environment(address: str, node_rank: int) -> dict[str, str]:
    """The environment of one machine's agent and ranks: bind to ``address`` and run the collectives on the
    interface that holds it (unless the user named one in ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``)."""
    env = {"COMFY_PARALLEL_BIND": address, "COMFY_PARALLEL_NODE_RANK": str(node_rank)}
    interface = interface_of(address)
    for name in IFNAMES:
        if os.environ.get(name):
            env[name] = os.environ[name]
        elif interface is not None:
            env[name] = interface
    return env
