"""The generation steps as the nodes ask for them: check the widgets, then call the backend.

One module per node's step (encode, transformer, lora, sample, decode, vae_encode; comfy_files: a model from
ComfyUI's files) and the widget readers they share. Each step checks everything that can be checked without weights
first (raising ``InvalidInput`` that names the widget and the fix), then runs one op. What travels between steps are
plain values: the ``Conditioning`` (embeddings, on the CPU), a ``TransformerHandle`` (a validated choice; nothing
loaded yet), LATENT samples and IMAGE tensors in ComfyUI's conventions. The nodes (``parallel_nodes``) are thin
wrappers over these functions; the demo calls them directly.
"""

from .comfy_files import model_from_comfy_files, validate_comfy_files
from .decode import decode, decode_device, decode_device_choices, over_ranks_text, validate_decode
from .encode import MAX_SEQUENCE_LENGTH, Conditioning, count_prompts, encode_prompt, validate_encode
from .lora import MAX_STRENGTH, LoraCheck, add_lora, validate_lora
from .sample import LatentImage, ReferenceImage, read_latent_image, read_reference_images, sample, validate_sample
from .transformer import TransformerHandle, plan_transformer
from .vae_encode import Encoded, crop_pixels, vae_encode
from .widgets import DTYPE_OPTIONS, MAX_PROMPT_BYTES, MAX_PROMPTS

__all__ = [
    "DTYPE_OPTIONS",
    "MAX_PROMPTS",
    "MAX_PROMPT_BYTES",
    "MAX_SEQUENCE_LENGTH",
    "MAX_STRENGTH",
    "Conditioning",
    "Encoded",
    "LatentImage",
    "LoraCheck",
    "ReferenceImage",
    "TransformerHandle",
    "add_lora",
    "count_prompts",
    "crop_pixels",
    "decode",
    "decode_device",
    "decode_device_choices",
    "encode_prompt",
    "model_from_comfy_files",
    "over_ranks_text",
    "plan_transformer",
    "read_latent_image",
    "read_reference_images",
    "sample",
    "vae_encode",
    "validate_comfy_files",
    "validate_decode",
    "validate_encode",
    "validate_lora",
    "validate_sample",
]
