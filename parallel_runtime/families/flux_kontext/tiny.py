"""A tiny random FLUX.1 Kontext [dev] folder, built offline: FLUX.1's tiny model (Kontext's transformer, text encoders
and VAE are FLUX.1's classes and shapes) with ``model_index.json`` naming ``FluxKontextPipeline``."""

from __future__ import annotations

import json
import os

from ..flux.tiny import make_tiny_model as make_tiny_flux
from .adapter import FluxKontext


def make_tiny_model(out_dir: str, seed: int = 0) -> str:
    """Build a tiny FLUX.1 Kontext pipeline folder in ``out_dir``."""
    make_tiny_flux(out_dir, seed)
    index_path = os.path.join(out_dir, "model_index.json")
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    index["_class_name"] = FluxKontext.pipeline
    with open(index_path, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    return os.fspath(out_dir)
