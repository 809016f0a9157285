"""A tiny random Wan I2V folder, built offline: Wan's tiny builder (``wan/tiny.py``) as ``WanImageToVideoPipeline``,
Wan 2.1 I2V (a tiny CLIP vision encoder) or, with ``two_experts``, Wan 2.2 A14B I2V (no image encoder)."""

from __future__ import annotations

from ..wan.tiny import make_tiny_model as make_tiny_wan


def make_tiny_model(out_dir: str, seed: int = 0, *, two_experts: bool = False) -> str:
    """Build a tiny Wan I2V pipeline folder in ``out_dir``."""
    return make_tiny_wan(out_dir, seed, two_experts=two_experts, image_to_video=True)
