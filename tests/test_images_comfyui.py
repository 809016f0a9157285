"""ComfyUI's own latent nodes between ParallelSamplers, in a real ComfyUI server (2 CPU ranks, tiny FLUX.1, context
parallel): EmptySD3LatentImage at denoise 1 gives the text-to-image latent; LatentUpscale, LatentCrop, LatentComposite
and SetLatentNoiseMask (a MASK from SolidMask and MaskComposite) feed an inpainting pass that keeps the unmasked half
of its latent as it came in. Latents are compared as ComfyUI's SaveLatent writes them. Bad input: a 400 naming denoise
and the latent's size where the graph says it (before the first pass runs) at validation, an SD latent refused by name
when it arrives."""

from __future__ import annotations

import pytest
import torch
from comfyui_host import ExecutionFailed, PromptRejected
from comfyui_workflows import tiny_flux
from safetensors.torch import load_file

pytestmark = [pytest.mark.comfyui, pytest.mark.multirank]

WIDTH, HEIGHT, SEED, STEPS = 96, 64, 3, 2


def link(node: str, slot: int = 0) -> list:
    return [node, slot]


def workflow(model: str) -> dict:
    """Text-to-image (4), the same from EmptySD3LatentImage (6), and an inpainting pass (14) over a latent made by
    ComfyUI's latent nodes from the first; each saved with SaveLatent."""
    sampler = {
        **{"transformer": link("3"), "positive": link("2"), "seed": SEED, "steps": STEPS, "guidance_scale": 3.5},
        **{"width": WIDTH, "height": HEIGHT, "batch_size": 1},
    }
    nodes = {
        "1": ("ParallelBackend", {"ranks": 2, "device": "cpu", "memory_policy": "resident"}),
        "2": (
            "EncodeOnBalancedGPUs",
            {"model": model, "prompt": "a cat", "max_sequence_length": 16, "backend": link("1")},
        ),
        "3": (
            "LoadShardedTransformer",
            {
                "model": model,
                "strategy": "context_parallel",
                "ring_degree": 1,
                "ulysses_degree": 2,
                "backend": link("1"),
            },
        ),
        "4": ("ParallelSampler", sampler),
        "5": ("EmptySD3LatentImage", {"width": WIDTH, "height": HEIGHT, "batch_size": 1}),
        "6": ("ParallelSampler", {**sampler, "latent_image": link("5"), "denoise": 1.0}),
        "7": (
            "LatentUpscale",
            {"samples": link("4"), "upscale_method": "bilinear", "width": 128, "height": 128, "crop": "disabled"},
        ),
        "8": ("LatentCrop", {"samples": link("7"), "width": 64, "height": 64, "x": 32, "y": 32}),
        "9": ("LatentComposite", {"samples_to": link("4"), "samples_from": link("8"), "x": 32, "y": 0, "feather": 0}),
        "10": ("SolidMask", {"value": 0.0, "width": WIDTH, "height": HEIGHT}),
        "11": ("SolidMask", {"value": 1.0, "width": WIDTH // 2, "height": HEIGHT}),
        "12": (
            "MaskComposite",
            {"destination": link("10"), "source": link("11"), "x": WIDTH // 2, "y": 0, "operation": "add"},
        ),
        "13": ("SetLatentNoiseMask", {"samples": link("9"), "mask": link("12")}),
        "14": ("ParallelSampler", {**sampler, "latent_image": link("13"), "denoise": 0.5}),
    }
    for source, name in (("4", "t2i"), ("6", "empty"), ("9", "composite"), ("14", "inpainted")):
        nodes[f"2{source}"] = ("SaveLatent", {"samples": link(source), "filename_prefix": f"latents/images_{name}"})
    return {node_id: {"class_type": kind, "inputs": inputs} for node_id, (kind, inputs) in nodes.items()}


def saved_latent(server, name: str) -> torch.Tensor:
    (path,) = (server.output_dir / "latents").glob(f"images_{name}_*.latent")
    return load_file(str(path))["latent_tensor"]


def test_comfyuis_latent_nodes_feed_the_sampler(comfyui_server, comfyui_models_dir):
    model = tiny_flux(comfyui_models_dir).name
    comfyui_server.run(workflow(model), timeout=600)
    t2i, empty = saved_latent(comfyui_server, "t2i"), saved_latent(comfyui_server, "empty")
    assert t2i.shape == (1, 16, HEIGHT // 8, WIDTH // 8)
    assert (empty - t2i).abs().max().item() <= 1e-5  # EmptySD3LatentImage at denoise 1 is text-to-image
    composite, inpainted = saved_latent(comfyui_server, "composite"), saved_latent(comfyui_server, "inpainted")
    assert inpainted.shape == composite.shape == t2i.shape
    half = WIDTH // 16  # latent columns under the mask's 0 half
    assert (inpainted[..., :half] - composite[..., :half]).abs().max().item() <= 1e-5
    assert (inpainted[..., half:] - composite[..., half:]).abs().max().item() > 1e-2

    # An SD latent (4 channels) is only known when it arrives: refused by name before any step runs.
    graph = {k: v for k, v in workflow(model).items() if k in {"1", "2", "3", "4", "24"}}
    graph["4"]["inputs"]["latent_image"] = link("5")
    graph["5"] = {"class_type": "EmptyLatentImage", "inputs": {"width": WIDTH, "height": HEIGHT, "batch_size": 1}}
    with pytest.raises(ExecutionFailed) as failed:
        comfyui_server.run(graph, timeout=300)
    message = failed.value.terminal["data"]["exception_message"]
    assert "latent_image: a LATENT of shape [1, 4, 8, 12] does not fit" in message, message


def test_bad_image_input_in_the_host(comfyui_server, comfyui_models_dir):
    model = tiny_flux(comfyui_models_dir).name
    graph = {k: v for k, v in workflow(model).items() if k in {"1", "2", "3", "4", "24"}}
    graph["4"]["inputs"]["denoise"] = 0.5
    with pytest.raises(PromptRejected) as rejected:
        comfyui_server.post_prompt(graph)
    assert rejected.value.status == 400 and list(rejected.value.node_errors) == ["4"]
    (error,) = rejected.value.node_errors["4"]["errors"]
    assert "denoise: 0.5 keeps part of an image, but no latent_image is linked" in error["details"], error

    # Where the graph says a latent's size (a sampler's, upscaled), the second pass is checked before the first runs.
    graph["4"]["inputs"].update(denoise=1.0, width=64, height=64)  # 8 × 8 latent pixels
    graph["5"] = {"class_type": "LatentUpscaleBy", "inputs": {"samples": link("4"), "upscale_method": "bilinear"}}
    graph["6"] = {**graph["4"], "inputs": {**graph["4"]["inputs"], "latent_image": link("5"), "denoise": 0.5}}
    # the only output: ComfyUI runs the outputs that pass and answers 200 when any does
    del graph["24"]
    graph["26"] = {"class_type": "SaveLatent", "inputs": {"samples": link("6"), "filename_prefix": "latents/bad"}}
    for scale, hint in (
        (1.125, "latent_image: its width of 9 latent pixels (72 pixels) is not a whole number"),
        (1.25, "latent_image: 80×80 makes 25 image tokens, which do not split over 2 ranks; turn on anything"),
    ):
        graph["5"]["inputs"]["scale_by"] = scale
        with pytest.raises(PromptRejected) as rejected:
            comfyui_server.post_prompt(graph)
        assert list(rejected.value.node_errors) == ["6"], rejected.value.node_errors
        (error,) = rejected.value.node_errors["6"]["errors"]
        assert hint in error["details"], error
