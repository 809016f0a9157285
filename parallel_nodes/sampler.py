from __future__ import annotations

from comfy_api.latest import io

from parallel_runtime import jobs

from . import comfy
from .types import CATEGORY, Conditioning, Transformer


def _prompt_count(node: comfy.QueuedNode) -> int | None:
    """How many prompts the linked encoder holds (data parallelism needs an image per rank), or None when its prompt
    comes from another node."""
    try:
        return jobs.count_prompts(**node.source("positive").widgets("prompt", "one_prompt_per_line"))
    except comfy.Unknown:
        return None


class ParallelSampler(io.ComfyNode):
    """Run the denoising loop on the backend that holds the transformer."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ParallelSampler",
            display_name="Parallel Sampler",
            category=CATEGORY,
            description=(
                "Denoises on the transformer's backend (progress per step; Cancel stops every rank at the "
                "same step). The LATENT is in ComfyUI's convention, so ComfyUI's own VAEDecode accepts it "
                "too."
            ),
            inputs=[
                Transformer.Input("transformer", tooltip="From LoadShardedTransformer; runs on its backend."),
                Conditioning.Input("positive", tooltip="From EncodeOnBalancedGPUs."),
                io.Int.Input(
                    "seed",
                    default=0,
                    min=0,
                    max=0xFFFFFFFFFFFFFFFF,
                    control_after_generate=True,
                    tooltip=(
                        "Noise seed; image i of a batch uses seed + i (wrapping round at 2^64), the "
                        "same generator stream as diffusers."
                    ),
                ),
                io.Int.Input("steps", default=28, min=1, max=1000, tooltip="Denoising steps."),
                io.Float.Input(
                    "guidance_scale",
                    default=3.5,
                    min=0.0,
                    max=100.0,
                    step=0.1,
                    tooltip=(
                        "Distilled guidance of FLUX.1-dev / FLUX.2-dev (not CFG). Ignored by Qwen-Image: see "
                        "true_cfg_scale."
                    ),
                ),
                io.Int.Input("width", default=1024, min=16, max=8192, step=16, tooltip="A multiple of 16."),
                io.Int.Input("height", default=1024, min=16, max=8192, step=16, tooltip="A multiple of 16."),
                io.Int.Input(
                    "batch_size",
                    default=1,
                    min=1,
                    max=64,
                    tooltip=(
                        "Images per prompt (one_prompt_per_line on EncodeOnBalancedGPUs gives several prompts); image "
                        "i of the whole batch uses seed + i."
                    ),
                ),
                io.Float.Input(
                    "true_cfg_scale",
                    default=4.0,
                    min=1.0,
                    max=100.0,
                    step=0.1,
                    optional=True,
                    tooltip=(
                        "Qwen-Image's true classifier-free guidance against the negative prompt "
                        "(EncodeOnBalancedGPUs); 1 turns it off and halves the work per step. Ignored "
                        "by families without true CFG (FLUX)."
                    ),
                ),
            ],
            outputs=[
                io.Latent.Output(
                    tooltip=(
                        "The denoised latents in ComfyUI's convention for the family: decode with VAEDecodeSingleGPU "
                        "or ComfyUI's own VAEDecode."
                    )
                )
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, input_types: dict) -> bool | str:
        """Steps and sizes against the linked transformer's family and strategy (e.g. how context parallelism splits
        the image tokens), before anything runs."""
        return comfy.validate(
            cls,
            input_types,
            lambda node: jobs.validate_sample(
                node.input("transformer"),
                None,
                prompts=_prompt_count(node),
                **node.widgets("steps", "width", "height", "batch_size", "guidance_scale", "true_cfg_scale"),
            ),
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        w = comfy.with_defaults(cls, inputs)
        samples = comfy.run(
            cls,
            jobs.sample,
            w.pop("transformer"),
            w.pop("positive"),
            on_cache_report=lambda report: comfy.show_text(cls, report.describe()),
            **w,
        )
        return io.NodeOutput({"samples": samples})
