from parallel_runtime import default_spec, jobs, model_folders

from . import comfy
from .types import BACKEND_INPUT, CATEGORY, DTYPE_INPUT


class VAEDecodeSingleGPU:
    """Decode a LATENT with the model's VAE on one device."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "decode"
    DESCRIPTION = "Decodes on one device of the backend. Accepts LATENTs from ParallelSampler or from ComfyUI's samplers."

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "samples": ("LATENT", {"tooltip": "Un-normalised VAE-space latents (ComfyUI's convention)."}),
                "model": (model_folders.list_models(), {"tooltip": "The pipeline folder whose VAE decodes."}),
                "device": (jobs.decode_device_choices(), {"default": "auto",
                                                          "tooltip": "auto: the first GPU, or the CPU without one."}),
            },
            "optional": {
                "dtype": DTYPE_INPUT,
                "backend": BACKEND_INPUT,
            },
            "hidden": comfy.HIDDEN,
        }

    def decode(self, samples: dict, model: str, device: str = "auto", dtype: str = "auto", backend=None,
               unique_id: str | None = None):
        return (comfy.run(jobs.decode, unique_id=unique_id, spec=backend or default_spec(), model=model,
                          samples=samples["samples"], device=device, dtype=dtype),)
