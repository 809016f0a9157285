"""FLUX.1, in one folder: its adapter (``adapter.py``), the layout of its ComfyUI files (``files.py``) and its tiny
builders (``tiny.py``: tests, benchmarks and the demo import it, through ``families.tiny.make_tiny_model`` or by
name; the adapter never does)."""

from .adapter import Flux1
from .files import Flux1Files

__all__ = ["Flux1", "Flux1Files"]
