"""parallel_runtime: a persistent multi-rank diffusers backend and the client that drives it.

The ComfyUI nodes use ``get_backend(spec).call(op, args, tensors)``; everything about processes, shared
memory and collectives stays inside this package.
"""
from .client import Backend, CallResult, current_backend, get_backend, shutdown_backend
from .errors import (BackendDied, BackendStartError, Cancelled, DeadlineExceeded, InvalidInput, OpFailed,
                     ParallelRuntimeError,
                     Refused)
from .spec import BackendSpec, default_spec

__all__ = [
    "Backend", "BackendDied", "BackendSpec", "BackendStartError", "CallResult", "Cancelled", "DeadlineExceeded", "InvalidInput",
    "OpFailed", "ParallelRuntimeError", "Refused", "current_backend", "default_spec", "get_backend",
    "shutdown_backend",
]
