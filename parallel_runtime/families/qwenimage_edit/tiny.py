"""A tiny random Qwen-Image-Edit-2511 folder, built offline: Qwen-Image's tiny model (the edit model's transformer, text
encoder and VAE are Qwen-Image's classes and shapes; its Qwen2.5-VL has a vision tower) with the processor through
which the text encoder sees the images, the transformer's ``zero_cond_t`` (2511's timestep-0 modulation of the
images' tokens) and ``model_index.json`` naming ``QwenImageEditPlusPipeline``."""

from __future__ import annotations

import json
import os

from diffusers import QwenImageEditPlusPipeline
from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

from ..qwenimage.tiny import make_tiny_model as make_tiny_qwenimage
from ..qwenimage.tiny import qwen2_tokenizer
from .adapter import QwenImageEdit


def _update_json(path: str, values: dict) -> None:
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config | values, f, indent=2)


def make_tiny_model(out_dir: str, seed: int = 0, zero_cond_t: bool = True) -> str:
    """Build a tiny Qwen-Image-Edit pipeline folder in ``out_dir`` (2511's; ``zero_cond_t`` False: 2509's)."""
    # The edit pipeline's prompt template, so that the tokens it drops (its prefix) are the prefix's, as the real
    # tokenizer's are.
    empty = QwenImageEditPlusPipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None, transformer=None
    )
    tokenizer = qwen2_tokenizer(empty.prompt_template_encode.format(""))
    make_tiny_qwenimage(out_dir, seed, tokenizer)
    return as_edit_folder(out_dir, tokenizer, zero_cond_t)


def as_edit_folder(out_dir: str, tokenizer: Qwen2Tokenizer, zero_cond_t: bool = True) -> str:
    """Make the Qwen-Image folder ``out_dir`` (a vision tower in its text encoder) Qwen-Image-Edit's: the processor
    around ``tokenizer``, the transformer's ``zero_cond_t`` (2511's; False: 2509's) and the edit pipeline's
    ``model_index.json``."""
    # Qwen2.5-VL's image processor as published (14-pixel patches merged 2×2, CLIP's mean and std); it holds no
    # weights, so the tiny model's is the real one.
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor()
    )
    processor.save_pretrained(os.path.join(out_dir, "processor"))
    _update_json(os.path.join(out_dir, "transformer", "config.json"), {"zero_cond_t": zero_cond_t})
    _update_json(
        os.path.join(out_dir, "model_index.json"),
        {"_class_name": QwenImageEdit.pipeline, "processor": ["transformers", "Qwen2VLProcessor"]},
    )
    return os.fspath(out_dir)
