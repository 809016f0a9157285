"""Run in a process of its own (ComfyUI's modules read their command line and pick a device at import): ComfyUI's own
reading of a CLIP vision file, for tests/test_comfy_files_wan.py.

    python tests/_comfy_clip_vision_check.py COMFYUI_DIR CONFIG_JSON IMAGE_SAFETENSORS OUT_SAFETENSORS FILE...

``comfy/clip_vision.py``'s ``load`` on each FILE, with the configuration it would pick by the layer count (ViT-H's
``clip_vision_config_h.json``) replaced by CONFIG_JSON, the tiny model's: the state dict as ``load`` reads it
(open_clip's ``visual.*`` keys through ``convert_to_transformers``), loaded by ``ClipVisionModel.load_sd``, and
``encode_image`` of the IMAGE tensor (``image``, [1, H, W, 3] in 0..1, ComfyUI's IMAGE) through ComfyUI's
``clip_preprocess``. Writes, for the I-th FILE, the penultimate hidden states (what ComfyUI's WanImageToVideo reads)
as ``penultimate_hidden_states.I`` to OUT, and the keys the model missed or did not take as ``missing.I`` /
``unexpected.I`` in its metadata; the preprocessed pixels once, as ``pixel_values``.
"""

import json
import sys

comfyui, config, image_path, out, *paths = sys.argv[1:]
sys.path.insert(0, comfyui)
sys.argv = [sys.argv[0], "--cpu"]  # ComfyUI's arguments: the CPU, whatever the machine has

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()

import comfy.clip_vision  # noqa: E402
import comfy.utils  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

image = load_file(image_path)["image"]
tensors, metadata = {}, {}
for i, path in enumerate(paths):
    sd = comfy.utils.load_torch_file(path)
    if "visual.transformer.resblocks.0.attn.in_proj_weight" in sd:  # ``load``'s test for open_clip's layout
        sd = comfy.clip_vision.convert_to_transformers(sd, "visual.")
    clip = comfy.clip_vision.ClipVisionModel(config)
    missing, unexpected = clip.load_sd(sd)
    tensors[f"penultimate_hidden_states.{i}"] = clip.encode_image(image)["penultimate_hidden_states"].float()
    metadata |= {f"missing.{i}": json.dumps(sorted(missing)), f"unexpected.{i}": json.dumps(sorted(unexpected))}
pixels = comfy.clip_vision.clip_preprocess(image, size=clip.image_size, mean=clip.image_mean, std=clip.image_std)
tensors["pixel_values"] = pixels.float()
save_file({k: v.contiguous() for k, v in tensors.items()}, out, metadata=metadata)
