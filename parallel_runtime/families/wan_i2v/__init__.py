"""Wan image-to-video, in one folder: its adapter (``adapter.py``, Wan's with the start image's denoise) and its tiny
builder (``tiny.py``: tests import it, the adapter never does). Its ComfyUI files are Wan's layout (``wan/files.py``
tells I2V by the transformer's input channels), so it has no ``files.py`` of its own."""

from .adapter import WanI2V

__all__ = ["WanI2V"]
