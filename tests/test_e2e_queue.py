"""The pack as a citizen of a real ComfyUI server (COMFYUI_DIR), driven headless over /prompt and the websocket:

- widget combinations that cannot work are refused by ``POST /prompt`` with a 400 whose node_errors name the node,
  the widget and the fix (VALIDATE_INPUTS), before anything runs;
- three prompts queued back to back all succeed and load the weights once; every node reports its stage as
  progress text, the sampler each step as ``progress``;
- Cancel (``POST /interrupt``) stops every rank at the same step, within one step of the cancel, and the next
  prompt runs on the same backend without loading anything;
- a rank killed mid-run fails its prompt with an error naming that rank, and a prompt queued right behind it
  succeeds on a fresh backend;
- a rank's exception (a truncated weights file) reaches ``execution_error`` naming the rank, with its traceback,
  and the backend stays up.

All on the session's server, a tiny FLUX.1, 2 CPU ranks, 64x64 (see comfyui_workflows).
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import uuid
from pathlib import Path

import pytest
from comfyui_host import PromptRejected
from comfyui_workflows import (
    BACKEND,
    DECODER,
    ENCODER,
    MODEL,
    SAMPLER,
    STEPS,
    TRANSFORMER,
    backend_run_dirs,
    backend_status,
    progress_texts,
    prompt_window,
    small_workflow,
    step_progress,
    tiny_flux,
    weight_loads,
    worker_pids,
)
from helpers import wait_for

pytestmark = pytest.mark.comfyui  # and multirank on the tests that start a backend

CANCELLED = re.compile(
    r"cancel asked at step (\d+), reached the ranks at step (\d+); the ranks stopped at steps \[([^\]]*)\]"
)
MANY_STEPS = 1000  # the widget's maximum: far more than the run lasts before it is cancelled or killed


@pytest.fixture(scope="module")
def tiny_model(comfyui_models_dir) -> Path:
    return tiny_flux(comfyui_models_dir)


@pytest.fixture(autouse=True)
def nothing_left_queued(comfyui_server):
    """A test that fails halfway may leave prompts queued or running: the next one starts from an idle server."""
    yield
    comfyui_server.request("POST", "/queue", {"clear": True})

    def idle() -> bool:  # interrupted again each time it still runs: a queued prompt may have started meanwhile
        if not comfyui_server.queue()["queue_running"]:
            return True
        comfyui_server.interrupt()
        return False

    wait_for(idle, 120, "the queue to be idle after the test", poll_s=0.5)


def context_parallel(workflow: dict) -> dict:
    """Ulysses over both ranks: every rank runs every denoising step (device_map runs them on rank 0 alone)."""
    workflow[TRANSFORMER]["inputs"].update(strategy="context_parallel", ulysses_degree=2, ring_degree=1)
    return workflow


def load_counts(server) -> dict[str, int]:
    """Weight loads per component:model on rank 0 since the backend started (it must be idle)."""
    status = backend_status(server)
    assert status["running"] and not status["busy"], status
    return status["ranks"][0]["load_counts"]


def wait_for_step(server, prompt_id: str, at_least: int = 1) -> dict:
    """The sampler's first ``progress`` message of ``prompt_id`` at step ``at_least`` or later."""
    return server.wait_for(
        lambda m: (
            m.get("type") == "progress"
            and m["data"].get("prompt_id") == prompt_id
            and m["data"].get("node") == SAMPLER
            and m["data"]["max"] == MANY_STEPS
            and m["data"]["value"] >= at_least
        ),
        timeout=240,
    )


# --- refused before anything runs ---------------------------------------------------------------------------------
def _ulysses_times_ring_is_not_ranks(w: dict) -> None:
    w[BACKEND]["inputs"].update(ranks=0, device="cpu")  # 0: the default, 2 ranks on CPU
    w[TRANSFORMER]["inputs"].update(strategy="context_parallel", ring_degree=1, ulysses_degree=3)


def _tp_degree_does_not_divide_heads(w: dict) -> None:
    w[BACKEND]["inputs"]["ranks"] = 3
    w[TRANSFORMER]["inputs"].update(strategy="tensor_parallel", tp_degree=3)  # the tiny model has 4 heads


def _width_off_the_16_grid(w: dict) -> None:
    w[SAMPLER]["inputs"]["width"] = 1000  # within the widget's min/max and step-free in the API


def _image_tokens_do_not_split_over_the_ranks(w: dict) -> None:
    context_parallel(w)
    w[SAMPLER]["inputs"].update(width=48, height=48)  # 3x3 tokens over 2 ranks, anything off


def _prompt_2_lines_do_not_match(w: dict) -> None:
    w[ENCODER]["inputs"].update(prompt="a fox\na lighthouse", prompt_2="one line", one_prompt_per_line=True)


def _fewer_images_than_data_parallel_ranks(w: dict) -> None:
    # The sampler counts the linked encoder's prompts: 3 prompts × 1 image on 4 ranks leaves one rank idle.
    w[BACKEND]["inputs"]["ranks"] = 4
    w[TRANSFORMER]["inputs"]["strategy"] = "data_parallel"
    w[ENCODER]["inputs"].update(prompt="a fox\na lighthouse\na bowl of ramen", one_prompt_per_line=True)


def _cuda_without_a_gpu(w: dict) -> None:
    w[BACKEND]["inputs"]["device"] = "cuda"


BAD_COMBINATIONS = {
    "ulysses_x_ring_is_not_ranks": (
        _ulysses_times_ring_is_not_ranks,
        TRANSFORMER,
        "LoadShardedTransformer",
        "ulysses_degree: ",
        "but the backend has 2 ranks; make the product 2",
    ),
    "tp_degree_does_not_divide_heads": (
        _tp_degree_does_not_divide_heads,
        TRANSFORMER,
        "LoadShardedTransformer",
        "tp_degree: ",
        "use a divisor of 4",
    ),
    "width_off_the_16_grid": (_width_off_the_16_grid, SAMPLER, "ParallelSampler", "width: ", "use 992 or 1008"),
    "cp_image_tokens_do_not_split": (
        _image_tokens_do_not_split_over_the_ranks,
        SAMPLER,
        "ParallelSampler",
        "width: ",
        "turn on anything (Ulysses/Ring-anything) on LoadShardedTransformer",
    ),
    "prompt_2_lines_do_not_match": (
        _prompt_2_lines_do_not_match,
        ENCODER,
        "EncodeOnBalancedGPUs",
        "prompt_2: ",
        "give prompt_2 one line per prompt",
    ),
    "fewer_images_than_data_parallel_ranks": (
        _fewer_images_than_data_parallel_ranks,
        SAMPLER,
        "ParallelSampler",
        "batch_size: ",
        "batch_size 1 × 3 prompts makes 3",
    ),
    "cuda_without_a_gpu": (_cuda_without_a_gpu, BACKEND, "ParallelBackend", "device: ", "choose auto or cpu"),
}


@pytest.mark.parametrize("case", BAD_COMBINATIONS)
def test_bad_widget_combination_is_refused_with_400_naming_the_node_and_the_fix(comfyui_server, tiny_model, case):
    """ComfyUI's own validation checks each widget's min/max only; VALIDATE_INPUTS checks the combinations (across
    linked nodes too) with the same rules the nodes apply when they run, and starts nothing."""
    from parallel_runtime.spec import cuda_device_count

    if case == "cuda_without_a_gpu" and cuda_device_count():
        pytest.skip("this machine has a GPU")
    change, node_id, class_type, widget, fix = BAD_COMBINATIONS[case]
    workflow = small_workflow(seed=0)
    change(workflow)
    backends_before = backend_run_dirs(comfyui_server)
    with pytest.raises(PromptRejected) as e:
        comfyui_server.post_prompt(workflow)
    assert e.value.status == 400 and e.value.error.get("type") == "prompt_outputs_failed_validation", e.value.body
    assert set(e.value.node_errors) == {node_id}, e.value.node_errors
    node = e.value.node_errors[node_id]
    assert node["class_type"] == class_type and e.value.error_types(node_id) == ["custom_validation_failed"], node
    details = node["errors"][0]["details"]
    assert widget in details and fix in details, details
    assert backend_run_dirs(comfyui_server) == backends_before, "validation started a backend"


# --- the queue ------------------------------------------------------------------------------------------------------
@pytest.mark.multirank
def test_three_prompts_back_to_back_succeed_loading_weights_once_and_report_progress(comfyui_server, tiny_model):
    server = comfyui_server
    text = f"a lighthouse at dusk, {uuid.uuid4().hex[:8]}"  # a prompt no earlier test encoded: the encoder runs
    workflows = [small_workflow(seed=seed, prefix="e2e_queue") for seed in (11, 12, 13)]
    for workflow in workflows:
        workflow[ENCODER]["inputs"]["prompt"] = text
    run_dirs_before = backend_run_dirs(server)
    loads_before = weight_loads(run_dirs_before[-1]) if run_dirs_before else []
    prompt_ids = [server.post_prompt(workflow) for workflow in workflows]  # queued before the first one ends
    runs = [server.follow(prompt_id, timeout=300) for prompt_id in prompt_ids]
    assert [run[-1]["type"] for run in runs] == ["execution_success"] * 3, [run[-1] for run in runs]

    images = [server.output_images(prompt_id) for prompt_id in prompt_ids]
    pngs = [server.view(**found[0]) for found in images]
    assert all(len(found) == 1 for found in images) and len(set(pngs)) == 3, images  # three seeds, three images

    run_dirs = backend_run_dirs(server)
    assert len(run_dirs) - len(run_dirs_before) <= 1 and run_dirs[: len(run_dirs_before)] == run_dirs_before
    loads = weight_loads(run_dirs[-1])[len(loads_before) if run_dirs == run_dirs_before else 0 :]
    assert loads and max(collections.Counter(loads).values()) == 1, loads  # each component at most once

    # The first run: each node says what it is doing, and the sampler reports every step in order.
    window = prompt_window(server, prompt_ids[0])
    assert progress_texts(window, ENCODER) == ["loading text encoders", "encoding", "encoded"], window
    # ... and, once it is done, where its conditioning came from (with whatever else the run has to say).
    sampler_texts = progress_texts(window, SAMPLER)
    assert sampler_texts[:3] == ["loading transformer", "denoising", "denoised"], window
    assert len(sampler_texts) == 4 and sampler_texts[3].startswith("positive: EncodeOnBalancedGPUs"), window
    assert progress_texts(window, DECODER) == ["loading VAE", "decoding", "decoded"], window
    steps = step_progress(window, SAMPLER, STEPS)
    if server.version and server.version.startswith("0.3."):
        assert steps == list(range(STEPS + 1)), steps  # 0: the transformer is loading
    else:  # newer ComfyUI throttles the bar: the first and the last update always go out
        assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == STEPS, steps
    # The later runs encode nothing: ComfyUI reuses the first run's conditioning.
    assert progress_texts(prompt_window(server, prompt_ids[2]), ENCODER) == []


@pytest.mark.multirank
def test_cancel_stops_every_rank_within_one_step_and_the_next_prompt_runs_on_the_same_backend(
    comfyui_server, tiny_model
):
    server = comfyui_server
    mark = server.log_mark()
    prompt_id = server.post_prompt(context_parallel(small_workflow(seed=21, steps=MANY_STEPS)))
    wait_for_step(server, prompt_id)
    server.interrupt()
    messages = server.follow(prompt_id, timeout=240)
    assert messages[-1]["type"] == "execution_interrupted", messages[-1]
    assert messages[-1]["data"]["node_id"] == SAMPLER, messages[-1]

    # Where the cancel landed (comfy.run logs it): every rank stopped at the same step, at most one step after
    # the one rank 0 had reached when the cancel arrived. The client asked at that step or earlier: its view lags
    # the ranks' by the socket (on a loaded machine the tiny model's steps outrun it).
    found = CANCELLED.findall(server.log_since(mark))
    assert len(found) == 1, server.log_since(mark)[-3000:]
    asked, reached, stopped = int(found[0][0]), int(found[0][1]), [int(s) for s in found[0][2].split(",")]
    assert len(stopped) == 2 and len(set(stopped)) == 1, stopped
    assert 1 <= asked <= reached <= stopped[0] <= reached + 1 < MANY_STEPS, (asked, reached, stopped)
    seen = step_progress(messages, SAMPLER, MANY_STEPS)
    assert seen and seen[-1] <= stopped[0], (seen[-5:], stopped)
    print(f"cancel asked at step {asked}, reached the ranks at {reached}; every rank stopped at step {stopped[0]}")

    pids, counts = worker_pids(server), load_counts(server)
    _, messages = server.run(context_parallel(small_workflow(seed=22)), timeout=240)
    assert worker_pids(server) == pids, "the backend was restarted after the cancel"
    reloaded = {key: n for key, n in load_counts(server).items() if n != counts.get(key, 0)}
    assert all(key.startswith("vae:") and key not in counts for key in reloaded), reloaded  # only a first VAE load


@pytest.mark.multirank
def test_a_killed_rank_fails_its_prompt_by_name_and_the_prompt_queued_behind_it_runs_on_a_fresh_backend(
    comfyui_server, tiny_model
):
    server = comfyui_server
    if not backend_status(server)["running"]:
        server.run(context_parallel(small_workflow(seed=30, steps=1)), timeout=240)
    old_pids = worker_pids(server)
    doomed = server.post_prompt(context_parallel(small_workflow(seed=31, steps=MANY_STEPS)))
    wait_for_step(server, doomed)
    os.kill(old_pids[1], signal.SIGKILL)
    behind = server.post_prompt(context_parallel(small_workflow(seed=32)))  # queued while the backend dies

    error = server.follow(doomed, timeout=240)[-1]
    assert error["type"] == "execution_error" and error["data"]["node_id"] == SAMPLER, error
    message = error["data"]["exception_message"]
    # "exited", or "closed the control connection" when rank 0 is gone before the client looks at the processes.
    assert message.startswith("the parallel backend failed: rank 1 ") and "next run starts a fresh one" in message, (
        message
    )
    assert "--- rank 1 ---" in message, message  # that rank's log tail

    assert server.follow(behind, timeout=300)[-1]["type"] == "execution_success"
    new_pids = worker_pids(server)
    assert len(new_pids) == 2 and not set(new_pids) & set(old_pids), (old_pids, new_pids)


@pytest.mark.multirank
def test_an_exception_on_a_rank_reaches_the_ui_with_its_traceback_and_the_backend_stays_up(comfyui_server, tiny_model):
    """A transformer whose weights file holds one tensor of another shape: every check before the load reads only
    the config and the headers and passes (a file cut short, the old bait, is now refused at validation); the load
    fails inside rank 0 on the backend; every rank survives it."""
    from safetensors.torch import load_file, save_file

    server = comfyui_server
    broken = f"{MODEL}-misshapen"
    broken_dir = tiny_model.parent / broken
    if not broken_dir.exists():
        shutil.copytree(tiny_model, broken_dir)
        (weights,) = (broken_dir / "transformer").glob("*.safetensors")
        tensors = load_file(weights)
        tensors["proj_out.weight"] = tensors["proj_out.weight"][:-1].clone()
        save_file(tensors, weights)
    workflow = small_workflow(seed=40, model=MODEL)
    workflow[TRANSFORMER]["inputs"]["model"] = broken
    if not backend_status(server)["running"]:
        server.run(small_workflow(seed=41, steps=1), timeout=240)
    pids = worker_pids(server)

    _, messages = server.run(workflow, timeout=240, expect="execution_error")
    error = messages[-1]["data"]
    assert error["node_id"] == SAMPLER and error["node_type"] == "ParallelSampler", error
    message = error["exception_message"]
    assert message.startswith("rank 0: "), message
    assert "--- rank 0 ---" in message and "Traceback (most recent call last)" in message, message
    assert "proj_out.weight" in message, message

    assert worker_pids(server) == pids, "an error every rank survived must not restart the backend"
    assert backend_status(server)["last_error"]["rank"] == 0
    server.run(small_workflow(seed=42, steps=1), timeout=240)
    assert worker_pids(server) == pids
