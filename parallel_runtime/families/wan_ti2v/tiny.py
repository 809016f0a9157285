"""A tiny random Wan 2.2 TI2V-5B folder, built offline: Wan's tiny builder (``wan/tiny.py``) with ``ti2v``."""

from __future__ import annotations

from ..wan.tiny import make_tiny_model as make_tiny_wan


def make_tiny_model(out_dir: str, seed: int = 0) -> str:
    """Build a tiny Wan 2.2 TI2V-5B ``WanPipeline`` folder (``expand_timesteps``) in ``out_dir``."""
    return make_tiny_wan(out_dir, seed, ti2v=True)
