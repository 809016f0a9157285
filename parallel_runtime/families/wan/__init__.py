"""Wan 2.1 / 2.2 text-to-video, in one folder: its adapter (``adapter.py``) and its tiny builders (``tiny.py``: tests,
benchmarks and the demo import it, through ``families.tiny.make_tiny_model`` or by name; the adapter never does)."""

from .adapter import Wan

__all__ = ["Wan"]
