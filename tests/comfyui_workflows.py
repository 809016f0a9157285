"""What the end-to-end tests share on top of comfyui_host: the shipped API workflow made small (a tiny random
FLUX.1, 64x64, a few steps, 2 CPU ranks), and what the backend behind a ComfyUI server tells about itself (its
run directories and weight loads from the logs, its ranks from the status route, its processes)."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import numpy as np
from comfyui_host import REPO_ROOT, ComfyUIServer, PromptRejected

API_WORKFLOW = REPO_ROOT / "example_workflows" / "api" / "flux1_device_map_api.json"
MODEL = "tiny-flux-e2e"
SIZE, STEPS, GUIDANCE = 64, 3, 3.5
# Node ids in the shipped workflow.
BACKEND, ENCODER, TRANSFORMER, SAMPLER, DECODER, SAVER = "1", "2", "3", "4", "5", "6"
LOADED = re.compile(r": loaded (\S+) ")  # parallel_runtime.worker.models: "loaded transformer:<model> (...) in 0.2 s"
BACKEND_UP = re.compile(r"parallel backend up: \d+ ranks on \w+ in [\d.]+ s \((?P<run_dir>[^)]+)\)")


def tiny_flux(models_dir: str | os.PathLike) -> Path:
    """The tiny FLUX.1 in the server's diffusers folder, built once per session."""
    from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux

    path = Path(models_dir) / MODEL
    if not (path / "model_index.json").is_file():
        make_tiny_flux(str(path))
    return path


def load_api() -> dict:
    return json.loads(API_WORKFLOW.read_text())


def small_workflow(seed: int, *, model: str = MODEL, steps: int = STEPS, prefix: str = "e2e_flux") -> dict:
    """The shipped API workflow with the tiny model, small sizes and 2 CPU ranks."""
    workflow = load_api()
    for node in workflow.values():
        if "model" in node["inputs"]:
            node["inputs"]["model"] = model
    workflow[BACKEND]["inputs"].update(ranks=2, device="cpu", memory_policy="staged")
    workflow[SAMPLER]["inputs"].update(
        seed=seed, steps=steps, guidance_scale=GUIDANCE, width=SIZE, height=SIZE, batch_size=1
    )
    workflow[SAVER]["inputs"]["filename_prefix"] = prefix
    return workflow


def references_workflow(model: str, linked: dict[str, str], *, prompt: str, tokens: int, sampler: dict) -> dict:
    """``model`` under Ulysses over 2 CPU ranks, a LoadImage of each file in ComfyUI's input/ linked into the
    sampler's input it is keyed by (``image``, ``image_2``, ...), ``sampler``'s widgets (seed, steps, guidance_scale,
    width, height), decoded and saved: an edit or reference model from LoadImage to SaveImage."""

    def link(node: str) -> list:
        return [node, 0]

    nodes = {
        "1": ("ParallelBackend", {"ranks": 2, "device": "cpu", "memory_policy": "staged"}),
        "2": ("EncodeOnBalancedGPUs", {"model": model, "prompt": prompt, "max_sequence_length": tokens}),
        "3": (
            "LoadShardedTransformer",
            {"model": model, "strategy": "context_parallel", "ring_degree": 1, "ulysses_degree": 2},
        ),
        "4": ("ParallelSampler", {**sampler, "batch_size": 1}),
        "5": ("VAEDecodeSingleGPU", {"model": model, "device": "cpu"}),
        "6": ("SaveImage", {"filename_prefix": model}),
    }
    nodes["2"][1]["backend"] = nodes["3"][1]["backend"] = nodes["5"][1]["backend"] = link("1")
    nodes["4"][1].update(transformer=link("3"), positive=link("2"))
    nodes["5"][1]["samples"] = link("4")
    nodes["6"][1]["images"] = link("5")
    for i, (name, file) in enumerate(linked.items()):
        nodes[str(7 + i)] = ("LoadImage", {"image": file})
        nodes["4"][1][name] = link(str(7 + i))
    return {node_id: {"class_type": kind, "inputs": inputs} for node_id, (kind, inputs) in nodes.items()}


def refusal(server: ComfyUIServer, workflow: dict, node: str) -> str:
    """The details of the one error ``POST /prompt`` answers (a 400) for ``workflow``, on ``node`` alone."""
    try:
        server.post_prompt(workflow)
    except PromptRejected as rejected:
        assert rejected.status == 400 and list(rejected.node_errors) == [node], rejected.body
        (error,) = rejected.node_errors[node]["errors"]
        return error["details"]
    raise AssertionError("the prompt was queued")


def backend_run_dirs(server: ComfyUIServer) -> list[str]:
    """Run directories of the backends this server started, from the client's INFO line in ComfyUI's log."""
    return [m.group("run_dir") for m in BACKEND_UP.finditer(server.log())]


def weight_loads(run_dir: str) -> list[str]:
    """The "loaded <component>:<model>" lines of rank 0's log: one per weight load."""
    with open(os.path.join(run_dir, "rank0.log"), errors="replace") as f:
        return [m.group(1) for line in f if (m := LOADED.search(line))]


def backend_status(server: ComfyUIServer) -> dict:
    """``GET /parallel_diffusers/status``: running, busy, and per rank its pid and load counts (when idle)."""
    return server.get_json("/parallel_diffusers/status", timeout=60)


def worker_pids(server: ComfyUIServer) -> list[int]:
    return [rank["pid"] for rank in backend_status(server).get("ranks", [])]


def backend_processes(client_pid: int) -> list:
    """Live processes of the backends a client started: torchrun's agent and the ranks (they carry its pid)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if (
                p.info["status"] != psutil.STATUS_ZOMBIE
                and "parallel_runtime.worker" in " ".join(p.info["cmdline"] or [])
                and p.environ().get("COMFY_PARALLEL_CLIENT_PID") == str(client_pid)
            ):
                found.append(p)
        except psutil.Error:
            pass
    return found


def prompt_window(server: ComfyUIServer, prompt_id: str) -> list[dict]:
    """Every recorded websocket message from the prompt's ``execution_start`` to its terminal message, including
    the nodes' progress texts, which carry no prompt id (prompts run one at a time, so the window is this one's)."""
    messages = server.messages()

    def at(kinds: tuple[str, ...]) -> int:
        return next(
            i
            for i, m in enumerate(messages)
            if m.get("type") in kinds and (m.get("data") or {}).get("prompt_id") == prompt_id
        )

    return messages[
        at(("execution_start",)) : at(("execution_success", "execution_error", "execution_interrupted")) + 1
    ]


def progress_texts(window: list[dict], node_id: str) -> list[str]:
    return [m["data"]["text"] for m in window if m["type"] == "progress_text" and m["data"]["node"] == node_id]


def step_progress(window: list[dict], node_id: str, steps: int) -> list[int]:
    """The values of a node's ``progress`` messages on the scale of ``steps``."""
    return [
        m["data"]["value"]
        for m in window
        if m["type"] == "progress" and m["data"].get("node") == node_id and m["data"]["max"] == steps
    ]


def saved_png(server: ComfyUIServer, prompt_id: str) -> np.ndarray:
    from PIL import Image

    images = server.output_images(prompt_id)
    assert len(images) == 1, images
    png = server.view(**images[0])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def assert_close_uint8(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape == (SIZE, SIZE, 3)
    diff = np.abs(got.astype(np.int16) - expected.astype(np.int16))
    assert diff.max() <= 1, f"max |diff| {diff.max()} levels; {(diff > 1).sum()} values differ by more than 1"


def reference_uint8(model_dir: Path, prompt: str, seed: int) -> np.ndarray:
    """diffusers' one-shot pipeline, in float32 as the CPU backend runs it (a folder converted from ComfyUI's files
    keeps its text encoders in fp16, as those files are), quantised the way ComfyUI's SaveImage does:
    ``uint8(clip(255 * x))``."""
    import torch
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(model_dir, dtype=torch.float32)
    image = pipe(
        prompt,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        width=SIZE,
        height=SIZE,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="pt",
    ).images[0]
    return np.clip(255.0 * image.permute(1, 2, 0).numpy(), 0, 255).astype(np.uint8)
