from __future__ import annotations

from comfy_api.latest import io

from parallel_runtime import default_spec, jobs
from parallel_runtime.wire import DecodeResult

from . import comfy
from .types import CATEGORY, backend_input, dtype_input, model_input


class VAEDecodeSingleGPU(io.ComfyNode):
    """Decode a LATENT with the model's VAE on one device."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="VAEDecodeSingleGPU",
            display_name="VAE Decode (single GPU)",
            category=CATEGORY,
            description=(
                "Decodes on one device of the backend. Accepts LATENTs from ParallelSampler or from ComfyUI's samplers."
            ),
            inputs=[
                io.Latent.Input("samples", tooltip="Un-normalised VAE-space latents (ComfyUI's convention)."),
                model_input("The pipeline folder whose VAE decodes."),
                io.Combo.Input(
                    "device",
                    options=jobs.decode_device_choices(),
                    default="auto",
                    tooltip="auto: the first GPU, or the CPU without one.",
                ),
                dtype_input(),
                backend_input(),
                io.Boolean.Input(
                    "decode_over_ranks",
                    default=False,
                    optional=True,
                    tooltip=(
                        "Decode with diffusers' tiled decode (enable_tiling(): overlapping tiles, blended), the tiles "
                        "shared over the backend's ranks, each on its own GPU, joined on the first: for images and "
                        "video clips whose decode does not fit one GPU (a GPU holds one tile's decode at a time). "
                        "Needs device auto. Off: one plain decode on one device."
                    ),
                ),
            ],
            outputs=[
                io.Image.Output(
                    tooltip=(
                        "The decoded images, [B, H, W, 3] in 0..1, on the CPU; a video LATENT's clips as their "
                        "frames, clip by clip (B × length), for ComfyUI's CreateVideo or SaveAnimatedWEBP."
                    )
                )
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, input_types: dict) -> bool | str:
        """The model's VAE and the device, before anything runs."""
        return comfy.validate(
            cls,
            input_types,
            lambda node: jobs.validate_decode(**node.widgets("model", "device", "decode_over_ranks")),
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        w = comfy.execution_inputs(cls, inputs)
        spec = w.pop("backend") or default_spec()
        # Over the ranks the decode uses every rank's device; otherwise the one it runs on.
        comfy.make_room(cls, spec, None if w["decode_over_ranks"] else jobs.decode_device(spec, w["device"]))
        samples = w.pop("samples")["samples"]

        def show_tiles(result: DecodeResult) -> None:
            if result.tiles_per_rank:
                comfy.show_text(cls, jobs.over_ranks_text(result))

        return io.NodeOutput(comfy.run(cls, jobs.decode, spec, samples=samples, on_result=show_tiles, **w))
