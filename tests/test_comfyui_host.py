"""The end-to-end host itself, against a real ComfyUI (COMFYUI_DIR): our pack imports, core prompts run
over /prompt + the websocket, images come back through /view, bad prompts get a 400 with node_errors,
runtime errors and interrupts arrive as websocket events. Only ComfyUI core nodes are used here (and, in a server of
its own, a test-only node that runs until interrupted), so these tests hold whatever state the pack's own nodes are in.
"""

import io
import os
import sys

import pytest
from comfyui_host import REPO_ROOT, ComfyUIError, ComfyUIServer, PromptRejected

pytestmark = pytest.mark.comfyui


def _solid_image_to_png(color: int, width: int = 64, height: int = 48, prefix: str = "e2e_host") -> dict:
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": width, "height": height, "batch_size": 1, "color": color},
        },
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": prefix}},
    }


def test_pack_imported(comfyui_server):
    ours = [line for line in comfyui_server.import_failures() if comfyui_server.pack_name in line]
    assert ours == [], comfyui_server.log_tail(120)
    line = comfyui_server.pack_import_line()
    assert line is not None and "IMPORT FAILED" not in line, comfyui_server.log_tail(120)
    # Only ours loads, and the tests' own loaders (comfyui_test_nodes): the tree's custom_nodes/ are not whitelisted.
    assert "Import times for custom nodes" in comfyui_server.log()


def test_object_info_lists_core_and_our_nodes(comfyui_server):
    info = comfyui_server.object_info()
    for core in ("EmptyImage", "SaveImage", "PreviewImage", "ImageBlur"):
        assert core in info
    assert info["SaveImage"]["output_node"] is True
    single = comfyui_server.object_info("EmptyImage")
    assert list(single) == ["EmptyImage"]

    # Every node class the pack exports is registered, under our module.
    sys.path.insert(0, str(REPO_ROOT))
    try:
        from parallel_nodes import NODES_BY_ID
    finally:
        sys.path.remove(str(REPO_ROOT))
    module = f"custom_nodes.{comfyui_server.pack_name}"
    ours = {name for name, entry in info.items() if entry.get("python_module") == module}
    assert ours == set(NODES_BY_ID), (ours, sorted(NODES_BY_ID))


def test_core_prompt_runs_and_image_comes_back(comfyui_server):
    from PIL import Image

    prompt_id, messages = comfyui_server.run(_solid_image_to_png(0xFF0000), timeout=60)
    types = [m["type"] for m in messages]
    assert types[0] == "execution_start" and types[-1] == "execution_success", types
    executed = [m["data"] for m in messages if m["type"] == "executed"]
    assert [e["node"] for e in executed] == ["2"]
    images = executed[0]["output"]["images"]
    assert len(images) == 1 and images[0]["type"] == "output"

    # history agrees with the websocket, and /view serves the file
    assert comfyui_server.output_images(prompt_id) == images
    assert comfyui_server.history(prompt_id)["status"]["status_str"] == "success"
    png = comfyui_server.view(**images[0])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    img = Image.open(io.BytesIO(png)).convert("RGB")
    assert img.size == (64, 48)
    assert img.getpixel((10, 10)) == (255, 0, 0)
    assert os.path.isfile(comfyui_server.output_dir / images[0]["subfolder"] / images[0]["filename"])


def test_invalid_prompts_get_400_with_node_errors(comfyui_server):
    bad = _solid_image_to_png(0)
    bad["1"]["inputs"]["width"] = 0
    with pytest.raises(PromptRejected) as e:
        comfyui_server.post_prompt(bad)
    assert e.value.status == 400
    assert e.value.error["type"] == "prompt_outputs_failed_validation"
    assert e.value.error_types("1") == ["value_smaller_than_min"]
    assert e.value.node_errors["1"]["class_type"] == "EmptyImage"

    missing = _solid_image_to_png(0)
    del missing["2"]["inputs"]["images"]
    with pytest.raises(PromptRejected) as e:
        comfyui_server.post_prompt(missing)
    assert e.value.error_types("2") == ["required_input_missing"]

    with pytest.raises(PromptRejected) as e:
        comfyui_server.post_prompt({"1": {"class_type": "NoSuchNodeClass", "inputs": {}}})
    # 0.3.75 says "invalid_prompt", 0.26.0 "missing_node_type"; both name the class and give no node_errors.
    assert e.value.error["type"] in ("invalid_prompt", "missing_node_type")
    assert "NoSuchNodeClass" in e.value.error["message"]
    assert e.value.node_errors == {}


def test_runtime_error_arrives_as_execution_error(comfyui_server):
    # SaveImage refuses to write outside the output folder: an exception while the node runs.
    prompt_id = comfyui_server.post_prompt(_solid_image_to_png(0, 8, 8, prefix="../outside"))
    messages = comfyui_server.follow(prompt_id, timeout=60)
    last = messages[-1]
    assert last["type"] == "execution_error"
    assert last["data"]["node_id"] == "2" and last["data"]["node_type"] == "SaveImage"
    assert "outside the output folder" in last["data"]["exception_message"]
    assert last["data"]["traceback"]


def test_interrupt_stops_the_running_prompt_and_the_server_goes_on(comfyui_dir):
    """A server of its own with a test-only pack (tests/comfyui_blocker) whose node runs until interrupted: the
    interrupt is sent once that node reports progress, so it lands while the node runs on a machine of any speed.
    ComfyUI raises its interruption in the node, the prompt ends interrupted before its output node, and the server
    runs the next prompt."""
    workflow = {
        "0": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0x336699}},
        "1": {"class_type": "WaitForInterrupt", "inputs": {"image": ["0", 0]}},
        "out": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
    }
    blocker = REPO_ROOT / "tests" / "comfyui_blocker"
    with ComfyUIServer(comfyui_dir, pack_dir=blocker, pack_name="comfyui_blocker") as server:
        start = len(server.messages())
        prompt_id = server.post_prompt(workflow)
        server.wait_for(
            lambda m: m["type"] == "progress" and m["data"].get("prompt_id") == prompt_id and m["data"]["node"] == "1",
            timeout=60,
            start=start,
        )
        server.interrupt(prompt_id)
        messages = server.follow(prompt_id, timeout=60)
        assert messages[-1]["type"] == "execution_interrupted", [m["type"] for m in messages]
        assert messages[-1]["data"]["node_id"] == "1"
        assert "out" not in messages[-1]["data"]["executed"]
        assert server.history(prompt_id, timeout=10)["status"]["status_str"] == "error"

        # The next prompt runs normally.
        server.run(_solid_image_to_png(0x00FF00), timeout=60)


def test_a_pack_that_fails_to_import_fails_the_start(comfyui_dir, tmp_path):
    # The guard every other end-to-end test relies on: ComfyUI logs "IMPORT FAILED" and serves anyway,
    # so the host must turn that into an error (with the log) instead of a server without our nodes.
    broken = tmp_path / "broken-pack"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('deliberately broken pack')\n")
    server = ComfyUIServer(comfyui_dir, pack_dir=broken, pack_name="broken-pack", keep_workdir=False)
    with pytest.raises(ComfyUIError, match="could not import broken-pack") as e:
        server.start()
    assert "deliberately broken pack" in str(e.value)
    assert server.proc is None  # stopped: nothing left running
