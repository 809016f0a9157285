"""ComfyUI's own nodes around the pack's sampler, in a real ComfyUI server (2 CPU ranks, Ulysses 2): ComfyUI's text
encoders (DualCLIPLoader's code, on the tiny FLUX.1 files in ComfyUI's layouts) → CLIPTextEncode → FluxGuidance →
ParallelSampler gives the image of the pack's own encoder on the same weights; ComfyUI's VAEDecode (ComfyUI's VAE of
the family's file) of the pack's LATENT gives VAEDecodeSingleGPU's image; EmptySD3LatentImage → the sampler at denoise
1 gives the text-to-image latent; ComfyUI's VAEEncode gives VAEEncodeSingleGPU's latent, and the sampler's img2img
from it the same. A CONDITIONING from another family's text-encoder loader is a 400 naming positive.

Qwen-Image the same way, true CFG split over the 2 ranks (cfg_parallel): ComfyUI's Qwen2.5-VL text encode
(CLIPLoader's model on the tiny file) → CLIPTextEncode for positive, TextEncodeQwenImageEdit without an image for
negative → ParallelSampler gives the image of EncodeOnBalancedGPUs with the same negative prompt; ComfyUI's own
VAELoader loads the tiny Wan 2.1 VAE file (it reads the width from the file) and its VAEDecode / VAEEncode meet
VAEDecodeSingleGPU / VAEEncodeSingleGPU; EmptySD3LatentImage and the VAEEncode latent feed the sampler.

ComfyUI's DualCLIPLoader / VAELoader build full-size models from fixed configs, so the test-only nodes
(tests/comfyui_test_nodes) run the same ComfyUI code with the tiny models' configs: see their docstring.

Tolerances, and why: the latents of ComfyUI's text encode and the pack's agree to 1e-4 (measured 1e-6: the same
float32 arithmetic in two implementations of CLIP and T5 — ComfyUI's attention and GELU against transformers' — differs
in the last bits, which the transformer carries through its steps), the PNGs to one 8-bit level; ComfyUI's VAEEncode
and VAEEncodeSingleGPU to 1e-4 (measured 5e-6), ComfyUI's VAEDecode and VAEDecodeSingleGPU to one level (measured 0):
the same VAE in ComfyUI's and diffusers' implementations, float32. Qwen-Image's: the text encodes' latents to 1e-4
(measured 4e-6; 1e-6 on the embeddings: ComfyUI's Llama code against transformers' Qwen2.5-VL, float32, which keep the
same tokens after the chat template's prefix), the PNGs to one level; ComfyUI's Wan VAE against diffusers'
AutoencoderKLQwenImage to 1e-4 on latents (measured 1e-7) and one level on images (measured 0), float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from comfyui_host import PromptRejected
from safetensors.torch import load_file

pytestmark = [pytest.mark.comfyui, pytest.mark.multirank]
PROMPT = "a photo of a horse in the city"
SIZE, SEED, STEPS, GUIDANCE = 64, 7, 2, 3.5
# ComfyUI pads FLUX's T5 tokens to at least 256 (its T5XXLTokenizer's min_length); the pack's encoder pads to this.
T5_TOKENS = 256


def link(node: str, slot: int = 0) -> list:
    return [node, slot]


def api(nodes: dict) -> dict:
    return {node_id: {"class_type": kind, "inputs": inputs} for node_id, (kind, inputs) in nodes.items()}


def workflow(names: dict, reference: str) -> dict:
    files = link("1")
    sampler = {"transformer": link("5"), "seed": SEED, "steps": STEPS, "width": SIZE, "height": SIZE, "batch_size": 1}
    nodes = {
        "1": ("ParallelModelFromComfyFiles", dict(names)),
        "2": (
            "TinyDualCLIPLoader",
            {
                "clip_name1": names["text_encoder"],
                "clip_name2": names["text_encoder_2"],
                "type": "flux",
                "config_folder": reference,
            },
        ),
        "3": ("CLIPTextEncode", {"clip": link("2"), "text": PROMPT}),
        "4": ("FluxGuidance", {"conditioning": link("3"), "guidance": GUIDANCE}),
        "5": (
            "LoadShardedTransformer",
            {"model": files, "strategy": "context_parallel", "ring_degree": 1, "ulysses_degree": 2},
        ),
        # guidance_scale 1: FluxGuidance's 3.5 must replace it for the images to agree.
        "6": ("ParallelSampler", {**sampler, "positive": link("4"), "guidance_scale": 1.0}),
        "7": ("EncodeOnBalancedGPUs", {"model": files, "prompt": PROMPT, "max_sequence_length": T5_TOKENS}),
        "8": ("ParallelSampler", {**sampler, "positive": link("7"), "guidance_scale": GUIDANCE}),
        "9": ("VAEDecodeSingleGPU", {"samples": link("6"), "model": files, "device": "auto"}),
        "10": ("VAEDecodeSingleGPU", {"samples": link("8"), "model": files, "device": "auto"}),
        "11": ("TinyVAELoader", {"vae_name": names["vae"], "config_folder": reference}),
        "12": ("VAEDecode", {"samples": link("6"), "vae": link("11")}),
        "13": ("EmptySD3LatentImage", {"width": SIZE, "height": SIZE, "batch_size": 1}),
        "14": (
            "ParallelSampler",
            {**sampler, "positive": link("4"), "guidance_scale": 1.0, "latent_image": link("13")},
        ),
        # img2img from ComfyUI's VAEEncode and from VAEEncodeSingleGPU, of the image above
        "15": ("VAEEncode", {"pixels": link("9"), "vae": link("11")}),
        "16": ("VAEEncodeSingleGPU", {"pixels": link("9"), "model": files, "device": "auto"}),
    }
    img2img = {**sampler, "positive": link("4"), "guidance_scale": 1.0, "denoise": 0.5}
    nodes.update(
        {
            node: ("ParallelSampler", {**img2img, "latent_image": link(source)})
            for node, source in (("17", "15"), ("18", "16"))
        }
    )
    for node, name in (("9", "comfy_te"), ("10", "pack_te"), ("12", "comfy_vae")):
        nodes[f"2{node}"] = ("SaveImage", {"images": link(node), "filename_prefix": f"conditioning_{name}"})
    latents = {"6": "comfy_te", "8": "pack_te", "14": "empty", "15": "comfy_encode", "16": "pack_encode"}
    latents.update({"17": "from_comfy_encode", "18": "from_pack_encode"})
    for node, name in latents.items():
        nodes[f"3{node}"] = ("SaveLatent", {"samples": link(node), "filename_prefix": f"latents/conditioning_{name}"})
    return api(nodes)


def saved(server, pattern: str) -> np.ndarray | torch.Tensor:
    from PIL import Image

    (path,) = server.output_dir.glob(pattern)
    if path.suffix == ".latent":
        return load_file(str(path))["latent_tensor"]
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def test_comfyuis_text_encode_and_vae_around_the_sampler(comfyui_server, tiny_comfy_files):
    names, reference = tiny_comfy_files["fp8_scaled"]
    prompt_id, _ = comfyui_server.run(workflow(names, reference), timeout=900)

    comfy_te, pack_te = (
        saved(comfyui_server, "latents/conditioning_comfy_te_*"),
        saved(comfyui_server, "latents/conditioning_pack_te_*"),
    )
    assert comfy_te.shape == (1, 16, SIZE // 8, SIZE // 8)
    print(f"ComfyUI's text encode vs the pack's, latents: max |diff| {(comfy_te - pack_te).abs().max().item():.3g}")
    assert (comfy_te - pack_te).abs().max().item() <= 1e-4
    empty = saved(comfyui_server, "latents/conditioning_empty_*")
    assert (empty - comfy_te).abs().max().item() <= 1e-5  # EmptySD3LatentImage at denoise 1 is text-to-image

    comfy_encode, pack_encode = (saved(comfyui_server, f"latents/conditioning_{n}_encode_*") for n in ("comfy", "pack"))
    print(
        f"ComfyUI's VAEEncode vs VAEEncodeSingleGPU: max |diff| {(comfy_encode - pack_encode).abs().max().item():.3g}"
    )
    assert comfy_encode.shape == comfy_te.shape and (comfy_encode - pack_encode).abs().max().item() <= 1e-4
    from_comfy = saved(comfyui_server, "latents/conditioning_from_comfy_encode_*")
    assert (from_comfy - saved(comfyui_server, "latents/conditioning_from_pack_encode_*")).abs().max().item() <= 1e-4

    image = saved(comfyui_server, "conditioning_comfy_te_*.png")
    assert image.shape == (SIZE, SIZE, 3)
    assert np.abs(image - saved(comfyui_server, "conditioning_pack_te_*.png")).max() <= 1
    comfy_vae = saved(comfyui_server, "conditioning_comfy_vae_*.png")
    print(f"ComfyUI's VAEDecode vs VAEDecodeSingleGPU: max |diff| {np.abs(comfy_vae - image).max()} levels")
    assert np.abs(comfy_vae - image).max() <= 1

    from comfyui_workflows import progress_texts, prompt_window

    said = progress_texts(prompt_window(comfyui_server, prompt_id), "6")
    expected = f"positive: ComfyUI's CONDITIONING ({T5_TOKENS} tokens × 64), guidance {GUIDANCE:g} (its guidance"
    assert any(text.startswith(expected) for text in said), said


def test_another_familys_text_encoder_is_refused_before_anything_loads(
    comfyui_server, comfyui_models_dir, tiny_comfy_files
):
    from comfyui_workflows import tiny_flux

    names, reference = tiny_comfy_files["fp8_scaled"]
    graph = {k: v for k, v in workflow(names, reference).items() if k in {"3", "4", "5", "6", "36"}}
    # A model the graph names (not one converted when it runs), so that validation knows the transformer's family.
    graph["5"]["inputs"]["model"] = tiny_flux(comfyui_models_dir).name
    graph["2"] = {"class_type": "CLIPLoader", "inputs": {"clip_name": names["text_encoder"], "type": "qwen_image"}}
    with pytest.raises(PromptRejected) as rejected:
        comfyui_server.post_prompt(graph)
    assert rejected.value.status == 400 and list(rejected.value.node_errors) == ["6"], rejected.value.node_errors
    (error,) = rejected.value.node_errors["6"]["errors"]
    assert "positive: comes from ComfyUI's CLIPLoader of type qwen_image" in error["details"], error
    assert "DualCLIPLoader (type flux) into CLIPTextEncode" in error["details"], error


# Qwen-Image: ComfyUI keeps the prompt's own length, as QwenImagePipeline does up to max_sequence_length.
QWEN_NEGATIVE, QWEN_TOKENS, TRUE_CFG = "a blue painting", 64, 4.0


def qwen_workflow(names: dict, reference: str) -> dict:
    files = link("1")
    sampler = {"transformer": link("5"), "seed": SEED, "steps": STEPS, "width": SIZE, "height": SIZE, "batch_size": 1}
    sampler["guidance_scale"], sampler["true_cfg_scale"] = 1.0, TRUE_CFG  # Qwen-Image is not guidance-distilled
    comfy_sampler = {**sampler, "positive": link("3"), "negative": link("4")}
    nodes = {
        "1": ("ParallelModelFromComfyFiles", dict(names)),
        "2": ("TinyQwenImageCLIPLoader", {"clip_name": names["text_encoder"], "config_folder": reference}),
        "3": ("CLIPTextEncode", {"clip": link("2"), "text": PROMPT}),
        # ComfyUI's Qwen-Image-Edit prompt node, without an image: the same chat template as CLIPTextEncode's.
        "4": ("TextEncodeQwenImageEdit", {"clip": link("2"), "prompt": QWEN_NEGATIVE}),
        "5": (
            "LoadShardedTransformer",
            {"model": files, "strategy": "cfg_parallel", "ring_degree": 1, "ulysses_degree": 1},
        ),
        "6": ("ParallelSampler", comfy_sampler),
        "7": (
            "EncodeOnBalancedGPUs",
            {"model": files, "prompt": PROMPT, "negative_prompt": QWEN_NEGATIVE, "max_sequence_length": QWEN_TOKENS},
        ),
        "8": ("ParallelSampler", {**sampler, "positive": link("7")}),
        "9": ("VAEDecodeSingleGPU", {"samples": link("6"), "model": files, "device": "auto"}),
        "10": ("VAEDecodeSingleGPU", {"samples": link("8"), "model": files, "device": "auto"}),
        "11": ("VAELoader", {"vae_name": names["vae"]}),
        "12": ("VAEDecode", {"samples": link("6"), "vae": link("11")}),
        "13": ("EmptySD3LatentImage", {"width": SIZE, "height": SIZE, "batch_size": 1}),
        "14": ("ParallelSampler", {**comfy_sampler, "latent_image": link("13")}),
        "15": ("VAEEncode", {"pixels": link("9"), "vae": link("11")}),
        "16": ("VAEEncodeSingleGPU", {"pixels": link("9"), "model": files, "device": "auto"}),
        "17": ("ParallelSampler", {**comfy_sampler, "denoise": 0.5, "latent_image": link("15")}),
        "18": ("ParallelSampler", {**comfy_sampler, "denoise": 0.5, "latent_image": link("16")}),
    }
    for node, name in (("9", "comfy_te"), ("10", "pack_te"), ("12", "comfy_vae")):
        nodes[f"2{node}"] = ("SaveImage", {"images": link(node), "filename_prefix": f"qwen_{name}"})
    latents = {"6": "comfy_te", "8": "pack_te", "14": "empty", "15": "comfy_encode", "16": "pack_encode"}
    latents.update({"17": "from_comfy_encode", "18": "from_pack_encode"})
    for node, name in latents.items():
        nodes[f"3{node}"] = ("SaveLatent", {"samples": link(node), "filename_prefix": f"latents/qwen_{name}"})
    return api(nodes)


def max_diff(a, b) -> float:
    return float(abs(a - b).max())


def test_comfyuis_qwen_image_text_encode_and_wan_vae_around_the_sampler(comfyui_server, tiny_qwen_comfy_files):
    names, reference = tiny_qwen_comfy_files["fp8_scaled"]
    prompt_id, _ = comfyui_server.run(qwen_workflow(names, reference), timeout=900)

    comfy_te, pack_te = (saved(comfyui_server, f"latents/qwen_{n}_te_*") for n in ("comfy", "pack"))
    assert comfy_te.shape == (1, 16, 1, SIZE // 8, SIZE // 8)
    print(f"Qwen-Image, ComfyUI's text encode vs the pack's, latents: max |diff| {max_diff(comfy_te, pack_te):.3g}")
    assert max_diff(comfy_te, pack_te) <= 1e-4
    # EmptySD3LatentImage's 4-D latent is the one frame; at denoise 1 it is text-to-image.
    assert max_diff(saved(comfyui_server, "latents/qwen_empty_*"), comfy_te) <= 1e-5

    comfy_encode, pack_encode = (saved(comfyui_server, f"latents/qwen_{n}_encode_*") for n in ("comfy", "pack"))
    encode_diff = max_diff(comfy_encode, pack_encode)
    print(f"Qwen-Image, ComfyUI's VAEEncode vs VAEEncodeSingleGPU: max |diff| {encode_diff:.3g}")
    assert comfy_encode.shape == comfy_te.shape and encode_diff <= 1e-4
    from_comfy, from_pack = (saved(comfyui_server, f"latents/qwen_from_{n}_encode_*") for n in ("comfy", "pack"))
    assert max_diff(from_comfy, from_pack) <= 1e-4 and max_diff(from_comfy, comfy_te) > 1e-3  # img2img, not t2i

    image = saved(comfyui_server, "qwen_comfy_te_*.png")
    assert image.shape == (SIZE, SIZE, 3) and image.std() > 1  # an image, not a flat fill
    assert max_diff(image, saved(comfyui_server, "qwen_pack_te_*.png")) <= 1
    comfy_vae = saved(comfyui_server, "qwen_comfy_vae_*.png")
    print(f"Qwen-Image, ComfyUI's VAEDecode vs VAEDecodeSingleGPU: max |diff| {max_diff(comfy_vae, image)} levels")
    assert max_diff(comfy_vae, image) <= 1

    from comfyui_workflows import progress_texts, prompt_window

    said = " ".join(progress_texts(prompt_window(comfyui_server, prompt_id), "6"))
    assert "positive: ComfyUI's CONDITIONING (" in said and "negative: ComfyUI's CONDITIONING (" in said, said
