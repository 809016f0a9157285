"""Wan in a real ComfyUI server (2 CPU ranks, tiny Wan 2.1, Ulysses 2): a 5-frame clip from ParallelSampler's
``length`` decoded by VAEDecodeSingleGPU into an IMAGE batch that ComfyUI's own SaveAnimatedWEBP saves, frame for
frame WanPipeline's, and one of tiny Wan 2.2 A14B I2V from a LoadImage'd start picture, frame for frame
WanImageToVideoPipeline's; and a length that is not 4k + 1, an image-to-video model without its start image, or a
Wan 2.2 TI2V-5B clip whose size is not a multiple of its 32-pixel tokens, answered by POST /prompt with a 400 naming
the input, before anything loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from comfyui_host import PromptRejected
from comfyui_workflows import progress_texts, prompt_window
from helpers import WAN_CLIP, wan_one_shot
from PIL import Image

pytestmark = [pytest.mark.comfyui]

MODEL, SEED = "tiny-wan", 3
PROMPT, NEGATIVE, CFG = WAN_CLIP["prompt"], WAN_CLIP["negative_prompt"], WAN_CLIP["guidance_scale"]
WIDTH, HEIGHT, FRAMES = WAN_CLIP["width"], WAN_CLIP["height"], WAN_CLIP["num_frames"]
STEPS, TOKENS = WAN_CLIP["num_inference_steps"], WAN_CLIP["max_sequence_length"]


def tiny_wan(models_dir) -> Path:
    from parallel_runtime.families.wan.tiny import make_tiny_model

    path = Path(models_dir) / MODEL
    if not (path / "model_index.json").is_file():
        make_tiny_model(str(path))
    return path


def workflow(length: int = FRAMES, model: str = MODEL, image: str | None = None) -> dict:
    """The clip's graph; ``image``: a picture in ComfyUI's input folder, LoadImage'd into ParallelSampler's image."""
    nodes = {
        "1": ("ParallelBackend", {"ranks": 2, "device": "cpu", "memory_policy": "staged"}),
        "2": (
            "EncodeOnBalancedGPUs",
            {
                **{"model": MODEL, "prompt": PROMPT, "negative_prompt": NEGATIVE},
                **{"max_sequence_length": TOKENS, "backend": ["1", 0]},
            },
        ),
        "3": (
            "LoadShardedTransformer",
            {"model": MODEL, "strategy": "context_parallel", "ulysses_degree": 2, "backend": ["1", 0]},
        ),
        "4": (
            "ParallelSampler",
            {
                **{"transformer": ["3", 0], "positive": ["2", 0], "seed": SEED, "steps": STEPS, "guidance_scale": 1.0},
                **{"width": WIDTH, "height": HEIGHT, "batch_size": 1, "true_cfg_scale": CFG},
                **{"sampler": "uni_pc", "scheduler": "simple", "length": length},
            },
        ),
        "5": ("VAEDecodeSingleGPU", {"samples": ["4", 0], "model": MODEL, "device": "cpu", "backend": ["1", 0]}),
        "6": (
            "SaveAnimatedWEBP",
            {
                **{"images": ["5", 0], "filename_prefix": "wan_clip", "fps": 16.0},
                **{"lossless": True, "quality": 100, "method": "fastest"},
            },
        ),
    }
    for node_id in ("2", "3", "5"):
        nodes[node_id][1]["model"] = model
    if image is not None:
        nodes["7"] = ("LoadImage", {"image": image})
        nodes["4"][1]["image"] = ["7", 0]
    return {node_id: {"class_type": kind, "inputs": inputs} for node_id, (kind, inputs) in nodes.items()}


@pytest.mark.multirank
@pytest.mark.slow
def test_a_clip_reaches_save_animated_webp(comfyui_server, comfyui_models_dir):
    folder = tiny_wan(comfyui_models_dir)
    comfyui_server.run(workflow(), timeout=600)
    (path,) = comfyui_server.output_dir.glob("wan_clip_*.webp")
    with Image.open(path) as webp:
        assert webp.n_frames == FRAMES
        frames = []
        for index in range(FRAMES):
            webp.seek(index)
            frames.append(np.asarray(webp.convert("RGB")))
    reference = wan_one_shot(folder, SEED, output_type="np")[0]
    # SaveAnimatedWEBP stores clip(255 · x) as uint8, losslessly.
    expected = np.clip(reference * 255.0, 0, 255).astype(np.uint8)
    assert np.abs(np.stack(frames).astype(int) - expected.astype(int)).max() <= 1


def test_a_length_that_is_not_4k_plus_1_is_a_400_naming_it(comfyui_server, comfyui_models_dir):
    tiny_wan(comfyui_models_dir)
    with pytest.raises(PromptRejected) as rejected:
        comfyui_server.post_prompt(workflow(length=6))
    assert rejected.value.status == 400 and list(rejected.value.node_errors) == ["4"], rejected.value.node_errors
    (error,) = rejected.value.node_errors["4"]["errors"]
    assert "length: 6 frames is not 4k + 1" in error["details"] and "use 5 or 9" in error["details"], error


I2V_MODEL = "tiny-wan22-i2v"  # Wan 2.2 A14B I2V: two experts, no image encoder, so any text length


@pytest.fixture(scope="module")
def wan_i2v(comfyui_server, comfyui_models_dir):
    """A tiny Wan 2.2 A14B I2V in the server's diffusers folder, and its 56×40 start picture in its input/."""
    from parallel_runtime.families.wan_i2v.tiny import make_tiny_model

    path = Path(comfyui_models_dir) / I2V_MODEL
    if not (path / "model_index.json").is_file():
        make_tiny_model(str(path), two_experts=True)
    picture = Image.fromarray(((np.arange(40 * 56 * 3) * 7) % 251).reshape(40, 56, 3).astype(np.uint8))
    picture.save(comfyui_server.input_dir / "wan_start.png")
    return path, picture


def test_an_i2v_model_without_its_start_image_is_a_400_naming_image(comfyui_server, wan_i2v):
    """Wan I2V (a WanImageToVideoPipeline folder) with nothing linked into ParallelSampler's image: refused by POST
    /prompt, naming the input and the fix, before anything loads."""
    with pytest.raises(PromptRejected) as rejected:
        comfyui_server.post_prompt(workflow(model=I2V_MODEL))
    assert rejected.value.status == 400 and list(rejected.value.node_errors) == ["4"], rejected.value.node_errors
    (error,) = rejected.value.node_errors["4"]["errors"]
    assert "image: is not linked" in error["details"] and "link the clip's first frame" in error["details"], error


@pytest.mark.multirank
@pytest.mark.slow
def test_a_clip_from_a_loaded_start_image_reaches_save_animated_webp(comfyui_server, wan_i2v):
    """LoadImage → ParallelSampler's image (Ulysses 2, both experts) → SaveAnimatedWEBP: frame for frame
    WanImageToVideoPipeline's from the same picture, and the node says the size the picture ran at."""
    from diffusers import WanImageToVideoPipeline

    folder, picture = wan_i2v
    prompt = workflow(model=I2V_MODEL, image="wan_start.png")
    prompt["6"]["inputs"]["filename_prefix"] = "wan_i2v_clip"
    prompt_id, _ = comfyui_server.run(prompt, timeout=600)
    shown = progress_texts(prompt_window(comfyui_server, prompt_id), "4")
    assert "48×32 from the start image 56×40, resized to 48×32" in shown, shown
    (path,) = comfyui_server.output_dir.glob("wan_i2v_clip_*.webp")
    with Image.open(path) as webp:
        frames = []
        for index in range(webp.n_frames):
            webp.seek(index)
            frames.append(np.asarray(webp.convert("RGB")))
    pipe = WanImageToVideoPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    reference = pipe(
        image=picture,
        **WAN_CLIP,
        generator=[torch.Generator("cpu").manual_seed(SEED)],
        output_type="np",
    ).frames[0]
    expected = np.clip(reference * 255.0, 0, 255).astype(np.uint8)
    assert np.abs(np.stack(frames).astype(int) - expected.astype(int)).max() <= 1


TI2V_MODEL = "tiny-wan22-ti2v"


def test_a_ti2v_width_that_is_not_a_multiple_of_32_is_a_400_naming_it(comfyui_server, comfyui_models_dir):
    """Wan 2.2 TI2V-5B (a WanPipeline folder with expand_timesteps): its 16× VAE and 2 × 2 patches make 32-pixel
    tokens, so the 48-pixel width Wan 2.1 takes is refused, with the sizes to use."""
    from parallel_runtime.families.wan_ti2v.tiny import make_tiny_model

    path = Path(comfyui_models_dir) / TI2V_MODEL
    if not (path / "model_index.json").is_file():
        make_tiny_model(str(path))
    with pytest.raises(PromptRejected) as rejected:
        comfyui_server.post_prompt(workflow(model=TI2V_MODEL))
    assert rejected.value.status == 400 and list(rejected.value.node_errors) == ["4"], rejected.value.node_errors
    (error,) = rejected.value.node_errors["4"]["errors"]
    assert "width: 48 is not a multiple of 32" in error["details"] and "use 32 or 64" in error["details"], error


def webp_frames(path: Path) -> np.ndarray:
    """A SaveAnimatedWEBP file's frames, [frames, H, W, 3] uint8."""
    with Image.open(path) as webp:
        frames = []
        for index in range(webp.n_frames):
            webp.seek(index)
            frames.append(np.asarray(webp.convert("RGB")))
    return np.stack(frames)


@pytest.mark.multirank
def test_comfyuis_own_vae_decode_of_the_packs_clip(comfyui_server, comfyui_files_dir, tmp_path):
    """The pack's Wan LATENT (5-D, ComfyUI's Wan 2.1 convention: un-normalised) from ComfyUI's own Wan files, decoded
    by ComfyUI's VAELoader + VAEDecode of the same wan_2.1_vae file, gives VAEDecodeSingleGPU's frames: both into
    SaveAnimatedWEBP, losslessly, every frame within one 8-bit level (measured 1: the same float32 VAE in ComfyUI's
    and diffusers' implementations)."""
    from parallel_runtime.families.wan.comfy_tiny import make_tiny_wan_files

    ((names, _),) = make_tiny_wan_files(str(comfyui_files_dir), str(tmp_path / "reference"), formats=("bf16",)).values()
    nodes = workflow()
    nodes["9"] = {"class_type": "ParallelModelFromComfyFiles", "inputs": names}
    for node_id in ("2", "3", "5"):
        nodes[node_id]["inputs"]["model"] = ["9", 0]
    nodes["6"]["inputs"]["filename_prefix"] = "wan_pack"
    nodes["10"] = {"class_type": "VAELoader", "inputs": {"vae_name": names["vae"]}}
    nodes["11"] = {"class_type": "VAEDecode", "inputs": {"samples": ["4", 0], "vae": ["10", 0]}}
    nodes["12"] = {"class_type": "SaveAnimatedWEBP", "inputs": {**nodes["6"]["inputs"], "images": ["11", 0]}}
    nodes["12"]["inputs"]["filename_prefix"] = "wan_comfy"
    comfyui_server.run(nodes, timeout=600)
    (pack,) = comfyui_server.output_dir.glob("wan_pack_*.webp")
    (comfy,) = comfyui_server.output_dir.glob("wan_comfy_*.webp")
    ours, theirs = webp_frames(pack), webp_frames(comfy)
    assert ours.shape == theirs.shape == (FRAMES, HEIGHT, WIDTH, 3)
    diff = np.abs(ours.astype(int) - theirs.astype(int)).max()
    print(f"Wan clip, ComfyUI's VAEDecode vs VAEDecodeSingleGPU: max |diff| {diff} levels")
    assert diff <= 1
