"""The pack's socket types, its category, and the inputs several nodes share (declared once, here)."""

from __future__ import annotations

from comfy_api.latest import io

from parallel_runtime import jobs

CATEGORY = "parallel_diffusers"
# The io_type strings are what saved workflows hold: they never change.
Backend = io.Custom("PD_BACKEND")  # a parallel_runtime.BackendSpec
Conditioning = io.Custom("PD_CONDITIONING")  # a parallel_runtime.jobs.Conditioning
Transformer = io.Custom("PD_TRANSFORMER")  # a parallel_runtime.jobs.TransformerHandle


def backend_input() -> io.Input:
    return Backend.Input(
        "backend",
        optional=True,
        tooltip=(
            "Which backend runs this (a ParallelBackend node). Without it: every visible GPU, or 2 CPU ranks when "
            "there is none (COMFY_PARALLEL_RANKS / COMFY_PARALLEL_DEVICE override)."
        ),
    )


def dtype_input() -> io.Input:
    return io.Combo.Input(
        "dtype",
        options=list(jobs.DTYPE_OPTIONS),
        default="auto",
        optional=True,
        tooltip="Weights' dtype. auto: bfloat16 on GPUs, float32 on CPU.",
    )


def max_memory_input() -> io.Input:
    return io.String.Input(
        "max_memory",
        default="",
        optional=True,
        tooltip=("Per-device budget for device_map placement, e.g. 0:16GB,1:16GB (GPU index or cpu). Empty: no limit."),
    )


def model_input(tooltip: str) -> io.Input:
    """The model combo; its tooltip also names the folders under the model folders that are not listed, and why
    (ComfyUI itself says only "Value not in list" of a model missing from it)."""
    from parallel_runtime import model_folders

    skipped = model_folders.skipped_models()
    if skipped:
        shown = "; ".join(f"{name} ({why})" for name, why in skipped[:5])
        tooltip += f" Not listed: {shown}" + (f"; and {len(skipped) - 5} more" if len(skipped) > 5 else "")
    return io.Combo.Input("model", options=model_folders.list_models(), tooltip=tooltip)


def length_input(tooltip: str) -> io.Input:
    """A clip's length in frames, 4k + 1 as Wan's VAE makes them (ComfyUI's own Wan nodes step by 4 the same way)."""
    return io.Int.Input("length", default=1, min=1, max=4097, step=4, optional=True, tooltip=tooltip)
