"""Where models come from, without a backend: one broken folder never breaks the node list, a model folder that is a
symbolic link the user placed loads, and the widget's string is confined to the listed names."""

from __future__ import annotations

import json
import logging
import os

import pytest

from parallel_runtime import InvalidInput, model_folders
from parallel_runtime.families.tiny import make_tiny_model


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    make_tiny_model("flux", str(base / "tiny-flux"))
    broken = {"a-list": "[1, 2]", "a-null": "null", "deep": "[" * 100000 + "]" * 100000, "not-json": "{nope",
              "no-class": "{}", "other": json.dumps({"_class_name": "StableDiffusionPipeline"})}  # fmt: skip
    for name, index in broken.items():
        os.makedirs(base / name)
        (base / name / "model_index.json").write_text(index)
    elsewhere = tmp_path_factory.mktemp("other-disk")
    make_tiny_model("flux", str(elsewhere / "kept-elsewhere"))
    os.symlink(elsewhere / "kept-elsewhere", base / "linked-flux")
    os.makedirs(base / "org")
    os.symlink(elsewhere / "kept-elsewhere", base / "org" / "FLUX.1-tiny")
    os.symlink(base, base / "org" / "loop")  # a link back up: listed only to the depth limit, never for ever
    return base


@pytest.fixture
def models(root, monkeypatch):
    monkeypatch.setenv("COMFY_PARALLEL_MODELS", str(root))
    model_folders._warned.clear()
    return root


def test_broken_folders_are_skipped_with_one_warning_each(models, caplog):
    with caplog.at_level(logging.WARNING, logger="parallel_runtime.model_folders"):
        assert model_folders.list_models() == ["linked-flux", "org/FLUX.1-tiny", "tiny-flux"]
        model_folders.list_models()  # a second listing warns no more
    warned = [r.getMessage() for r in caplog.records]
    for name in ("a-list", "a-null", "deep", "not-json", "no-class", "other"):
        assert sum(f"{os.sep}{name}" in m for m in warned) == 1, (name, warned)


def test_a_symlinked_model_folder_loads(models):
    ref = model_folders.resolve("linked-flux")
    assert ref.family == "flux" and ref.path == os.path.join(models, "linked-flux")
    assert model_folders.resolve("org/FLUX.1-tiny").family == "flux"


@pytest.mark.parametrize("name", ["../tiny-flux", "/etc", "tiny-flux/../tiny-flux", "org//FLUX.1-tiny"])
def test_the_widget_string_is_confined(models, name):
    with pytest.raises(InvalidInput, match="pick a folder name from the list") as e:
        model_folders.resolve(name)
    assert e.value.widget == "model"


def test_a_broken_folder_named_anyway_says_why(models):
    with pytest.raises(InvalidInput, match="not a readable diffusers pipeline"):
        model_folders.resolve("a-list")
    with pytest.raises(InvalidInput, match="StableDiffusionPipeline"):
        model_folders.resolve("other")
