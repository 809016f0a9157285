"""The README's newcomer path: a ComfyUI user who installed the pack from requirements.txt (no ``comfy-parallel``
script) puts tiny stand-ins for everything the example workflows name into ComfyUI with ``python -m
parallel_runtime.examples``, run from the pack's folder as the README says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from comfyui_host import REPO_ROOT, ComfyUIServer
from PIL import Image

from parallel_runtime import model_folders
from parallel_runtime.examples import IMAGE_PLACEHOLDER, LORA_PLACEHOLDERS, PLACEHOLDERS, SHIPPED_INPUTS, make_stand_ins

COMMAND = [sys.executable, "-m", "parallel_runtime.examples"]


def named_by_the_examples() -> set[str]:
    """Every model, LoRA and picture name a shipped UI workflow's widgets ask for, of the kinds the stand-ins cover."""
    known = {*PLACEHOLDERS, *LORA_PLACEHOLDERS, IMAGE_PLACEHOLDER, *os.listdir(SHIPPED_INPUTS)}
    names = set()
    for path in (REPO_ROOT / "example_workflows").glob("*.json"):
        for node in json.loads(path.read_text())["nodes"]:
            names |= {v for v in node.get("widgets_values") or [] if isinstance(v, str) and v in known}
    return names


def run(comfyui, *args: str) -> subprocess.CompletedProcess:
    # As a ComfyUI user runs it: from the pack's folder, nothing of the pack on PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([*COMMAND, str(comfyui), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def test_the_examples_stand_ins_go_where_comfyui_finds_them(tmp_path, monkeypatch):
    comfyui = tmp_path / "ComfyUI"
    (comfyui / "models" / "loras").mkdir(parents=True)
    (comfyui / "main.py").write_text("")
    first = run(comfyui)
    assert first.returncode == 0, first.stderr[-3000:]
    made = {
        os.path.basename(line.split(": ", 1)[1])
        for line in first.stdout.splitlines()
        if line.startswith(("made: ", "copied: "))
    }
    assert made >= named_by_the_examples() and named_by_the_examples() >= {"FLUX.1-dev", IMAGE_PLACEHOLDER}, made
    # The edit examples' picture is the one shipped in example_workflows/input/.
    for name in os.listdir(SHIPPED_INPUTS):
        assert (comfyui / "input" / name).read_bytes() == (
            REPO_ROOT / "example_workflows" / "input" / name
        ).read_bytes()
    # ComfyUI lists the models by folder name (models/diffusers), the LoRA by file name (models/loras).
    monkeypatch.setenv("COMFY_PARALLEL_MODELS", str(comfyui / "models" / "diffusers"))
    assert set(PLACEHOLDERS) <= set(model_folders.list_models())
    assert all((comfyui / "models" / "loras" / lora).is_file() for lora in LORA_PLACEHOLDERS)
    assert Image.open(comfyui / "input" / IMAGE_PLACEHOLDER).size == (512, 512)
    # A second run (or a real model already there) keeps what is there.
    second = run(comfyui)
    assert second.returncode == 0 and "made: " not in second.stdout and "copied: " not in second.stdout
    assert second.stdout.count("kept: ") == len(made)


def test_a_folder_that_is_not_comfyui_is_refused(tmp_path):
    proc = run(tmp_path)
    assert proc.returncode == 2 and "is not a ComfyUI folder" in proc.stderr and not os.listdir(tmp_path)


def test_the_readme_names_every_node(nodes):
    """The README's opening said "Four nodes" while eight appear in ComfyUI."""
    opening = (REPO_ROOT / "README.md").read_text().split("\n## ", 1)[0]
    words = {4: "Four", 5: "Five", 6: "Six", 7: "Seven", 8: "Eight", 9: "Nine", 10: "Ten"}
    assert f"{words[len(nodes)]} nodes" in opening
    for node_id, node in nodes.items():
        schema = node.define_schema()
        assert node_id in opening or schema.display_name in opening, node_id


@pytest.mark.slow  # test_examples_comfyui runs every example on the same builders' models, under names of its own
@pytest.mark.comfyui
@pytest.mark.multirank
def test_the_lora_and_img2img_examples_run_on_the_stand_ins_under_their_shipped_names(comfyui_dir, tmp_path):
    """Only what a CPU machine needs changes (2 CPU ranks, 2 steps, 64x64, short prompts): the model, LoRA and
    picture names stay as shipped."""
    models, loras = tmp_path / "diffusers", tmp_path / "loras"
    server = ComfyUIServer(comfyui_dir, diffusers_dir=models, loras_dir=loras)
    make_stand_ins(str(models), str(loras), str(server.input_dir), {"FLUX.1-dev", "Qwen-Image"}, picture_size=128)
    server.start()
    try:
        for name, tokens in (("flux1_lora_context_parallel", 32), ("qwenimage_img2img", 64)):
            workflow = json.loads((REPO_ROOT / "example_workflows" / "api" / f"{name}_api.json").read_text())
            changes = {
                "ParallelBackend": {"ranks": 2, "device": "cpu"},
                "EncodeOnBalancedGPUs": {"max_sequence_length": tokens},
                "ParallelSampler": {"steps": 2, "width": 64, "height": 64},
            }
            for node in workflow.values():
                node["inputs"].update(changes.get(node["class_type"], {}))
            server.run(workflow, timeout=600)
            assert list(server.output_dir.glob(f"parallel_{name}_*.png")), name
    finally:
        server.stop()
