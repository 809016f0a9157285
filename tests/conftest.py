import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from comfyui_host import SKIP_MESSAGE, ComfyUIServer

# The backends the tests start serve the fault-injection op ("fail"); a production backend refuses it.
os.environ["COMFY_PARALLEL_TEST_OPS"] = "1"
# The nodes need ComfyUI's public API (comfy_api); with a ComfyUI checkout named, tests can import them. Appended, so
# ComfyUI's top-level modules never shadow the project's.
if os.environ.get("COMFYUI_DIR") and os.environ["COMFYUI_DIR"] not in sys.path:
    sys.path.append(os.environ["COMFYUI_DIR"])


@pytest.fixture(scope="session")
def nodes():
    """The pack's node classes by node id; skips the test without ComfyUI's comfy_api (COMFYUI_DIR)."""
    try:
        import comfy_api.latest  # noqa: F401
    except ImportError:
        pytest.skip(SKIP_MESSAGE)
    from parallel_nodes import NODES_BY_ID

    return NODES_BY_ID


# --- components the test run was promised -----------------------------------------------------------
# A skip's reason names what was missing; a run that was promised a component (.ci/run installs them and sets
# COMFY_PARALLEL_REQUIRE) fails instead, so CI cannot pass with a whole group skipped.
REQUIRABLE = {
    "comfyui": ("COMFYUI_DIR",),
    "chromium": ("Chromium", "playwright-core", "no node on PATH"),
    "comfy-cli": ("comfy-cli",),
}


def _required() -> dict[str, tuple[str, ...]]:
    names = [n.strip() for n in os.environ.get("COMFY_PARALLEL_REQUIRE", "").split(",") if n.strip()]
    unknown = sorted(set(names) - set(REQUIRABLE))
    if unknown:
        raise pytest.UsageError(f"COMFY_PARALLEL_REQUIRE names {unknown}; it takes {sorted(REQUIRABLE)}")
    return {name: REQUIRABLE[name] for name in names}


def pytest_configure(config):
    config.pd_required = _required()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    required = item.config.pd_required
    if not (report.skipped and required and isinstance(report.longrepr, tuple)):
        return
    reason = report.longrepr[2]
    for name, clues in required.items():
        if any(clue in reason for clue in clues):
            report.outcome = "failed"
            report.longrepr = f"{reason}\n(failed, not skipped: COMFY_PARALLEL_REQUIRE promises {name} to this run)"
            return


# --- real ComfyUI end-to-end host (tests/comfyui_host.py) -------------------------------------------
@pytest.fixture(scope="session")
def comfyui_dir():
    """The ComfyUI checkout named by COMFYUI_DIR; skips the test when it is unset."""
    path = os.environ.get("COMFYUI_DIR")
    if not path:
        pytest.skip(SKIP_MESSAGE)
    if not os.path.isfile(os.path.join(path, "main.py")):
        pytest.fail(f"COMFYUI_DIR={path} has no main.py; .ci/install-comfyui.sh makes a ComfyUI tree")
    return path


@pytest.fixture(scope="session")
def comfyui_models_dir(tmp_path_factory):
    """The server's ``diffusers`` model folder: save tiny pipelines here (save_pretrained directories)."""
    return tmp_path_factory.mktemp("comfyui-diffusers-models")


@pytest.fixture(scope="session")
def comfyui_loras_dir(tmp_path_factory):
    """The server's ``loras`` folder: save tiny LoRAs here (.safetensors files)."""
    return tmp_path_factory.mktemp("comfyui-loras")


# ComfyUI's model folders that ParallelModelFromComfyFiles lists.
COMFY_FILE_KINDS = ("diffusion_models", "text_encoders", "vae", "clip_vision")


@pytest.fixture(scope="session")
def comfyui_files_dir(tmp_path_factory):
    """A ComfyUI-style models folder whose ``diffusion_models``, ``text_encoders``, ``vae`` and ``clip_vision`` the
    server lists (put ComfyUI's own files there); the server converts them below its ``converted``."""
    root = tmp_path_factory.mktemp("comfyui-files")
    for kind in COMFY_FILE_KINDS:
        (root / kind).mkdir()
    return root


@pytest.fixture(scope="session")
def tiny_comfy_files(comfyui_files_dir, tmp_path_factory):
    """A tiny FLUX.1 as ComfyUI's files in ``comfyui_files_dir`` (one transformer per weight format) with its diffusers
    folders, built once for the session: ``{format: (widget values, reference folder)}``."""
    from parallel_runtime import comfy_files

    comfy_dir = comfy_files.comfy_package_dir()
    if comfy_dir is None:
        pytest.skip("needs ComfyUI's tokenizers: set COMFYUI_DIR (.ci/install-comfyui.sh makes one)")
    from parallel_runtime.families.flux.tiny import make_tiny_flux_files

    return make_tiny_flux_files(str(comfyui_files_dir), str(tmp_path_factory.mktemp("reference")), comfy_dir)


@pytest.fixture(scope="session")
def tiny_qwen_comfy_files(comfyui_files_dir, tmp_path_factory):
    """A tiny Qwen-Image as ComfyUI's files in ``comfyui_files_dir`` (one transformer per weight format) with its
    diffusers folders, built once for the session: ``{format: (widget values, reference folder)}``."""
    from parallel_runtime import comfy_files

    comfy_dir = comfy_files.comfy_package_dir()
    if comfy_dir is None:
        pytest.skip("needs ComfyUI's tokenizers: set COMFYUI_DIR (.ci/install-comfyui.sh makes one)")
    from parallel_runtime.families.qwenimage.tiny import make_tiny_qwenimage_files

    return make_tiny_qwenimage_files(str(comfyui_files_dir), str(tmp_path_factory.mktemp("reference-qwen")), comfy_dir)


@pytest.fixture(scope="session")
def tiny_flux2_comfy_files(comfyui_files_dir, tmp_path_factory):
    """A tiny FLUX.2-dev as ComfyUI's files in ``comfyui_files_dir`` (its bf16 transformer) with its diffusers folder,
    built once for the session: ``{"bf16": (widget values, reference folder)}``."""
    from parallel_runtime.families.flux2.tiny import make_tiny_flux2_files

    reference = tmp_path_factory.mktemp("reference-flux2")
    return make_tiny_flux2_files(str(comfyui_files_dir), str(reference), formats=("bf16",))


@pytest.fixture(scope="session")
def comfyui_server(comfyui_dir, comfyui_models_dir, comfyui_loras_dir, comfyui_files_dir):
    """One real ComfyUI server (CPU) with this pack linked in, shared by the session; stopped at the end."""
    server = ComfyUIServer(
        comfyui_dir,
        # ComfyUI's own loaders on the tiny models' reduced configs (test-only: its docstring says why)
        extra_packs={"parallel_diffusers_test_nodes": Path(__file__).parent / "comfyui_test_nodes"},
        diffusers_dir=comfyui_models_dir,
        loras_dir=comfyui_loras_dir,
        extra_model_paths={kind: comfyui_files_dir / kind for kind in COMFY_FILE_KINDS},
        env={"COMFY_PARALLEL_CONVERTED": str(comfyui_files_dir / "converted")},
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


# --- the pack's model folder, for tests that call the nodes in-process ------------------------------
@pytest.fixture(scope="module")
def models_root(tmp_path_factory):
    """An empty diffusers model folder that the nodes see (COMFY_PARALLEL_MODELS) for one test module. The backend
    the module used is shut down afterwards, so the next module starts from nothing."""
    from parallel_runtime import shutdown_backend

    root = tmp_path_factory.mktemp("diffusers-models")
    old = os.environ.get("COMFY_PARALLEL_MODELS")
    os.environ["COMFY_PARALLEL_MODELS"] = str(root)
    yield root
    shutdown_backend()
    if old is None:
        del os.environ["COMFY_PARALLEL_MODELS"]
    else:
        os.environ["COMFY_PARALLEL_MODELS"] = old


@pytest.fixture(scope="module")
def loras_dir(tmp_path_factory):
    """An empty LoRA folder that the nodes see (COMFY_PARALLEL_LORAS) for one test module."""
    root = tmp_path_factory.mktemp("loras")
    old = os.environ.get("COMFY_PARALLEL_LORAS")
    os.environ["COMFY_PARALLEL_LORAS"] = str(root)
    yield root
    if old is None:
        del os.environ["COMFY_PARALLEL_LORAS"]
    else:
        os.environ["COMFY_PARALLEL_LORAS"] = old


# --- every family's tiny model in the module's model folder (the strategies' tests and those that reuse them) -------
@pytest.fixture(scope="module")
def models_dir(models_root):
    """``models_root`` with the tiny FLUX.1 under ``helpers.MODEL`` and each of ``helpers.NEW_FAMILIES`` under its
    ``model`` name."""
    from helpers import MODEL, NEW_FAMILIES

    from parallel_runtime.families.tiny import make_tiny_model

    make_tiny_model("flux", str(models_root / MODEL))
    for name, family in NEW_FAMILIES.items():
        make_tiny_model(name, str(models_root / family["model"]))
    return models_root


# --- each family's tiny model loaded in-process, once per module (test_images and test_samplers) ------------------
@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """name -> (adapter, model_dir, (text encoders, transformer, VAE)), each family built and loaded once."""
    import torch
    from img2img import CPU

    from parallel_runtime.families import family as family_adapter
    from parallel_runtime.families.tiny import make_tiny_model

    loaded = {}

    def get(name: str):
        if name not in loaded:
            adapter = family_adapter(name)
            model_dir = make_tiny_model(adapter.key, str(tmp_path_factory.mktemp(name)), 0)
            stages = (
                adapter.load_text_encoders(model_dir, torch.float32, CPU),
                adapter.load_transformer(model_dir, torch.float32, CPU),
                adapter.load_vae(model_dir, torch.float32, "cpu"),
            )
            loaded[name] = (adapter, model_dir, stages)
        return loaded[name]

    return get
