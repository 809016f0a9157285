"""FLUX.1 Kontext [dev], in one folder: its adapter (``adapter.py``, FLUX.1's with the reference image's denoise) and
its tiny builder (``tiny.py``: tests import it, the adapter never does). Its ComfyUI file has FLUX.1-dev's layout, so
it has no ``files.py`` of its own (adapter.py says why)."""

from .adapter import FluxKontext

__all__ = ["FluxKontext"]
