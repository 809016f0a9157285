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

FLUX.2's latents both ways likewise (Ulysses 2, the pack's encoder): ComfyUI's VAE of its file (batch-normed 2×2
patches, 128 channels) decodes and encodes them as VAEDecodeSingleGPU / VAEEncodeSingleGPU do, and
EmptyFlux2LatentImage feeds the sampler.

ComfyUI's DualCLIPLoader / VAELoader build full-size models from fixed configs, so the test-only nodes
(tests/comfyui_test_nodes) run the same ComfyUI code with the tiny models' configs: see their docstring.

Tolerances, and why: the latents of ComfyUI's text encode and the pack's agree to 1e-4 (measured 1e-6: the same
float32 arithmetic in two implementations of CLIP and T5 — ComfyUI's attention and GELU against transformers' — differs
in the last bits, which the transformer carries through its steps), the PNGs to one 8-bit level; ComfyUI's VAEEncode
and VAEEncodeSingleGPU to 1e-4 (measured 5e-6), ComfyUI's VAEDecode and VAEDecodeSingleGPU to one level (measured 0):
the same VAE in ComfyUI's and diffusers' implementations, float32. Qwen-Image's: the text encodes' latents to 1e-4
(measured 4e-6; 1e-6 on the embeddings: ComfyUI's Llama code against transformers' Qwen2.5-VL, float32, which keep the
same tokens after the chat template's prefix), the PNGs to one level; ComfyUI's Wan VAE against diffusers'
AutoencoderKLQwenImage to 1e-4 on latents (measured 1e-7) and one level on images (measured 0), float32. FLUX.2's
VAE (ComfyUI's AutoencoderKL with its batch-norm latent against diffusers' AutoencoderKLFlux2): 1e-4 on latents
(measured 5e-6) and one level on images (measured 1: float32 sums in another order land a few pixels on the other side
of a rounding step of the 8-bit PNG)."""

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


def latents_both_ways(nodes: dict, prefix: str, sampler: dict, empty: str) -> dict:
    """``nodes`` (the model's files as node "1", its ComfyUI VAE loader as "11", a text-to-image ParallelSampler as
    "6", whose inputs are ``sampler``), with ComfyUI's latents both ways around it, and saved as ``prefix``_*: the
    sampler's LATENT through VAEDecodeSingleGPU ("single_gpu") and ComfyUI's VAEDecode ("comfy_vae"); ComfyUI's
    ``empty`` latent node into the sampler at denoise 1 ("empty"); ComfyUI's VAEEncode and VAEEncodeSingleGPU of the
    decoded image ("comfy_encode", "pack_encode") and the sampler's img2img from each ("from_..."). Images and latents
    the caller added to ``nodes`` as "10" / "8" are saved too ("pack_te"). As the API workflow."""
    files, vae = link("1"), link("11")
    nodes |= {
        "9": ("VAEDecodeSingleGPU", {"samples": link("6"), "model": files, "device": "auto"}),
        "12": ("VAEDecode", {"samples": link("6"), "vae": vae}),
        "13": (empty, {"width": SIZE, "height": SIZE, "batch_size": 1}),
        "14": ("ParallelSampler", {**sampler, "latent_image": link("13")}),
        "15": ("VAEEncode", {"pixels": link("9"), "vae": vae}),
        "16": ("VAEEncodeSingleGPU", {"pixels": link("9"), "model": files, "device": "auto"}),
        "17": ("ParallelSampler", {**sampler, "denoise": 0.5, "latent_image": link("15")}),
        "18": ("ParallelSampler", {**sampler, "denoise": 0.5, "latent_image": link("16")}),
    }
    images = {"9": "single_gpu", "10": "pack_te", "12": "comfy_vae"}
    latents = {"6": "t2i", "8": "pack_te", "14": "empty", "15": "comfy_encode", "16": "pack_encode"}
    latents |= {"17": "from_comfy_encode", "18": "from_pack_encode"}
    for node, name in images.items():
        if node in nodes:
            nodes[f"2{node}"] = ("SaveImage", {"images": link(node), "filename_prefix": f"{prefix}_{name}"})
    for node, name in latents.items():
        if node in nodes:
            nodes[f"3{node}"] = ("SaveLatent", {"samples": link(node), "filename_prefix": f"latents/{prefix}_{name}"})
    return api(nodes)


def workflow(names: dict, reference: str) -> dict:
    files = link("1")
    sampler = {"transformer": link("5"), "seed": SEED, "steps": STEPS, "width": SIZE, "height": SIZE, "batch_size": 1}
    # guidance_scale 1: FluxGuidance's 3.5 must replace it for the images to agree.
    comfy_sampler = {**sampler, "positive": link("4"), "guidance_scale": 1.0}
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
        "6": ("ParallelSampler", comfy_sampler),
        "7": ("EncodeOnBalancedGPUs", {"model": files, "prompt": PROMPT, "max_sequence_length": T5_TOKENS}),
        "8": ("ParallelSampler", {**sampler, "positive": link("7"), "guidance_scale": GUIDANCE}),
        "10": ("VAEDecodeSingleGPU", {"samples": link("8"), "model": files, "device": "auto"}),
        "11": ("TinyVAELoader", {"vae_name": names["vae"], "config_folder": reference}),
    }
    return latents_both_ways(nodes, "flux1", comfy_sampler, "EmptySD3LatentImage")


def saved(server, pattern: str) -> np.ndarray | torch.Tensor:
    from PIL import Image

    (path,) = server.output_dir.glob(pattern)
    if path.suffix == ".latent":
        return load_file(str(path))["latent_tensor"]
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def max_diff(a, b) -> float:
    return float(abs(a - b).max())


def check_latents_both_ways(server, prefix: str, shape: tuple) -> tuple[torch.Tensor, np.ndarray]:
    """What ``latents_both_ways`` saved as ``prefix``, checked (tolerances: the module's docstring); returns the
    text-to-image LATENT and its VAEDecodeSingleGPU image."""
    t2i = saved(server, f"latents/{prefix}_t2i_*")
    assert t2i.shape == shape
    # ComfyUI's empty latent at denoise 1 is text-to-image.
    assert max_diff(saved(server, f"latents/{prefix}_empty_*"), t2i) <= 1e-5

    comfy_encode, pack_encode = (saved(server, f"latents/{prefix}_{n}_encode_*") for n in ("comfy", "pack"))
    encode_diff = max_diff(comfy_encode, pack_encode)
    print(f"{prefix}: ComfyUI's VAEEncode vs VAEEncodeSingleGPU: max |diff| {encode_diff:.3g}")
    assert comfy_encode.shape == shape and encode_diff <= 1e-4
    from_comfy, from_pack = (saved(server, f"latents/{prefix}_from_{n}_encode_*") for n in ("comfy", "pack"))
    assert max_diff(from_comfy, from_pack) <= 1e-4 and max_diff(from_comfy, t2i) > 1e-3  # img2img, not t2i

    image = saved(server, f"{prefix}_single_gpu_*.png")
    assert image.shape == (SIZE, SIZE, 3) and image.std() > 1  # an image, not a flat fill
    comfy_vae = saved(server, f"{prefix}_comfy_vae_*.png")
    print(f"{prefix}: ComfyUI's VAEDecode vs VAEDecodeSingleGPU: max |diff| {max_diff(comfy_vae, image)} levels")
    assert max_diff(comfy_vae, image) <= 1
    return t2i, image


def test_comfyuis_text_encode_and_vae_around_the_sampler(comfyui_server, tiny_comfy_files):
    names, reference = tiny_comfy_files["fp8_scaled"]
    prompt_id, _ = comfyui_server.run(workflow(names, reference), timeout=900)

    comfy_te, image = check_latents_both_ways(comfyui_server, "flux1", (1, 16, SIZE // 8, SIZE // 8))
    pack_te = saved(comfyui_server, "latents/flux1_pack_te_*")
    print(f"ComfyUI's text encode vs the pack's, latents: max |diff| {max_diff(comfy_te, pack_te):.3g}")
    assert max_diff(comfy_te, pack_te) <= 1e-4
    assert max_diff(image, saved(comfyui_server, "flux1_pack_te_*.png")) <= 1

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
FLUX2_GUIDANCE, FLUX2_TOKENS = 4.0, 48


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
        "10": ("VAEDecodeSingleGPU", {"samples": link("8"), "model": files, "device": "auto"}),
        # ComfyUI's own loader: it reads the Wan 2.1 VAE's width from the file.
        "11": ("VAELoader", {"vae_name": names["vae"]}),
    }
    # ComfyUI's Qwen-Image workflows start from EmptySD3LatentImage: 4-D, which the sampler takes as the one frame.
    return latents_both_ways(nodes, "qwen", comfy_sampler, "EmptySD3LatentImage")


def test_comfyuis_qwen_image_text_encode_and_wan_vae_around_the_sampler(comfyui_server, tiny_qwen_comfy_files):
    names, reference = tiny_qwen_comfy_files["fp8_scaled"]
    prompt_id, _ = comfyui_server.run(qwen_workflow(names, reference), timeout=900)

    comfy_te, image = check_latents_both_ways(comfyui_server, "qwen", (1, 16, 1, SIZE // 8, SIZE // 8))
    pack_te = saved(comfyui_server, "latents/qwen_pack_te_*")
    print(f"Qwen-Image, ComfyUI's text encode vs the pack's, latents: max |diff| {max_diff(comfy_te, pack_te):.3g}")
    assert max_diff(comfy_te, pack_te) <= 1e-4
    assert max_diff(image, saved(comfyui_server, "qwen_pack_te_*.png")) <= 1

    from comfyui_workflows import progress_texts, prompt_window

    said = " ".join(progress_texts(prompt_window(comfyui_server, prompt_id), "6"))
    assert "positive: ComfyUI's CONDITIONING (" in said and "negative: ComfyUI's CONDITIONING (" in said, said


def flux2_workflow(names: dict, reference: str) -> dict:
    """FLUX.2's ComfyUI files, the pack's encoder (ComfyUI's Mistral text encode is not run here: only the latents)."""
    files = link("1")
    sampler = {"transformer": link("5"), "seed": SEED, "steps": STEPS, "width": SIZE, "height": SIZE, "batch_size": 1}
    sampler |= {"positive": link("7"), "guidance_scale": FLUX2_GUIDANCE}
    nodes = {
        "1": ("ParallelModelFromComfyFiles", dict(names)),
        "5": (
            "LoadShardedTransformer",
            {"model": files, "strategy": "context_parallel", "ring_degree": 1, "ulysses_degree": 2},
        ),
        "6": ("ParallelSampler", sampler),
        "7": ("EncodeOnBalancedGPUs", {"model": files, "prompt": PROMPT, "max_sequence_length": FLUX2_TOKENS}),
        "11": ("TinyVAELoader", {"vae_name": names["vae"], "config_folder": reference}),
    }
    return latents_both_ways(nodes, "flux2", sampler, "EmptyFlux2LatentImage")


def test_comfyuis_flux2_vae_around_the_sampler(comfyui_server, tiny_flux2_comfy_files):
    names, reference = tiny_flux2_comfy_files["bf16"]
    comfyui_server.run(flux2_workflow(names, reference), timeout=900)
    # ComfyUI's FLUX.2 LATENT: the 32 channels in 2×2 patches, batch-normed.
    check_latents_both_ways(comfyui_server, "flux2", (1, 128, SIZE // 16, SIZE // 16))
