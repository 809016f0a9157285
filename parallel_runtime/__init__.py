"""parallel_runtime: a persistent multi-rank diffusers backend and the client that drives it.

The nodes call ``jobs`` (the generation steps), which call ``get_backend(spec).call(args, tensors)`` with an op's
typed arguments (``wire``); everything about processes, shared memory and collectives stays inside this package.
docs/ARCHITECTURE.md says which module may import which.

Every rank runs this file too (``python -m parallel_runtime.worker`` imports its package first), so it imports only
shared modules; the client's names (``get_backend`` and the rest of ``client``) are imported when first asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from .client import Backend, BackendStatus, CallResult, current_backend, get_backend, shutdown_backend

_CLIENT = frozenset({"Backend", "BackendStatus", "CallResult", "current_backend", "get_backend", "shutdown_backend"})


def __getattr__(name: str) -> Any:
    """The client's names, imported on first use (PEP 562), so that a rank never loads the client side."""
    if name in _CLIENT:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
