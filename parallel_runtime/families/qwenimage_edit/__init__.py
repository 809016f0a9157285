"""Qwen-Image-Edit (Plus: 2509, 2511), in one folder: its adapter (``adapter.py``, Qwen-Image's with the images its
text encoder reads and its transformer edits) and its tiny builder (``tiny.py``: tests import it, the adapter never
does). Its ComfyUI transformer file has Qwen-Image's layout, so it has no ``files.py`` of its own (adapter.py says
why)."""

from .adapter import QwenImageEdit

__all__ = ["QwenImageEdit"]
