"""FLUX.2 [klein], in one folder: its adapter (``adapter.py``, FLUX.2's with the Qwen3 text encoder and the klein
pipeline's denoise), the layout of its ComfyUI files (``files.py``) and its tiny builders (``tiny.py``: tests import
it, the adapter never does)."""

from .adapter import Flux2Klein
from .files import Flux2KleinFiles

__all__ = ["Flux2Klein", "Flux2KleinFiles"]
