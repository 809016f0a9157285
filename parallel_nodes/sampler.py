from parallel_runtime import jobs

from . import comfy
from .types import CATEGORY, CONDITIONING, TRANSFORMER


def _prompt_count(node: comfy.QueuedNode) -> int | None:
    """How many prompts the linked encoder holds (data parallelism needs an image per rank), or None when its prompt
    comes from another node."""
    try:
        return jobs.count_prompts(**node.source("positive").widgets("prompt", "one_prompt_per_line"))
    except comfy.Unknown:
        return None


class ParallelSampler:
    """Run the denoising loop on the backend that holds the transformer."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "sample"
    DESCRIPTION = ("Denoises on the transformer's backend (progress per step; Cancel stops every rank at the same "
                   "step). The LATENT is in ComfyUI's convention, so ComfyUI's own VAEDecode accepts it too.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "transformer": (TRANSFORMER, {"tooltip": "From LoadShardedTransformer; runs on its backend."}),
            "positive": (CONDITIONING, {"tooltip": "From EncodeOnBalancedGPUs."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True,
                             "tooltip": "Noise seed; image i of a batch uses the same generator stream as diffusers."}),
            "steps": ("INT", {"default": 28, "min": 1, "max": 1000, "tooltip": "Denoising steps."}),
            "guidance_scale": ("FLOAT", {"default": 3.5, "min": 0.0, "max": 100.0, "step": 0.1,
                                         "tooltip": "Distilled guidance of FLUX.1-dev / FLUX.2-dev (not CFG). "
                                                    "Ignored by Qwen-Image: see true_cfg_scale."}),
            "width": ("INT", {"default": 1024, "min": 16, "max": 8192, "step": 16, "tooltip": "A multiple of 16."}),
            "height": ("INT", {"default": 1024, "min": 16, "max": 8192, "step": 16, "tooltip": "A multiple of 16."}),
            "batch_size": ("INT", {"default": 1, "min": 1, "max": 64,
                                    "tooltip": "Images per prompt (one_prompt_per_line on EncodeOnBalancedGPUs gives "
                                               "several prompts); image i of the whole batch uses seed + i."}),
        }, "optional": {
            "true_cfg_scale": ("FLOAT", {"default": 4.0, "min": 1.0, "max": 100.0, "step": 0.1,
                                         "tooltip": "Qwen-Image's true classifier-free guidance against the negative "
                                                    "prompt (EncodeOnBalancedGPUs); 1 turns it off and halves the "
                                                    "work per step. Ignored by families without true CFG (FLUX)."}),
        }, "hidden": comfy.HIDDEN}

    @classmethod
    def VALIDATE_INPUTS(cls, unique_id: str) -> bool | str:
        """Steps and sizes against the linked transformer's family and strategy (e.g. how context parallelism splits
        the image tokens), before anything runs."""
        return comfy.validate(unique_id, lambda node: jobs.validate_sample(
            node.input("transformer"), None, prompts=_prompt_count(node),
            **node.widgets("steps", "width", "height", "batch_size", "true_cfg_scale")))

    def sample(self, transformer, positive, seed: int, steps: int, guidance_scale: float, width: int, height: int,
               batch_size: int = 1, true_cfg_scale: float = 4.0, unique_id: str | None = None):
        samples = comfy.run(jobs.sample, unique_id=unique_id, handle=transformer, conditioning=positive, seed=seed,
                            steps=steps, guidance_scale=guidance_scale, width=width, height=height,
                            batch_size=batch_size, true_cfg_scale=true_cfg_scale)
        return ({"samples": samples},)
