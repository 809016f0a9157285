"""Wan 2.2 TI2V-5B, in one folder: its adapter (``adapter.py``, Wan's with a 16× VAE and an optional start image) and
its tiny builder (``tiny.py``: tests import it, the adapter never does). Its ComfyUI files are Wan's layout
(``wan/files.py`` tells TI2V-5B by the transformer's 48 input channels), so it has no ``files.py`` of its own."""

from .adapter import WanTI2V

__all__ = ["WanTI2V"]
