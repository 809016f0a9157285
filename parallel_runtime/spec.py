"""What a backend is: the frozen description that keys a running backend."""

from __future__ import annotations

import dataclasses
import os
import socket

from .errors import InvalidInput
from .rendezvous import split_endpoint

DEVICES = ("cpu", "cuda")
MEMORY_POLICIES = ("staged", "resident")


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """A backend's launch configuration. Two equal specs share one running backend.

    ``ranks`` is the number of ranks on each machine (torchrun's ``--nproc-per-node``); with ``nnodes`` > 1 this
    machine is node 0 and listens on ``rdzv_endpoint``, the other machines run ``comfy-parallel join`` with their own
    node rank (``machines``), and rank 0 (which owns the shared memory) stays on this machine.
    """

    ranks: int = 2
    device: str = "cpu"
    memory_policy: str = "staged"
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"ranks must be a whole number ≥ 1, got {self.ranks!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES} (resolve 'auto' first), got {self.device!r}")
        if self.memory_policy not in MEMORY_POLICIES:
            raise ValueError(f"memory_policy must be one of {MEMORY_POLICIES}, got {self.memory_policy!r}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..nnodes-1, got node_rank={self.node_rank} nnodes={self.nnodes}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("a backend over several machines needs rdzv_endpoint (host:port of machine 0)")
        if self.nnodes > 1 and self.node_rank != 0:
            raise ValueError("this machine runs rank 0 (it owns the shared memory), so its node_rank must be 0")

    @property
    def world_size(self) -> int:
        return self.ranks * self.nnodes


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_endpoint(nnodes: int, rdzv_endpoint: str) -> None:
    """``rdzv_endpoint`` of a backend over ``nnodes`` machines: host:port, the host an address of this machine."""
    if not rdzv_endpoint:
        raise InvalidInput(
            "rdzv_endpoint",
            f"a backend over {nnodes} machines needs host:port: this machine's address that the other machines reach "
            "and a free port (for example 192.168.1.10:29400; 127.0.0.1:29400 over an SSH tunnel)",
        )
    try:
        host, _ = split_endpoint(rdzv_endpoint)
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.bind((host, 0))  # only an address of this machine binds
        finally:
            probe.close()
    except ValueError as e:
        raise InvalidInput("rdzv_endpoint", str(e)) from None
    except OSError as e:
        raise InvalidInput(
            "rdzv_endpoint",
            f"{rdzv_endpoint}: {host} is not an IPv4 address of this machine ({e}); use the address the other machines "
            "reach it at (see `ip addr`), or 127.0.0.1 with an SSH tunnel (README: Several machines)",
        ) from None


def default_spec(
    device: str = "auto", ranks: int = 0, memory_policy: str = "staged", nnodes: int = 1, rdzv_endpoint: str = ""
) -> BackendSpec:
    """The backend nodes use when no ParallelBackend node is wired in.

    ``auto`` means CUDA when a GPU is visible, else CPU; ``ranks`` 0 means one rank per visible GPU, or 2 CPU
    ranks. ``COMFY_PARALLEL_DEVICE`` and ``COMFY_PARALLEL_RANKS`` override the defaults, not explicit values. With
    ``nnodes`` > 1 every machine runs ``ranks`` ranks and this one, node 0, listens on ``rdzv_endpoint``.
    """
    if not isinstance(nnodes, int) or nnodes < 1:
        raise InvalidInput("nnodes", f"nnodes is the number of machines, 1 or more; got {nnodes!r}")
    if nnodes > 1:
        _check_endpoint(nnodes, rdzv_endpoint.strip())
    if device == "auto":
        device = os.environ.get("COMFY_PARALLEL_DEVICE", "auto")
    if not ranks:
        ranks = int(os.environ.get("COMFY_PARALLEL_RANKS", "0") or 0)
    if device == "auto":
        device = "cuda" if cuda_device_count() > 0 else "cpu"
    if device not in DEVICES:
        raise InvalidInput("device", f"unknown device {device!r}; choose auto, cuda or cpu")
    if memory_policy not in MEMORY_POLICIES:
        raise InvalidInput(
            "memory_policy",
            f"unknown memory policy {memory_policy!r}; choose staged (free the text "
            "encoders before the transformer loads) or resident (keep everything)",
        )
    gpus = cuda_device_count() if device == "cuda" else 0
    if device == "cuda" and not gpus:
        raise InvalidInput(
            "device",
            "cuda was chosen but this process sees no GPU (check CUDA_VISIBLE_DEVICES and "
            "the driver); choose auto or cpu",
        )
    if device == "cuda" and ranks > gpus:
        raise InvalidInput(
            "ranks",
            f"{ranks} ranks need one GPU each, but this process sees {gpus}; use 0 (one per GPU) or at most {gpus}",
        )
    if not ranks:
        ranks = gpus or 2
    return BackendSpec(
        ranks=ranks,
        device=device,
        memory_policy=memory_policy,
        nnodes=nnodes,
        rdzv_endpoint=rdzv_endpoint.strip() if nnodes > 1 else None,
    )
