"""Tiny random stand-ins for everything the example workflows name, so that each example runs in ComfyUI without a
download. From the pack's folder (``ComfyUI/custom_nodes/comfyui-parallel-diffusers``), with ComfyUI's Python:

    python -m parallel_runtime.examples ../..

puts tiny random pipelines under the examples' model names (FLUX.1-dev, FLUX.2-dev, Qwen-Image, Wan2.2-T2V-A14B,
FLUX.1-Kontext-dev, Qwen-Image-Edit-2511, Wan2.1-I2V-14B-480P) in ``ComfyUI/models/diffusers/``, a tiny LoRA under the
name the LoRA example picks in ``models/loras/``, the picture the img2img example loads (``example.png``) and the ones
the edit examples edit and the image-to-video example starts from (shipped in ``example_workflows/input/``) in
``input/``. Whatever is there already is kept, never replaced (a real
FLUX.1-dev folder stays as it is). The weights are random, so the images are noise: they show that the graph runs
(every rank, the shared memory, the stages), not the art. Delete the tiny folders before downloading the real models.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from .families.tiny import make_tiny_lora, make_tiny_model, save_diffusers_lora

# The placeholder names the examples ship with (example_workflows/make_examples.py), and the family of each.
PLACEHOLDERS = {  # model folder -> family
    "FLUX.1-dev": "flux",
    "FLUX.2-dev": "flux2",
    "Qwen-Image": "qwenimage",
    "Wan2.2-T2V-A14B": "wan",
    "FLUX.1-Kontext-dev": "flux_kontext",
    "Qwen-Image-Edit-2511": "qwenimage_edit",
    "Wan2.1-I2V-14B-480P": "wan_i2v",
}
STAND_IN_OPTIONS = {"Wan2.2-T2V-A14B": {"two_experts": True}}  # model folder -> its tiny builder's options
LORA_PLACEHOLDERS = {"FLUX.1-dev-lora.safetensors": "FLUX.1-dev"}  # LoRA file -> the model it is for
IMAGE_PLACEHOLDER = "example.png"  # what an img2img example loads (a ComfyUI install ships one in input/)
# The pictures the pack's examples load that ComfyUI does not ship (the edit examples', the image-to-video example's
# start): copied into input/.
SHIPPED_INPUTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "example_workflows", "input")


def picture(path: str, width: int, height: int | None = None) -> None:
    """A picture for an img2img, edit or image-to-video example, ``width`` × ``height`` (default square): soft colour
    gradients with a disc, so that its preview reads as an image (the same bytes for a size, so the shipped ones
    regenerate unchanged)."""
    import numpy as np
    from PIL import Image

    height = width if height is None else height
    y, x = np.mgrid[0:height, 0:width] / np.array([height, width]).reshape(2, 1, 1)
    disc = ((x - 0.6) ** 2 + ((y - 0.45) * height / width) ** 2 < 0.06).astype(np.float32)
    rgb = np.stack([0.9 * x + 0.1, 0.3 + 0.5 * y, 0.8 - 0.6 * x * y], axis=-1) * (1 - disc[..., None])
    rgb += disc[..., None] * np.array([0.95, 0.75, 0.2])
    Image.fromarray((255 * np.clip(rgb, 0, 1)).astype(np.uint8)).save(path)


def make_stand_ins(
    models_dir: str, loras_dir: str, input_dir: str, models: set[str] | None = None, picture_size: int = 512
) -> dict[str, str]:
    """Write the tiny models (``models``: some of PLACEHOLDERS, default all), the LoRAs for them and the img2img
    picture, and copy the shipped pictures (SHIPPED_INPUTS), into the three folders, keeping what exists. Returns each
    path and whether it was ``made``, ``copied`` or ``kept``."""
    models = set(PLACEHOLDERS) if models is None else models
    done = {}
    for model in sorted(models):
        path = os.path.join(models_dir, model)
        if os.path.exists(path):
            done[path] = "kept"
        else:
            make_tiny_model(PLACEHOLDERS[model], path, **STAND_IN_OPTIONS.get(model, {}))
            done[path] = "made"
    for lora, model in sorted(LORA_PLACEHOLDERS.items()):
        path = os.path.join(loras_dir, lora)
        if model not in models:
            continue
        if os.path.exists(path):
            done[path] = "kept"
        else:
            os.makedirs(loras_dir, exist_ok=True)
            weights = make_tiny_lora(os.path.join(models_dir, model), PLACEHOLDERS[model])
            save_diffusers_lora(weights, path, PLACEHOLDERS[model])
            done[path] = "made"
    path = os.path.join(input_dir, IMAGE_PLACEHOLDER)
    if os.path.exists(path):
        done[path] = "kept"
    else:
        os.makedirs(input_dir, exist_ok=True)
        picture(path, picture_size)
        done[path] = "made"
    return {**done, **copy_shipped_inputs(input_dir)}


def copy_shipped_inputs(input_dir: str) -> dict[str, str]:
    """Copy the pictures the examples load that ComfyUI does not ship (SHIPPED_INPUTS) into ComfyUI's ``input_dir``,
    keeping a file of the same name. Returns each path and whether it was ``copied`` or ``kept``."""
    done = {}
    if not os.path.isdir(SHIPPED_INPUTS):  # installed as a wheel: no example workflows, so nothing loads them
        return done
    os.makedirs(input_dir, exist_ok=True)
    for name in sorted(os.listdir(SHIPPED_INPUTS)):
        path = os.path.join(input_dir, name)
        if os.path.exists(path):
            done[path] = "kept"
        else:
            shutil.copyfile(os.path.join(SHIPPED_INPUTS, name), path)
            done[path] = "copied"
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_runtime.examples", description=__doc__.split("\n\n")[0])
    parser.add_argument("comfyui", help="the ComfyUI folder (from the pack's folder in custom_nodes: ../..)")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.comfyui)
    if not os.path.isfile(os.path.join(root, "main.py")) or not os.path.isdir(os.path.join(root, "models")):
        parser.error(f"{root} is not a ComfyUI folder (no main.py and models/ in it); name the one ComfyUI runs from")
    done = make_stand_ins(
        os.path.join(root, "models", "diffusers"), os.path.join(root, "models", "loras"), os.path.join(root, "input")
    )
    for path, what in done.items():
        print(f"{what}: {path}")
    print("In ComfyUI press R (refreshes the model lists), then open an example from the template browser, under")
    print("this pack's name. The real models: the README's Getting the models.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
