from __future__ import annotations

from comfy_api.latest import io

from parallel_runtime import default_spec, jobs
from parallel_runtime.families import names

from . import comfy
from .types import CATEGORY, backend_input, dtype_input, model_input


class VAEEncodeSingleGPU(io.ComfyNode):
    """Encode an IMAGE to a LATENT with the model's VAE on one device."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="VAEEncodeSingleGPU",
            display_name="VAE Encode (single GPU)",
            category=CATEGORY,
            description=(
                "Encodes on one device of the backend, for ParallelSampler's latent_image (img2img, inpainting). "
                "The LATENT is in ComfyUI's convention for the family, so ComfyUI's latent nodes and samplers take "
                "it too."
            ),
            inputs=[
                io.Image.Input(
                    "pixels",
                    tooltip=(
                        "The image, [B, H, W, 3] in 0..1 (LoadImage). Sides that are not multiples of 16 are cropped "
                        "to the centre, as ComfyUI's VAEEncode crops to its VAE's factor."
                    ),
                ),
                model_input("The pipeline folder whose VAE encodes: the model the sampler runs."),
                io.Combo.Input(
                    "device",
                    options=jobs.decode_device_choices(),
                    default="auto",
                    tooltip="auto: the first GPU, or the CPU without one.",
                ),
                dtype_input(),
                backend_input(),
            ],
            outputs=[
                io.Latent.Output(
                    tooltip=(
                        "The posterior's mode (deterministic), un-normalised VAE latents in ComfyUI's convention "
                        f"({names(lambda f: f.latent.channels_per_vae_channel == 4)}: normalised 2×2 patches, as "
                        "ComfyUI has them)."
                    )
                )
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, input_types: dict) -> bool | str:
        """The model's VAE and the device, before anything runs."""
        return comfy.validate(cls, input_types, lambda node: jobs.validate_decode(**node.widgets("model", "device")))

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        w = comfy.execution_inputs(cls, inputs)
        spec = w.pop("backend") or default_spec()
        comfy.make_room(cls, spec, jobs.decode_device(spec, w["device"]))
        encoded = comfy.run(cls, jobs.vae_encode, spec, **w)
        if encoded.cropped_to is not None:
            height, width = w["pixels"].shape[1:3]
            comfy.show_text(cls, f"cropped {width}×{height} to {encoded.cropped_to[0]}×{encoded.cropped_to[1]}")
        return io.NodeOutput({"samples": encoded.samples})
