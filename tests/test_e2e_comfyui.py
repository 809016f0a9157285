"""The shipped example workflow on a real ComfyUI server (COMFYUI_DIR), headless over /prompt and the websocket.

A tiny random FLUX.1 goes into the server's ``diffusers`` model folder;
example_workflows/api/flux1_device_map_api.json runs with it on a 2-rank CPU backend, and the PNG that comes back
through /view equals diffusers' one-shot FluxPipeline after 8-bit quantisation. Also: the sampler's progress reaches
the websocket; a second run with a new seed loads no weights; an unknown model is refused with a 400; and when the
ComfyUI process dies, every rank of its backend exits on its own. (Progress text, Cancel, errors, the queue and widget
combinations refused with a 400: test_e2e_queue.py. Every example's UI file against /object_info, the template
browser, and the other examples' runs: test_examples_comfyui.py.)
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from comfyui_host import ComfyUIServer, PromptRejected
from comfyui_workflows import (
    DECODER,
    SAMPLER,
    SAVER,
    STEPS,
    assert_close_uint8,
    backend_processes,
    backend_run_dirs,
    load_api,
    reference_uint8,
    saved_png,
    small_workflow,
    tiny_flux,
    weight_loads,
)

pytestmark = pytest.mark.comfyui  # and multirank on the tests that start a backend


@pytest.fixture(scope="module")
def tiny_model(comfyui_models_dir) -> Path:
    return tiny_flux(comfyui_models_dir)


# ---------------------------------------------------------------------------------------------------------------
def test_pack_imported(comfyui_server):
    ours = [line for line in comfyui_server.import_failures() if comfyui_server.pack_name in line]
    assert ours == [], comfyui_server.log_tail(120)
    assert comfyui_server.pack_import_line() is not None, comfyui_server.log_tail(120)


def _refused_model(rejected: PromptRejected, node_id: str) -> bool:
    """The node's only error is its model: ComfyUI's value_not_in_list where ComfyUI checks V3 combos (0.7 and
    later), the pack's own check naming the widget where it does not (0.3.75)."""
    errors = rejected.node_errors[node_id]["errors"]
    if [e["type"] for e in errors] == ["value_not_in_list"]:
        return True
    return (
        [e["type"] for e in errors] == ["custom_validation_failed"]
        and "model: " in errors[0]["details"]
        and "pick one from the list" in errors[0]["details"]
    )


def test_shipped_workflow_validates_except_for_the_missing_model(comfyui_server, tiny_model):
    """As shipped, only the model placeholder is refused (400): every other value validates."""
    with pytest.raises(PromptRejected) as e:
        comfyui_server.post_prompt(load_api())
    assert e.value.status == 400
    model_nodes = {k for k, v in load_api().items() if "model" in v["inputs"]}
    assert set(e.value.node_errors) == model_nodes, e.value.node_errors
    for node_id in model_nodes:
        assert _refused_model(e.value, node_id), e.value.node_errors[node_id]


def test_unknown_model_is_refused_with_400(comfyui_server, tiny_model):
    with pytest.raises(PromptRejected) as e:
        comfyui_server.post_prompt(small_workflow(seed=0, model="no-such-model"))
    assert e.value.status == 400
    assert e.value.error.get("type") == "prompt_outputs_failed_validation", e.value.error
    for node_id, node in small_workflow(seed=0).items():
        if "model" in node["inputs"]:
            assert _refused_model(e.value, node_id), e.value.node_errors


@pytest.mark.multirank
def test_workflow_image_equals_one_shot_pipeline_and_a_new_seed_loads_nothing(comfyui_server, tiny_model):
    server = comfyui_server
    prompt = load_api()["2"]["inputs"]["prompt"]
    t0 = time.monotonic()
    prompt_id, messages = server.run(small_workflow(seed=7), timeout=240)
    first_run_s = time.monotonic() - t0
    assert_close_uint8(saved_png(server, prompt_id), reference_uint8(tiny_model, prompt, seed=7))

    # The sampler's steps reached the websocket, in order, between its "executing" and the decoder's. Newer
    # ComfyUI (0.26.0) throttles ProgressBar updates: the first and the final one always go out, some in between
    # may not; 0.3.75 sends every step.
    types = [(m["type"], (m.get("data") or {}).get("node")) for m in messages]
    start, end = types.index(("executing", SAMPLER)), types.index(("executing", DECODER))
    progress = [m["data"] for m in messages if m["type"] == "progress" and m["data"].get("node") == SAMPLER]
    steps = [p["value"] for p in progress if p["max"] == STEPS]
    assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] == STEPS, progress
    positions = [i for i, m in enumerate(messages) if m["type"] == "progress" and m["data"].get("node") == SAMPLER]
    assert all(start < i < end for i in positions), types

    # The client logs where its backend runs; rank 0 logs every weight load there.
    run_dirs = backend_run_dirs(server)
    assert run_dirs, "ComfyUI's log has no 'parallel backend up: ... (<run dir>)' line:\n" + server.log_tail(80)
    run_dir = run_dirs[-1]
    loads = weight_loads(run_dir)
    assert {load.split(":")[0] for load in loads} >= {"text_encoders", "transformer", "vae"}, loads

    # Same graph, new seed: ComfyUI reruns only the sampler, the decoder and SaveImage; no weights load again.
    t0 = time.monotonic()
    prompt_id, messages = server.run(small_workflow(seed=8), timeout=120)
    second_run_s = time.monotonic() - t0
    assert [m["data"]["node"] for m in messages if m["type"] == "executed"] == [SAVER]
    cached = [m["data"]["nodes"] for m in messages if m["type"] == "execution_cached"]
    assert cached and set(cached[0]) == {"1", "2", "3"}, cached
    assert backend_run_dirs(server) == run_dirs, "the backend was restarted"
    assert weight_loads(run_dir) == loads
    assert_close_uint8(saved_png(server, prompt_id), reference_uint8(tiny_model, prompt, seed=8))
    print(f"first run {first_run_s:.1f} s (backend start included), second run {second_run_s:.1f} s")


@pytest.mark.multirank
def test_backend_ranks_exit_when_comfyui_dies(comfyui_dir, comfyui_models_dir, tiny_model):
    """SIGKILL leaves ComfyUI no chance to run atexit: the ranks must notice on their own (they watch the
    client's pid), exit, and take the run directory and the shared-memory segments with them. Its own server:
    the session's is shared with other tests."""
    server = ComfyUIServer(comfyui_dir, diffusers_dir=comfyui_models_dir).start()
    try:
        server.run(small_workflow(seed=1, steps=1, prefix="e2e_kill"), timeout=180)
        comfy_pid = server.proc.pid
        (run_dir,) = backend_run_dirs(server)
        backend = backend_processes(comfy_pid)
        ranks = [p for p in backend if "parallel_runtime.worker.agent" not in p.cmdline()]
        assert len(backend) == 3 and len(ranks) == 2, [p.cmdline() for p in backend]  # torchrun's agent + 2 ranks
        assert glob.glob(f"/dev/shm/pd-{comfy_pid}-*"), "no arena segments while the backend runs"

        os.kill(comfy_pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
        t0 = time.monotonic()
        while (left := backend_processes(comfy_pid)) and time.monotonic() - t0 < 20:
            time.sleep(0.1)
        exit_s = time.monotonic() - t0
        assert left == [], f"still running 20 s after ComfyUI died: {[(p.pid, p.cmdline()) for p in left]}"
        while (glob.glob(f"/dev/shm/pd-{comfy_pid}-*") or os.path.exists(run_dir)) and time.monotonic() - t0 < 25:
            time.sleep(0.1)
        left_behind = glob.glob(f"/dev/shm/pd-{comfy_pid}-*") + ([run_dir] if os.path.exists(run_dir) else [])
        if left_behind:
            logs = {
                name: open(os.path.join(run_dir, name), errors="replace").read()
                for name in ("rank0.log", "rank1.log")
                if os.path.exists(os.path.join(run_dir, name))
            }
            noticed = [name for name, text in logs.items() if "client or launcher died" in text]
            for path in left_behind:  # report it, but leave no litter
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
            pytest.fail(
                f"left behind after every backend process exited: {left_behind}; ranks whose log says "
                f"they saw the client die: {noticed} (only rank 0 cleans up; if another rank exits first, "
                f"torchrun's agent SIGTERMs rank 0 before its own check runs)"
            )
        print(f"torchrun's agent and both ranks gone {exit_s:.1f} s after ComfyUI was killed")
    finally:
        server.stop()
