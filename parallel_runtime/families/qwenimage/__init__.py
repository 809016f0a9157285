"""Qwen-Image, in one folder: its adapter (``adapter.py``), the layout of its ComfyUI files (``files.py``) and its tiny
builders (``tiny.py``: tests, benchmarks and the demo import it, through ``families.tiny.make_tiny_model`` or by
name; the adapter never does)."""

from .adapter import QwenImage
from .files import QwenImageFiles

__all__ = ["QwenImage", "QwenImageFiles"]
