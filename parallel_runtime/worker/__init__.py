"""The backend: one process per rank, started by torchrun (``python -m parallel_runtime.worker``)."""
