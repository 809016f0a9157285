from __future__ import annotations

from comfy_api.latest import io

from parallel_runtime import default_spec, jobs
from parallel_runtime.families import ENCODER_IMAGES, REGISTRY, join_words, names

from . import comfy
from .types import CATEGORY, Conditioning, backend_input, dtype_input, max_memory_input, model_input


class EncodeOnBalancedGPUs(io.ComfyNode):
    """Encode a prompt (and the negative prompt of families with true CFG) with the model's text encoders spread over
    the GPUs (device_map="balanced")."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="EncodeOnBalancedGPUs",
            display_name="Encode on Balanced GPUs",
            category=CATEGORY,
            description=(
                "Loads only the text encoders, balanced across the backend's GPUs, and encodes the prompt. "
                "Under the staged memory policy they are freed before the transformer loads. Text encoders stored "
                "in fp8 (ComfyUI's fp8 and scaled-fp8 files) are held in fp8, each Linear layer's weight made in the "
                "dtype (times its scale) only while it runs: about half the memory, the same embeddings."
            ),
            inputs=[
                model_input("A diffusers pipeline folder from models/diffusers."),
                io.String.Input(
                    "prompt",
                    multiline=True,
                    default="",
                    tooltip=(f"What to generate (at most {jobs.MAX_PROMPT_BYTES >> 10} KiB of text)."),
                ),
                io.String.Input(
                    "prompt_2",
                    multiline=True,
                    default="",
                    optional=True,
                    tooltip=(
                        f"A separate prompt for the second text encoder ({names(lambda f: f.text_encoders > 1)}). "
                        f"Empty: the same prompt. {names(lambda f: f.text_encoders == 1)} have one text encoder: "
                        "leave it empty."
                    ),
                ),
                io.Int.Input(
                    "max_sequence_length",
                    default=512,
                    min=1,
                    max=jobs.MAX_SEQUENCE_LENGTH,
                    optional=True,
                    tooltip=(
                        "Longest prompt in text-encoder tokens (a family's system prompt included); longer prompts "
                        f"are cut. {names(lambda f: f.pads_text)} pad to it. At most "
                        f"{join_words([f'{f.max_sequence_length} for {f.name}' for f in REGISTRY])}. "
                        f"It cuts nothing for {names(lambda f: f.encoder_images)}, whose embeddings hold the "
                        "pictures' tokens beside the prompt: there it is only that limit."
                    ),
                ),
                max_memory_input(),
                dtype_input(),
                backend_input(),
                # Last: UI-format workflows store widget values by position, so saved graphs keep loading.
                io.String.Input(
                    "negative_prompt",
                    multiline=True,
                    default="",
                    optional=True,
                    tooltip=(
                        f"What to steer away from, used by the true CFG of {names(lambda f: f.true_cfg)} "
                        "(ParallelSampler's true_cfg_scale > 1); empty is a valid negative prompt. Ignored by "
                        f"{names(lambda f: not f.true_cfg)}."
                    ),
                ),
                io.Boolean.Input(
                    "one_prompt_per_line",
                    default=False,
                    optional=True,
                    tooltip=(
                        f"Each non-empty line of prompt is a prompt of its own (at most {jobs.MAX_PROMPTS}; prompt_2: "
                        "one line per prompt, or empty). ParallelSampler makes batch_size images of each, in order; "
                        "data_parallel spreads them over the ranks."
                    ),
                ),
                # Last too (saved graphs keep loading): the images an edit model's text encoder reads.
                *(
                    io.Image.Input(
                        name,
                        optional=True,
                        tooltip=(
                            f"{'The' if name == 'image' else 'Another'} image to edit as the prompt says, for the edit "
                            f"models whose text encoder reads images ({names(lambda f: f.encoder_images > 0)}: the "
                            "image input required, image_2 and image_3 optional; refused by the others), e.g. from "
                            "LoadImage. Its pipeline's resizing is applied and shown: about 384² at the image's "
                            "aspect ratio for the text encoder, about 1024² for the VAE latents the transformer "
                            "reads beside the output's (whatever the output's size); ParallelSampler gets them with "
                            "positive."
                        ),
                    )
                    for name in ENCODER_IMAGES
                ),
            ],
            outputs=[
                Conditioning.Output(
                    display_name="positive",
                    tooltip=(
                        "The prompt's embeddings (and the negative prompt's, for true CFG), held on the CPU: feed "
                        "ParallelSampler's positive input."
                    ),
                )
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, input_types: dict) -> bool | str:
        """Prompt, prompt_2 and max_sequence_length against the model's family, before any weights load."""
        return comfy.validate(
            cls,
            input_types,
            lambda node: jobs.validate_encode(
                **node.widgets(
                    "model",
                    "prompt",
                    "prompt_2",
                    "negative_prompt",
                    "max_sequence_length",
                    "max_memory",
                    "one_prompt_per_line",
                ),
                images_linked=tuple(name for name in ENCODER_IMAGES if node.linked(name)),
            ),
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        w = comfy.execution_inputs(cls, inputs)
        spec = w.pop("backend") or default_spec()
        comfy.make_room(cls, spec)
        conditioning = comfy.run(cls, jobs.encode_prompt, spec, **w)
        if conditioning.images:
            comfy.show_text(cls, "\n".join(image.describe() for image in conditioning.images))
        return io.NodeOutput(conditioning)
