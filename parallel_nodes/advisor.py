from __future__ import annotations

from comfy_api.latest import io, ui

from parallel_runtime import default_spec
from parallel_runtime.advisor import GPUS_SYNTAX, advise, backend_box, parse_gpus, read_model

from . import comfy
from .types import CATEGORY, backend_input, length_input, model_input


class ParallelAdvisor(io.ComfyNode):
    """Which strategy suits the model on these GPUs (``parallel_runtime.advisor``): read-only, nothing loads."""

    LOADS_NOTHING = True  # it reads headers only, so validation runs it: bad GPUs are refused before the queue

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ParallelAdvisor",
            display_name="Parallel Advisor",
            category=CATEGORY,
            description=(
                "Which strategy suits this model on these GPUs: each one's memory per GPU, the bytes it sends per "
                "step and its expected step time against one GPU, best first, with why; and what to change when "
                "nothing fits. Reads the model's headers only: nothing loads. The same as `comfy-parallel advise`."
            ),
            inputs=[
                model_input(
                    "The diffusers model to advise on (or link ParallelModelFromComfyFiles' model here for ComfyUI's "
                    "files)."
                ),
                io.Int.Input("width", default=1024, min=256, max=8192, step=16, tooltip="The image's width."),
                io.Int.Input("height", default=1024, min=256, max=8192, step=16, tooltip="The image's height."),
                io.String.Input(
                    "gpus",
                    default="",
                    optional=True,
                    tooltip=(
                        f"Declare the GPUs to advise for: {GPUS_SYNTAX}. Empty: the backend's GPUs as ComfyUI sees "
                        "them (memory, peer access; the link assumed PCIe: `comfy-parallel advise` measures it)."
                    ),
                ),
                backend_input(),
                # Last: UI-format workflows store widget values by position, so saved graphs keep loading.
                length_input(
                    "For a video model: the clip's frames, as ParallelSampler's length (4k + 1; 81 is Wan's 5 "
                    "seconds), whose tokens every step holds. 1 for the image families."
                ),
            ],
            outputs=[io.String.Output(display_name="advice", tooltip="The advice's text, also shown on the node.")],
            is_output_node=True,
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, input_types: dict) -> bool | str:
        """The model, the declared GPUs (or the backend's) and the size, before the prompt queues."""
        return comfy.validate(cls, input_types, comfy.QueuedNode.run)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        w = comfy.execution_inputs(cls, inputs)
        declared = w["gpus"].strip()
        box = parse_gpus(declared, "gpus") if declared else backend_box(w["backend"] or default_spec())
        text = advise(read_model(w["model"], "model"), box, w["width"], w["height"], w["length"]).text()
        return io.NodeOutput(text, ui=ui.PreviewText(text))
