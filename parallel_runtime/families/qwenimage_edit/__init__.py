"""Qwen-Image-Edit (Plus: 2509, 2511), in one folder: its adapter (``adapter.py``, Qwen-Image's with the images its
text encoder reads and its transformer edits) and its tiny builder (``tiny.py``: tests import it, the adapter never
does). Its ComfyUI transformer files have Qwen-Image's layout, so Qwen-Image's ``files.py`` converts them (adapter.py
says how they are told apart)."""

from .adapter import QwenImageEdit

__all__ = ["QwenImageEdit"]
