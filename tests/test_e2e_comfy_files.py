"""ComfyUI's own files in a real ComfyUI server (COMFYUI_DIR): a tiny FLUX.1 in ``diffusion_models``,
``text_encoders`` and ``vae`` (ComfyUI's layouts, scaled-fp8 transformer), assembled by ParallelModelFromComfyFiles and
linked into the other nodes' ``model`` input, run headless over /prompt with tensor parallelism on 2 CPU ranks; the
PNG equals diffusers' one-shot pipeline on the same model's diffusers folder. A refused file is a 400 naming the node
and the input, before anything runs.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from comfyui_host import PromptRejected
from comfyui_workflows import assert_close_uint8, reference_uint8, saved_png

pytestmark = pytest.mark.comfyui
PROMPT = "a photo of a horse in the city"


@pytest.fixture(scope="module")
def files(tiny_comfy_files):
    return tiny_comfy_files["fp8_scaled"]


def workflow(names: dict, seed: int, encode: dict | None = None, sample: dict | None = None) -> dict:
    """ParallelModelFromComfyFiles into the other nodes, tensor parallel on 2 ranks; ``encode`` and ``sample`` add to
    (or replace) the encoder's and the sampler's inputs."""
    from comfyui_workflows import GUIDANCE, SIZE, STEPS

    files = ["1", 0]
    return {
        "1": {"class_type": "ParallelModelFromComfyFiles", "inputs": dict(names)},
        "2": {"class_type": "EncodeOnBalancedGPUs", "inputs": {"model": files, "prompt": PROMPT, **(encode or {})}},
        "3": {
            "class_type": "LoadShardedTransformer",
            "inputs": {"model": files, "strategy": "tensor_parallel", "tp_degree": 2},
        },
        "4": {
            "class_type": "ParallelSampler",
            "inputs": {
                "transformer": ["3", 0],
                "positive": ["2", 0],
                "seed": seed,
                "steps": STEPS,
                "guidance_scale": GUIDANCE,
                "width": SIZE,
                "height": SIZE,
                "batch_size": 1,
                **(sample or {}),
            },
        },
        "5": {"class_type": "VAEDecodeSingleGPU", "inputs": {"samples": ["4", 0], "model": files, "device": "auto"}},
        "6": {"class_type": "SaveImage", "inputs": {"images": ["5", 0], "filename_prefix": "e2e_comfy_files"}},
    }


def test_listed_in_the_nodes_combos(comfyui_server, files):
    names, _ = files
    inputs = comfyui_server.object_info("ParallelModelFromComfyFiles")["ParallelModelFromComfyFiles"]["input"]
    for widget, value in names.items():
        assert value in inputs["required"][widget][1]["options"], widget


def test_a_refused_file_is_a_400_naming_the_input(comfyui_server, files, comfyui_files_dir):
    names, _ = files
    (comfyui_files_dir / "diffusion_models" / "flux1-dev-Q8_0.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(PromptRejected) as e:
        comfyui_server.post_prompt(workflow({**names, "diffusion_model": "flux1-dev-Q8_0.gguf"}, seed=1))
    assert e.value.status == 400
    assert set(e.value.node_errors) == {"1"}, e.value.node_errors
    details = e.value.node_errors["1"]["errors"][0]["details"]
    assert "diffusion_model: " in details and "GGUF" in details, details
    # Hostile safetensors headers (test_comfy_files has every kind): refused by name, never a raw exception.
    from test_comfy_files import HOSTILE_HEADERS, _raw

    for label in ("string-shape", "deep-nesting", "overlapping"):
        header, data, message = HOSTILE_HEADERS[label]
        _raw(comfyui_files_dir / "diffusion_models" / f"e2e-{label}.safetensors", header, data)
        with pytest.raises(PromptRejected) as e:
            comfyui_server.post_prompt(workflow({**names, "diffusion_model": f"e2e-{label}.safetensors"}, seed=1))
        assert e.value.status == 400 and set(e.value.node_errors) == {"1"}, e.value.node_errors
        details = e.value.node_errors["1"]["errors"][0]["details"]
        assert f"diffusion_model: 'e2e-{label}.safetensors' is not a readable safetensors file" in details, details
        assert re.search(message, details), (label, details)


def test_a_clip_vision_file_only_where_it_belongs(comfyui_server, files, comfyui_files_dir, tmp_path_factory):
    """Wan 2.1 I2V's files without their CLIP vision file, and FLUX.1's with one: a 400 naming clip_vision and the
    fix, before anything converts."""
    from parallel_runtime.families.wan.comfy_tiny import make_tiny_wan_files

    names, _ = files
    reference = tmp_path_factory.mktemp("reference-wan21-i2v")
    wan, _ = make_tiny_wan_files(str(comfyui_files_dir), str(reference), formats=("bf16",), i2v=True)["bf16"]
    options = comfyui_server.object_info("ParallelModelFromComfyFiles")["ParallelModelFromComfyFiles"]["input"]
    assert options["optional"]["clip_vision"][1]["options"] == ["none", wan["clip_vision"]]
    for picked, fix in (
        ({**wan, "clip_vision": "none"}, "pick clip_vision_h.safetensors"),
        ({**names, "clip_vision": wan["clip_vision"]}, "set clip_vision to none"),
    ):
        with pytest.raises(PromptRejected) as e:
            comfyui_server.post_prompt(workflow(picked, seed=1))
        assert e.value.status == 400 and set(e.value.node_errors) == {"1"}, e.value.node_errors
        details = e.value.node_errors["1"]["errors"][0]["details"]
        assert "clip_vision: " in details and fix in details, details
    converted = comfyui_files_dir / "converted"
    assert not any(name.startswith("tiny_wan2.1_i2v") for name in (os.listdir(converted) if converted.is_dir() else []))


@pytest.mark.multirank
def test_comfyui_files_through_the_nodes_equal_the_diffusers_folder(comfyui_server, files, comfyui_files_dir):
    names, reference = files
    prompt_id, _ = comfyui_server.run(workflow(names, seed=5), timeout=600)
    assert_close_uint8(saved_png(comfyui_server, prompt_id), reference_uint8(reference, PROMPT, seed=5))
    # The session's other families' files (test_comfyui_conditioning) are converted beside it.
    converted = [name for name in os.listdir(comfyui_files_dir / "converted") if name.startswith("tiny-flux1-dev-")]
    assert len(converted) == 1 and converted[0].startswith("tiny-flux1-dev-fp8_scaled-"), converted


@pytest.mark.slow  # CI's budget: test_comfy_files runs the same conversion on real ranks
@pytest.mark.multirank
def test_qwenimage_files_through_the_nodes_equal_the_diffusers_folder(comfyui_server, tiny_qwen_comfy_files):
    """Qwen-Image's files (scaled-fp8 transformer, text_encoder_2 left at none) through the nodes with true CFG: the
    PNG equals the one-shot QwenImagePipeline on the same model's diffusers folder."""
    from comfyui_workflows import SIZE
    from helpers import NEW_FAMILIES, STEPS, family_reference

    names, reference = tiny_qwen_comfy_files["fp8_scaled"]
    qwen = NEW_FAMILIES["qwenimage"]
    options = comfyui_server.object_info("ParallelModelFromComfyFiles")["ParallelModelFromComfyFiles"]["input"]
    assert options["required"]["text_encoder_2"][1]["options"][0] == "none"
    graph = workflow(
        names,
        seed=5,
        encode={"max_sequence_length": qwen["max_sequence_length"], **qwen["encode"]},
        sample={"steps": STEPS, **qwen["sample"]},
    )
    prompt_id, _ = comfyui_server.run(graph, timeout=600)
    expected = family_reference(reference, "qwenimage", 5, width=SIZE, height=SIZE)[0]
    assert_close_uint8(saved_png(comfyui_server, prompt_id), np.clip(255.0 * expected.numpy(), 0, 255).astype(np.uint8))
