"""parallel_runtime: a persistent multi-rank diffusers backend and the client that drives it.

The nodes call ``jobs`` (the generation steps), which call ``get_backend(spec).call(args, tensors)`` with an op's
typed arguments (``wire``); everything about processes, shared memory and collectives stays inside this package.
docs/ARCHITECTURE.md says which module may import which.
"""

from .client import Backend, BackendStatus, CallResult, current_backend, get_backend, shutdown_backend
from .errors import (
    BackendDied,
    BackendStartError,
    Cancelled,
    DeadlineExceeded,
    InvalidInput,
    OpFailed,
    ParallelRuntimeError,
    Refused,
)
from .spec import BackendSpec, default_spec

__all__ = [
    "Backend",
    "BackendDied",
    "BackendSpec",
    "BackendStartError",
    "BackendStatus",
    "CallResult",
    "Cancelled",
    "DeadlineExceeded",
    "InvalidInput",
    "OpFailed",
    "ParallelRuntimeError",
    "Refused",
    "current_backend",
    "default_spec",
    "get_backend",
    "shutdown_backend",
]
