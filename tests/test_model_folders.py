"""Where models come from, without a backend: one broken folder never breaks the node list, a model folder that is a
symbolic link the user placed loads, and the widget's string is confined to the listed names."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import types

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


# -- files that are never loaded: one table, the same refusal wherever a file is picked -------------------------------
PICKLES = (".ckpt", ".pt", ".pt2", ".pth", ".bin", ".pkl")  # every pickle ComfyUI lists (its supported_pt_extensions)


def test_the_refused_suffixes_are_one_table_with_a_reason_each():
    assert set(PICKLES) <= set(model_folders.REFUSED_SUFFIXES)
    for suffix in PICKLES:
        assert "can run code" in model_folders.refused_because(f"model{suffix.upper()}"), suffix
    assert model_folders.refused_because("flux1-dev-Q4_K_S.gguf") is None  # ParallelModelFromComfyFiles loads it
    assert model_folders.refused_because("model.safetensors") is None


@pytest.mark.parametrize("suffix", sorted(model_folders.REFUSED_SUFFIXES))
def test_a_refused_file_is_listed_and_refused_with_its_reason_in_both_places(suffix, tmp_path, monkeypatch):
    """A diffusers folder whose component holds only such a file (the model widget), and ComfyUI's own file of that
    suffix (ParallelModelFromComfyFiles' widgets): both refused by name, with the table's reason."""
    from parallel_runtime import comfy_files

    reason = model_folders.REFUSED_SUFFIXES[suffix]
    model = tmp_path / "diffusers" / "pickled"
    (model / "transformer").mkdir(parents=True)
    (model / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (model / "transformer" / "config.json").write_text("{}")
    (model / "transformer" / f"diffusion_pytorch_model{suffix}").write_bytes(b"\x80\x02")
    (tmp_path / "comfy" / "diffusion_models").mkdir(parents=True)
    (tmp_path / "comfy" / "diffusion_models" / f"flux1-dev{suffix}").write_bytes(b"\x80\x02")
    monkeypatch.setenv("COMFY_PARALLEL_MODELS", str(tmp_path / "diffusers"))
    monkeypatch.setenv("COMFY_PARALLEL_COMFY_MODELS", str(tmp_path / "comfy"))

    with pytest.raises(InvalidInput, match=re.escape(f"only diffusion_pytorch_model{suffix}, {reason}; only")) as e:
        model_folders.resolve("pickled")
    assert e.value.widget == "model"
    assert f"flux1-dev{suffix}" in comfy_files.list_files("diffusion_model")  # listed, so that picking it says why
    with pytest.raises(InvalidInput, match=re.escape(f"'flux1-dev{suffix}' is {reason}; only")) as e:
        comfy_files.read_file("diffusion_model", f"flux1-dev{suffix}", "diffusion_model")
    assert e.value.widget == "diffusion_model"


def test_pickled_loras_are_listed_so_that_picking_one_says_why(tmp_path, monkeypatch):
    for suffix in (*PICKLES, ".safetensors"):
        (tmp_path / f"style{suffix}").write_bytes(b"\x80\x02")
    monkeypatch.setenv("COMFY_PARALLEL_LORAS", str(tmp_path))
    assert model_folders.list_loras() == sorted(f"style{suffix}" for suffix in (*PICKLES, ".safetensors"))


def test_model_folders_and_comfyui_files_come_from_the_same_roots(tmp_path, monkeypatch):
    """ComfyUI's folders first (its folder_paths, once ComfyUI has loaded it), then the environment's; ComfyUI's own
    files from each kind's folders, its legacy alias (``unet``) after the new name."""
    from parallel_runtime import comfy_files

    def folder(*parts):
        path = tmp_path.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    comfyui = {kind: [folder("comfyui", kind)] for kind in ("diffusers", "loras", "diffusion_models", "unet")}
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.get_folder_paths = lambda kind: comfyui[kind]  # raises KeyError for a kind ComfyUI does not know
    folder_paths.models_dir = str(tmp_path / "comfyui")
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)
    monkeypatch.setenv("COMFY_PARALLEL_MODELS", folder("mine"))
    monkeypatch.setenv("COMFY_PARALLEL_LORAS", folder("my-loras"))
    monkeypatch.setenv("COMFY_PARALLEL_COMFY_MODELS", os.pathsep.join([folder("models"), str(tmp_path / "gone")]))
    monkeypatch.delenv("COMFY_PARALLEL_CONVERTED", raising=False)
    folder("models", "unet")

    assert model_folders.roots() == [*comfyui["diffusers"], folder("mine")]
    assert model_folders.lora_roots() == [*comfyui["loras"], folder("my-loras")]
    assert comfy_files._roots("diffusion_model") == [
        *comfyui["diffusion_models"], *comfyui["unet"], folder("models", "unet")
    ]  # fmt: skip
    assert comfy_files._roots("vae") == []  # no ComfyUI folder of that kind, none in the models directories
    assert model_folders.converted_root() == str(tmp_path / "comfyui" / "parallel_diffusers_converted")


# -- what a newcomer puts in the models folder ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def odd_root(tmp_path_factory):
    """A models folder with what users put there: a single file in a folder, a pipeline whose transformer/ lost its
    weights, and one whose config asks for far more layers than its weights hold."""
    base = tmp_path_factory.mktemp("odd-models")
    (base / "flux1-dev").mkdir()
    (base / "flux1-dev" / "flux1-dev.safetensors").write_bytes(b"")
    make_tiny_model("flux", str(base / "no-weights"))
    for file in os.listdir(base / "no-weights" / "transformer"):
        if file.endswith(".safetensors"):
            os.remove(base / "no-weights" / "transformer" / file)
    (base / "org").mkdir()  # an organisation's folder: not a model itself, though it holds a file
    (base / "org" / "README.md").write_text("our models")
    make_tiny_model("flux", str(base / "org" / "listed"))
    make_tiny_model("flux", str(base / "ten-thousand-layers"))
    config_path = base / "ten-thousand-layers" / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_layers": 10_000}))
    return base


@pytest.fixture
def odd(odd_root, monkeypatch):
    monkeypatch.setenv("COMFY_PARALLEL_MODELS", str(odd_root))
    return odd_root


def test_a_folder_that_is_no_pipeline_is_named_with_why(odd, nodes):
    """ComfyUI says only "Value not in list": the model widget's tooltip lists what was skipped and why, and naming the
    folder anyway says it too."""
    assert "flux1-dev" not in model_folders.list_models() and "org/listed" in model_folders.list_models()
    assert dict(model_folders.skipped_models()) == {"flux1-dev": model_folders.NO_INDEX}
    hint = r"model: 'flux1-dev' has no model_index.json, .* ParallelModelFromComfyFiles"
    with pytest.raises(InvalidInput, match=hint):
        model_folders.resolve("flux1-dev")
    (model,) = [i for i in nodes["LoadShardedTransformer"].define_schema().inputs if i.id == "model"]
    assert "Not listed: flux1-dev (has no model_index.json" in model.tooltip, model.tooltip


def test_a_component_without_weights_is_named_with_the_file_expected(odd):
    hint = r"model: no-weights/transformer/ has a config.json but no weights: diffusion_pytorch_model.safetensors"
    with pytest.raises(InvalidInput, match=hint):
        model_folders.resolve("no-weights")


def test_a_config_that_disagrees_with_the_weights_is_refused_before_anything_is_built(odd):
    """10,000 layers in the config, 2 in the weights: refused from the headers, with low memory (building the model
    on the meta device from that config took minutes and gigabytes)."""
    import tracemalloc

    from parallel_runtime import default_spec, jobs

    hint = (
        r"model: ten-thousand-layers/transformer/config.json says num_layers = 10000, but its weights hold 2 "
        r"transformer_blocks"
    )
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput, match=hint):
            spec = default_spec(ranks=2, device="cpu")
            jobs.plan_transformer(spec, model="ten-thousand-layers", strategy="data_parallel")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MiB"
