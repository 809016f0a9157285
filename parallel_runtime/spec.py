"""What a backend is: the frozen description that keys a running backend."""

from __future__ import annotations

import dataclasses
import os
import socket

from .errors import InvalidInput
from .rendezvous import split_endpoint

DEVICES = ("cpu", "cuda")
MEMORY_POLICIES = ("staged", "resident", "auto")


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """A backend's launch configuration. Two equal specs share one running backend.

    ``ranks`` is the number of ranks on each machine (torchrun's ``--nproc-per-node``); with ``nnodes`` > 1 this
    machine is node 0 and listens on ``rdzv_endpoint``, the other machines run ``comfy-parallel join`` with their own
    node rank (``machines``), and rank 0 (which owns the shared memory) stays on this machine.

    ``gpus`` are the GPUs the ranks use, as nvidia-smi numbers them (PCI bus order), whatever this process sees:
    ComfyUI's ``--cuda-device`` narrows its own ``CUDA_VISIBLE_DEVICES`` to one GPU, which must not narrow the
    backend. None: the GPUs this process sees. ``free_comfyui_vram`` says whether the nodes free ComfyUI's own
    models before an op on a device ComfyUI computes on; it changes nothing on the ranks, so it does not key the
    backend (``compare=False``).
    """

    ranks: int = 2
    device: str = "cpu"
    memory_policy: str = "staged"
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    gpus: tuple[int, ...] | None = None
    free_comfyui_vram: bool = dataclasses.field(default=True, compare=False)

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
        if self.gpus is not None:
            if self.device != "cuda" or not self.gpus or len(set(self.gpus)) != len(self.gpus):
                raise ValueError(f"gpus must list distinct GPUs of a cuda backend, got {self.gpus!r} on {self.device}")
            if self.ranks > len(self.gpus):
                raise ValueError(f"{self.ranks} ranks need one GPU each, but gpus lists {len(self.gpus)}")

    @property
    def world_size(self) -> int:
        return self.ranks * self.nnodes


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def machine_gpu_count() -> int | None:
    """Every GPU of the machine, whatever ``CUDA_VISIBLE_DEVICES`` this process has (NVML, as nvidia-smi counts
    them); None when NVML cannot say (no driver, or a torch without the reader)."""
    import torch

    count = getattr(torch.cuda, "_raw_device_count_nvml", None)
    try:
        found = count() if count is not None else -1
    except OSError:  # no libnvidia-ml: no NVIDIA driver on this machine
        return None
    return found if found >= 0 else None


def visible_gpu_uuids() -> list[str] | None:
    """The GPUs this process sees, in its own order, by UUID (what ``CUDA_VISIBLE_DEVICES`` accepts); None without
    CUDA. By UUID, the ranks get exactly these GPUs in this order whatever ``CUDA_DEVICE_ORDER`` they use."""
    import torch

    if not torch.cuda.is_available():
        return None
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    return [u if u.startswith(("GPU-", "MIG-")) else f"GPU-{u}" for u in uuids]


def parse_gpus(text: str, widget: str = "gpus") -> tuple[int, ...] | None:
    """``"0,1, 3"`` -> ``(0, 1, 3)``; empty -> None (the GPUs this process sees)."""
    if not text or not text.strip():
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise InvalidInput(
            widget, f"could not read {text.strip()!r}; list GPU numbers as nvidia-smi shows them, e.g. 0,1,2,3"
        )
    gpus = tuple(int(p) for p in parts)
    if len(set(gpus)) != len(gpus):
        raise InvalidInput(widget, f"{text.strip()!r} lists a GPU twice; give each GPU once")
    machine = machine_gpu_count()
    if machine is not None and max(gpus) >= machine:
        raise InvalidInput(
            widget, f"GPU {max(gpus)} does not exist; this machine has {machine} GPUs (0..{machine - 1} in nvidia-smi)"
        )
    return gpus


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
    device: str = "auto",
    ranks: int = 0,
    memory_policy: str = "staged",
    gpus: str = "",
    free_comfyui_vram: bool = True,
    nnodes: int = 1,
    rdzv_endpoint: str = "",
) -> BackendSpec:
    """The backend nodes use when no ParallelBackend node is wired in.

    ``auto`` means CUDA when a GPU is visible (or ``gpus`` lists some), else CPU; ``ranks`` 0 means one rank per GPU,
    or 2 CPU ranks. ``gpus`` (nvidia-smi's numbers, e.g. ``"0,1"``) gives the backend its own GPUs; empty: the GPUs
    this process sees. ``COMFY_PARALLEL_DEVICE``, ``COMFY_PARALLEL_RANKS`` and ``COMFY_PARALLEL_VISIBLE_DEVICES``
    override the defaults, not explicit values (the last only for a cuda backend). With ``nnodes`` > 1 every machine
    runs ``ranks`` ranks and this one, node 0, listens on ``rdzv_endpoint``.
    """
    if not isinstance(nnodes, int) or nnodes < 1:
        raise InvalidInput("nnodes", f"nnodes is the number of machines, 1 or more; got {nnodes!r}")
    if nnodes > 1:
        _check_endpoint(nnodes, rdzv_endpoint.strip())
    if device == "auto":
        device = os.environ.get("COMFY_PARALLEL_DEVICE", "auto")
    if not ranks:
        ranks = int(os.environ.get("COMFY_PARALLEL_RANKS", "0") or 0)
    if device not in (*DEVICES, "auto"):
        raise InvalidInput("device", f"unknown device {device!r}; choose auto, cuda or cpu")
    chosen = parse_gpus(gpus)
    if chosen is not None and device == "cpu":
        raise InvalidInput("gpus", "lists GPUs for a cpu backend; clear gpus, or choose device cuda or auto")
    if chosen is None and device != "cpu":
        chosen = parse_gpus(os.environ.get("COMFY_PARALLEL_VISIBLE_DEVICES", ""), "COMFY_PARALLEL_VISIBLE_DEVICES")
    if device == "auto":
        device = "cuda" if chosen or cuda_device_count() > 0 else "cpu"
    if memory_policy not in MEMORY_POLICIES:
        raise InvalidInput(
            "memory_policy",
            f"unknown memory policy {memory_policy!r}; choose auto (keep models while memory allows, "
            "free the least recently used first), staged (free the text encoders before the transformer "
            "loads) or resident (keep everything)",
        )
    gpu_count = (len(chosen) if chosen else cuda_device_count()) if device == "cuda" else 0
    if device == "cuda" and not gpu_count:
        raise InvalidInput(
            "device",
            "cuda was chosen but this process sees no GPU (check CUDA_VISIBLE_DEVICES and "
            "the driver); list the backend's GPUs in gpus, or choose auto or cpu",
        )
    if device == "cuda" and ranks > gpu_count:
        listed = "gpus lists" if chosen else "this process sees"
        raise InvalidInput(
            "ranks",
            f"{ranks} ranks need one GPU each, but {listed} {gpu_count}; use 0 (one per GPU) or at most {gpu_count}",
        )
    if not ranks:
        ranks = gpu_count or 2
    return BackendSpec(
        ranks=ranks,
        device=device,
        memory_policy=memory_policy,
        gpus=chosen,
        free_comfyui_vram=free_comfyui_vram,
        nnodes=nnodes,
        rdzv_endpoint=rdzv_endpoint.strip() if nnodes > 1 else None,
    )
