from __future__ import annotations

import asyncio
import os

from comfy_api.latest import io

from parallel_runtime import InvalidInput, jobs, model_folders
from parallel_runtime.wire import Expert

from . import comfy
from .types import CATEGORY, Transformer


def _check(node: comfy.QueuedNode) -> None:
    """The LoRA against the transformer it is chained to when validation can compute that one (a chain of
    LoadShardedTransformer and loaders: they load nothing), else the file alone."""
    try:
        handle = node.input("transformer")
    except comfy.Unknown:
        handle = None
    jobs.validate_lora(handle, **node.widgets("lora_name", "strength", "expert"))


class ParallelLoraLoader(io.ComfyNode):
    """Add a LoRA to the transformer: chained loaders stack, each with its own strength. Lazy, as the transformer."""

    LOADS_NOTHING = True  # it only checks and adds to the handle: validate_inputs (its own, the sampler's) may run it

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ParallelLoraLoader",
            display_name="LoRA Loader (parallel)",
            category=CATEGORY,
            description=(
                "Adds a LoRA to the transformer on every strategy, tensor parallel included (merged into each "
                "rank's own slice of the weights). The transformer stays loaded: adding, removing or re-weighting a "
                "LoRA never reloads it, and a strength set back gives the same image back. Chain several loaders "
                "to stack LoRAs. Changes the transformer only, like ComfyUI's LoraLoaderModelOnly: a LoRA's "
                "text-encoder weights (kohya lora_te…) are not applied, and the node's text says so. Reads "
                ".safetensors files in the diffusers / PEFT, kohya, ComfyUI (diffusion_model.) and xlabs layouts "
                "diffusers reads for the model's family. On Wan 2.2 A14B, expert picks which of its two experts the "
                "LoRA changes."
            ),
            inputs=[
                Transformer.Input(
                    "transformer",
                    tooltip="From LoadShardedTransformer or another LoRA Loader (parallel); the LoRA is added to it.",
                ),
                io.Combo.Input(
                    "lora_name",
                    options=model_folders.list_loras(),
                    tooltip=(
                        "A LoRA for the transformer's model from models/loras (or COMFY_PARALLEL_LORAS); .safetensors "
                        "only."
                    ),
                ),
                io.Float.Input(
                    "strength",
                    default=1.0,
                    min=-jobs.MAX_STRENGTH,
                    max=jobs.MAX_STRENGTH,
                    step=0.01,
                    tooltip="How strongly the LoRA changes the transformer; 0: not at all, negative: the other way.",
                ),
                io.Combo.Input(
                    "expert",
                    options=[e.value for e in Expert],
                    default=Expert.BOTH.value,
                    optional=True,
                    tooltip=(
                        "Wan 2.2 A14B's two experts: both, or only high_noise (the early steps) or low_noise (the "
                        "late ones), as LoRAs released per expert are loaded. Any other model takes both."
                    ),
                ),
            ],
            outputs=[
                Transformer.Output(
                    display_name="transformer",
                    tooltip=(
                        "The transformer with this LoRA after those it already had (nothing loaded yet): feed "
                        "ParallelSampler or another LoRA Loader (parallel)."
                    ),
                )
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    async def validate_inputs(cls, input_types: dict) -> bool | str:
        """The file, and its content against the chained transformer, before anything runs; in a thread, so that
        ComfyUI's event loop answers other requests while a large LoRA is read (the reading has a deadline,
        ``jobs.lora.CHECK_SECONDS``)."""
        return await asyncio.to_thread(comfy.validate, cls, input_types, _check)

    @classmethod
    def fingerprint_inputs(cls, **inputs) -> object:
        """What a file replaced under the same name changes (size, modification and change times, inode): it is a new
        input, so ComfyUI runs the node (and the sampler after it) again instead of reusing the handle of the file that
        was. (Its content is what the ranks check; this only tells ComfyUI to look again.)"""
        try:
            stat = os.stat(model_folders.resolve_lora(inputs.get("lora_name") or ""))
        except (InvalidInput, OSError):
            return None
        return (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        w = comfy.execution_inputs(cls, inputs)
        handle, found = jobs.add_lora(
            w["transformer"], lora_name=w["lora_name"], strength=w["strength"], expert=w["expert"]
        )
        text = found.describe(w["lora_name"], w["strength"])
        comfy.show_text(cls, text if w["expert"] == Expert.BOTH.value else f"{text}; on the {w['expert']} expert only")
        return io.NodeOutput(handle)
