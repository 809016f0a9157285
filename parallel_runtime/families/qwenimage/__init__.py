"""Qwen-Image, in one folder: its adapter (``adapter.py``), the layout of its ComfyUI files (``files.py``) and its tiny
builders (``tiny.py``, which tests and the demo import through ``FamilyAdapter.make_tiny_model`` or by name)."""

from .adapter import QwenImage
from .files import QwenImageFiles

__all__ = ["QwenImage", "QwenImageFiles"]
