from __future__ import annotations

import os

from comfy_api.latest import io

from parallel_runtime import InvalidInput, comfy_files, jobs
from parallel_runtime.comfy_files import WIDGETS
from parallel_runtime.families import FILES_LAYOUTS, join_words

from . import comfy
from .types import CATEGORY

# A model name for a combo input: a plain "COMBO" output type (io.Combo.Output's type is its list of options, which
# ComfyUI's link check compares with the input's "COMBO" and refuses).
ModelName = io.Custom("COMBO")


def _picked(widget: str, whose: bool = False) -> list[str]:
    """What the families whose ComfyUI files convert take in ``widget`` (``whose``: each with its family's name)."""
    return [
        f"{layout.name}'s {layout.widget_files[widget]}" if whose else layout.widget_files[widget]
        for layout in FILES_LAYOUTS
        if widget in layout.widget_files
    ]


class ParallelModelFromComfyFiles(io.ComfyNode):
    """A model from ComfyUI's own files (diffusion_models, text_encoders, vae) for the other nodes' ``model`` input."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ParallelModelFromComfyFiles",
            display_name="Model from ComfyUI Files (parallel)",
            category=CATEGORY,
            description=(
                "Assembles a model from the files ComfyUI already has (the transformer in models/diffusion_models, "
                "the text encoders in models/text_encoders, the VAE in models/vae, Wan 2.1 I2V's image encoder in "
                "models/clip_vision) for the model input of Encode on "
                "Balanced GPUs, Load Sharded Transformer and VAE Decode (single GPU): link its output into each. "
                f"{join_words([layout.variants for layout in FILES_LAYOUTS])}; bf16 / fp16, fp8 and ComfyUI's scaled "
                "fp8 files, and ComfyUI-GGUF's .gguf transformers (held packed on every rank; under tensor parallel "
                "each rank's slices, packed where they are whole blocks). "
                "The first run converts them once into a cached diffusers folder (what is already in the right layout "
                "is linked, not copied); later runs reuse it. Every strategy then loads it as any diffusers folder."
            ),
            inputs=[
                io.Combo.Input(
                    "diffusion_model",
                    options=comfy_files.widget_options("diffusion_model"),
                    tooltip=(
                        "The transformer from models/diffusion_models (or unet): "
                        f"{', '.join(_picked('diffusion_model'))}, or their fp8 or GGUF (.gguf) versions. The family "
                        "(and its variant, such as dev or schnell) is told from its weights; FLUX.1 Kontext's and "
                        "Qwen-Image-Edit-2509's, whose weights are FLUX.1-dev's and Qwen-Image's, only by their names: "
                        "keep kontext or 2509 in them (2511's carries ComfyUI's flag)."
                    ),
                ),
                io.Combo.Input(
                    "text_encoder",
                    options=comfy_files.widget_options("text_encoder"),
                    tooltip=(
                        f"From models/text_encoders (or clip): {join_words(_picked('text_encoder', whose=True), 'or')}."
                    ),
                ),
                io.Combo.Input(
                    "text_encoder_2",
                    options=comfy_files.widget_options("text_encoder_2"),
                    tooltip=(
                        "From models/text_encoders (or clip): "
                        f"{join_words(_picked('text_encoder_2', whose=True), 'or')} (a family's two text encoders may "
                        "be picked in either order); none for "
                        f"{join_words([f.name for f in FILES_LAYOUTS if 'text_encoder_2' not in f.widget_files])}, "
                        "which have one."
                    ),
                ),
                io.Combo.Input(
                    "vae",
                    options=comfy_files.widget_options("vae"),
                    tooltip=(f"The VAE from models/vae: {join_words(_picked('vae', whose=True), 'or')}."),
                ),
                io.Combo.Input(
                    "diffusion_model_2",
                    options=comfy_files.widget_options("diffusion_model_2"),
                    default=comfy_files.NO_FILE,
                    optional=True,
                    tooltip=(
                        "A second transformer from models/diffusion_models (or unet): "
                        f"{join_words(_picked('diffusion_model_2'), 'or')}, with the high-noise expert in "
                        "diffusion_model; none for every other model."
                    ),
                ),
                io.Combo.Input(
                    "clip_vision",
                    options=comfy_files.widget_options("clip_vision"),
                    default=comfy_files.NO_FILE,
                    optional=True,
                    tooltip=(
                        f"From models/clip_vision, for {join_words(_picked('clip_vision'), 'or')}; none for every "
                        "other model."
                    ),
                ),
            ],
            outputs=[
                ModelName.Output(
                    display_name="model",
                    tooltip=(
                        "The model, as the name of its converted diffusers folder: link it into the model input of "
                        "Encode on Balanced GPUs, Load Sharded Transformer and VAE Decode (single GPU)."
                    ),
                )
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, input_types: dict) -> bool | str:
        """The files' headers (format, family, whether they fit together), before anything is converted."""
        return comfy.validate(cls, input_types, lambda node: jobs.validate_comfy_files(**node.widgets(*WIDGETS)))

    @classmethod
    def fingerprint_inputs(cls, **inputs) -> object:
        """The files' sizes and modification times: a file replaced under its name is a new input (a new conversion),
        not the cached output of the file that was."""
        inputs = comfy.with_defaults(cls, inputs)  # an API prompt may leave out the optional inputs appended later
        found = []
        for widget in WIDGETS:
            if inputs.get(widget) == comfy_files.NO_FILE:
                found.append(None)
                continue
            try:
                stat = os.stat(comfy_files.resolve(widget, inputs.get(widget) or "", widget))
            except (InvalidInput, OSError):
                return None
            found.append((stat.st_size, stat.st_mtime_ns))
        return tuple(found)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        w = comfy.execution_inputs(cls, inputs)
        name, plan = comfy.run(cls, jobs.model_from_comfy_files, **{k: w[k] for k in WIDGETS})
        comfy.show_text(cls, f"{plan.variant} from ComfyUI's files: {plan.folder}")
        return io.NodeOutput(name)
