from parallel_runtime import default_spec, jobs, model_folders

from . import comfy
from .types import BACKEND_INPUT, CATEGORY, CONDITIONING, DTYPE_INPUT, MAX_MEMORY_INPUT


class EncodeOnBalancedGPUs:
    """Encode a prompt (and Qwen-Image's negative prompt) with the model's text encoders spread over the GPUs
    (device_map="balanced")."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (CONDITIONING,)
    RETURN_NAMES = ("positive",)
    FUNCTION = "encode"
    DESCRIPTION = ("Loads only the text encoders, balanced across the backend's GPUs, and encodes the prompt. "
                   "Under the staged memory policy they are freed before the transformer loads.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (model_folders.list_models(), {"tooltip": "A diffusers pipeline folder from models/diffusers."}),
                "prompt": ("STRING", {"multiline": True, "default": "", "tooltip": "What to generate."}),
            },
            "optional": {
                "prompt_2": ("STRING", {"multiline": True, "default": "",
                                        "tooltip": "A separate prompt for the second text encoder (FLUX.1: T5). "
                                                   "Empty: the same prompt. FLUX.2 and Qwen-Image have one text "
                                                   "encoder: leave it empty."}),
                "max_sequence_length": ("INT", {"default": 512, "min": 1, "max": jobs.MAX_SEQUENCE_LENGTH,
                                                "tooltip": "Longest prompt in text-encoder tokens; longer prompts are "
                                                           "cut. FLUX.1 (T5) and FLUX.2 (system prompt included) "
                                                           "pad to it, up to 512; Qwen-Image up to 1024."}),
                "max_memory": MAX_MEMORY_INPUT,
                "dtype": DTYPE_INPUT,
                "backend": BACKEND_INPUT,
                # Last: UI-format workflows store widget values by position, so saved graphs keep loading.
                "negative_prompt": ("STRING", {"multiline": True, "default": "",
                                               "tooltip": "What to steer away from, used by Qwen-Image's true CFG "
                                                          "(ParallelSampler's true_cfg_scale > 1); empty is a valid "
                                                          "negative prompt. Ignored by FLUX."}),
                "one_prompt_per_line": ("BOOLEAN", {"default": False,
                                                    "tooltip": "Each non-empty line of prompt is a prompt of its own "
                                                               "(prompt_2: one line per prompt, or empty). "
                                                               "ParallelSampler makes batch_size images of each, in "
                                                               "order; data_parallel spreads them over the ranks."}),
            },
            "hidden": comfy.HIDDEN,
        }

    @classmethod
    def VALIDATE_INPUTS(cls, unique_id: str) -> bool | str:
        """Prompt, prompt_2 and max_sequence_length against the model's family, before any weights load."""
        return comfy.validate(unique_id, lambda node: jobs.validate_encode(**node.widgets(
            "model", "prompt", "prompt_2", "max_sequence_length", "max_memory", "one_prompt_per_line")))

    def encode(self, model: str, prompt: str, prompt_2: str = "", max_sequence_length: int = 512,
               max_memory: str = "", dtype: str = "auto", backend=None, negative_prompt: str = "",
               one_prompt_per_line: bool = False, unique_id: str | None = None):
        spec = backend or default_spec()
        return (comfy.run(jobs.encode_prompt, unique_id=unique_id, spec=spec, model=model, prompt=prompt,
                          prompt_2=prompt_2, negative_prompt=negative_prompt, max_sequence_length=max_sequence_length,
                          max_memory=max_memory, dtype=dtype, one_prompt_per_line=one_prompt_per_line),)
