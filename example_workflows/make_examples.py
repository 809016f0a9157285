"""Regenerate every example workflow: <name>.json (UI format, what the template browser opens) and
api/<name>_api.json (API format, for scripts and /prompt).

    python example_workflows/make_examples.py

One workflow per strategy, named family_strategy so a user finds the one for their problem (README: "Choosing a
strategy"). Widget values of a UI workflow are positional: they must follow each node's INPUT_TYPES (required, then
optional; a seed with control_after_generate is followed by its "randomize"/"fixed" value). This script reads
INPUT_TYPES from the node classes, so the files follow the nodes whenever they change; values not set below are the
widgets' defaults. tests/test_examples_comfyui.py checks every file against a real server's /object_info and runs
each one. The API copies live in api/ because ComfyUI's template browser lists every example_workflows/*.json, and
an API-format file opened there loads as an empty graph.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# The nodes need ComfyUI's comfy_api: run with COMFYUI_DIR set (.ci/install-comfyui.sh makes a ComfyUI tree).
if os.environ.get("COMFYUI_DIR"):
    sys.path.append(os.environ["COMFYUI_DIR"])
from parallel_nodes import NODES_BY_ID  # noqa: E402
from parallel_runtime.examples import SHIPPED_INPUTS, picture  # noqa: E402

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
PACK = {"cnr_id": "comfyui-parallel-diffusers", "ver": "0.1.0"}
CORE = {"cnr_id": "comfy-core", "ver": "0.3.75"}
SAVE_IMAGE = {  # ComfyUI's core SaveImage, as /object_info describes it
    "INPUT_TYPES": {"required": {"images": ("IMAGE", {}), "filename_prefix": ("STRING", {"default": "ComfyUI"})}},
    "RETURN_TYPES": (),
    "RETURN_NAMES": (),
    "title": "Save Image",
}
SAVE_ANIMATED_WEBP = {  # ComfyUI's core SaveAnimatedWEBP: a clip's frames (an IMAGE batch) as one animated file
    "INPUT_TYPES": {
        "required": {
            "images": ("IMAGE", {}),
            "filename_prefix": ("STRING", {"default": "ComfyUI"}),
            "fps": ("FLOAT", {"default": 6.0, "min": 0.01, "max": 1000.0, "step": 0.01}),
            "lossless": ("BOOLEAN", {"default": True}),
            "quality": ("INT", {"default": 80, "min": 0, "max": 100}),
            "method": (["default", "fastest", "slowest"], {}),
        }
    },
    "RETURN_TYPES": (),
    "RETURN_NAMES": (),
    "title": "SaveAnimatedWEBP",
}
# ComfyUI's core nodes the image examples use, as /object_info describes them (LoadImage's options are the files of
# ComfyUI's input folder; example.png ships with ComfyUI, the edit examples' picture and the image-to-video example's
# start with the pack: EDIT_PICTURE, START_PICTURE).
LATENT_UPSCALE_BY = {
    "INPUT_TYPES": {
        "required": {
            "samples": ("LATENT", {}),
            "upscale_method": (["nearest-exact", "bilinear", "area", "bicubic", "bislerp"], {}),
            "scale_by": ("FLOAT", {"default": 1.5, "min": 0.01, "max": 8.0, "step": 0.01}),
        }
    },
    "RETURN_TYPES": ("LATENT",),
    "RETURN_NAMES": ("LATENT",),
    "title": "Upscale Latent By",
}
# The picture the edit examples edit and the image-to-video example's first frame (832×480, Wan's 480p): they ship in
# example_workflows/input/ (written by picture() below), and `python -m parallel_runtime.examples` puts them in
# ComfyUI's input/, where Load Image finds them.
EDIT_PICTURE = "parallel_edit_example.png"
START_PICTURE = "parallel_i2v_start.png"
SHIPPED_PICTURES = {EDIT_PICTURE: (384, 384), START_PICTURE: (832, 480)}  # file -> width, height
PICTURE_ROLES = {EDIT_PICTURE: "the picture to edit", START_PICTURE: "the clip's first frame"}  # for the note
LOAD_IMAGE = {
    "INPUT_TYPES": {"required": {"image": (["example.png", EDIT_PICTURE, START_PICTURE], {"image_upload": True})}},
    "RETURN_TYPES": ("IMAGE", "MASK"),
    "RETURN_NAMES": ("IMAGE", "MASK"),
    "title": "Load Image",
}
# ComfyUI's own text encoders, prompt nodes and VAE around the pack's sampler (the native example). The file names
# are the ones ComfyUI's FLUX.1 guide has users download; the user picks their own.
NATIVE_FILES = {
    "clip_name1": "clip_l.safetensors",
    "clip_name2": "t5xxl_fp16.safetensors",
    "vae_name": "ae.safetensors",
}
TEXT_ENCODER_FILES = {name: file for name, file in NATIVE_FILES.items() if name.startswith("clip_name")}
DUAL_CLIP_LOADER = {
    "INPUT_TYPES": {
        "required": {
            "clip_name1": ([NATIVE_FILES["clip_name1"]], {}),
            "clip_name2": ([NATIVE_FILES["clip_name2"]], {}),
            "type": (["flux"], {}),
        },
        "optional": {"device": (["default", "cpu"], {"advanced": True})},
    },
    "RETURN_TYPES": ("CLIP",),
    "RETURN_NAMES": ("CLIP",),
    "title": "DualCLIPLoader",
}
CLIP_TEXT_ENCODE = {
    "INPUT_TYPES": {"required": {"text": ("STRING", {"multiline": True}), "clip": ("CLIP", {})}},
    "RETURN_TYPES": ("CONDITIONING",),
    "RETURN_NAMES": ("CONDITIONING",),
    "title": "CLIP Text Encode (Prompt)",
}
FLUX_GUIDANCE = {
    "INPUT_TYPES": {
        "required": {
            "conditioning": ("CONDITIONING", {}),
            "guidance": ("FLOAT", {"default": 3.5, "min": 0.0, "max": 100.0, "step": 0.1}),
        }
    },
    "RETURN_TYPES": ("CONDITIONING",),
    "RETURN_NAMES": ("CONDITIONING",),
    "title": "FluxGuidance",
}
VAE_LOADER = {
    "INPUT_TYPES": {"required": {"vae_name": ([NATIVE_FILES["vae_name"]], {})}},
    "RETURN_TYPES": ("VAE",),
    "RETURN_NAMES": ("VAE",),
    "title": "Load VAE",
}
VAE_DECODE = {
    "INPUT_TYPES": {"required": {"samples": ("LATENT", {}), "vae": ("VAE", {})}},
    "RETURN_TYPES": ("IMAGE",),
    "RETURN_NAMES": ("IMAGE",),
    "title": "VAE Decode",
}
CORE_NODES = {
    "SaveImage": SAVE_IMAGE,
    "SaveAnimatedWEBP": SAVE_ANIMATED_WEBP,
    "LatentUpscaleBy": LATENT_UPSCALE_BY,
    "LoadImage": LOAD_IMAGE,
    "DualCLIPLoader": DUAL_CLIP_LOADER,
    "CLIPTextEncode": CLIP_TEXT_ENCODE,
    "FluxGuidance": FLUX_GUIDANCE,
    "VAELoader": VAE_LOADER,
    "VAEDecode": VAE_DECODE,
}
CONTROL_AFTER_GENERATE = "randomize"
# Node ids are the same in every example, so scripts can address them: backend, encoder, transformer, sampler,
# decoder, saver; an example with LoRAs adds its loaders after them (7, 8, ...), the note comes last.
BACKEND, ENCODER, TRANSFORMER, SAMPLER, DECODER, SAVER = 1, 2, 3, 4, 5, 6
LORAS = 7
# The image examples' extra nodes, after the six: a hires fix's upscale and second sampler; img2img's image and encoder.
UPSCALE, REFINER = 7, 8
LOAD_IMAGE_NODE, IMAGE_ENCODER = 7, 8
# The native example's: ComfyUI's text encoders and FluxGuidance before the sampler, its VAE after it (the encoder's
# and the decoder's ids are CLIPTextEncode's and VAEDecode's).
TEXT_ENCODERS, GUIDANCE_NODE, VAE_NODE = 7, 8, 9
# The LoRA file an example names (ComfyUI/models/loras); the user picks their own.
LORA_PLACEHOLDERS = {"FLUX.1-dev": "FLUX.1-dev-lora.safetensors"}

FOX = (
    "a red fox in a knitted scarf reading a newspaper at a small cafe table, morning light through the window, "
    "shallow depth of field, 35mm photo"
)
EDIT_PROMPT = "make it a watercolor painting of a sunset over the sea, the golden disc as the sun"
FOLDERS = {  # placeholder model folder -> what the folder holds, for the note
    "FLUX.1-dev": "transformer/ text_encoder/ text_encoder_2/\n  tokenizer/ tokenizer_2/ scheduler/ vae/",
    "FLUX.2-dev": "transformer/ text_encoder/ tokenizer/\n  scheduler/ vae/",
    "Qwen-Image": "transformer/ text_encoder/ tokenizer/\n  scheduler/ vae/",
    "Wan2.2-T2V-A14B": "transformer/ transformer_2/ text_encoder/\n  tokenizer/ scheduler/ vae/",
    "FLUX.1-Kontext-dev": "transformer/ text_encoder/ text_encoder_2/\n  tokenizer/ tokenizer_2/ scheduler/ vae/",
    "Qwen-Image-Edit-2511": "transformer/ text_encoder/ tokenizer/\n  processor/ scheduler/ vae/",
    "Wan2.1-I2V-14B-480P": "transformer/ text_encoder/ tokenizer/\n  image_encoder/ image_processor/\n"
    "  scheduler/ vae/",
}


@dataclasses.dataclass(frozen=True)
class Example:
    name: str  # file name without .json: <family>_<strategy>
    model: str  # placeholder folder name in ComfyUI/models/diffusers
    title: str
    why: str  # the note's first paragraph: what this strategy answers
    backend: dict = dataclasses.field(default_factory=dict)
    encode: dict = dataclasses.field(default_factory=dict)
    transformer: dict = dataclasses.field(default_factory=dict)
    sampler: dict = dataclasses.field(default_factory=dict)
    loras: tuple[dict, ...] = ()  # each a ParallelLoraLoader's widgets, chained in this order
    tips: str = ""
    hires_fix: dict | None = None  # the second ParallelSampler's widgets (LatentUpscaleBy's under "upscale")
    image_input: bool = False  # LoadImage -> VAEEncodeSingleGPU -> the sampler's latent_image
    native: bool = False  # ComfyUI's DualCLIPLoader, CLIPTextEncode, FluxGuidance, VAELoader and VAEDecode around it
    saver: tuple[str, dict] = ("SaveImage", {})  # the output node and its widgets (a clip: SaveAnimatedWEBP)
    edits: str = ""  # an edit model's picture: LoadImage -> the `image` of the "encoder" or of the "sampler"
    picture: str = EDIT_PICTURE  # the picture an `edits` example loads


SAMPLER_DEFAULTS = {"seed": 42, "steps": 28, "guidance_scale": 3.5, "width": 1024, "height": 1024, "batch_size": 1}
# Wan's published clip: 81 frames (5 seconds at 16 fps) at 480p, 40 steps of its own UniPC; CFG against a negative
# prompt (true_cfg_scale, set by each example), and the frames into an animated file.
WAN_480P = {"steps": 40, "width": 832, "height": 480, "guidance_scale": 1.0, "sampler": "uni_pc", "length": 81}
WAN_NEGATIVE = "blurry, low quality, static, distorted"
CLIP_SAVER = ("SaveAnimatedWEBP", {"fps": 16.0, "lossless": False, "quality": 90})

EXAMPLES = [
    Example(
        "flux1_device_map",
        "FLUX.1-dev",
        "FLUX.1, staged `device_map`",
        "The text encoders are balanced across the GPUs and freed, then the transformer is spread over them "
        '(`device_map="auto"`), then one GPU decodes: a model that does not fit one GPU fits several.',
        transformer={"strategy": "device_map"},
        tips="`max_memory` (e.g. `0:20GB,1:20GB`) caps what each GPU may hold.",
    ),
    Example(
        "flux1_context_parallel",
        "FLUX.1-dev",
        "FLUX.1, context parallel (Ulysses)",
        "Every GPU holds the whole transformer and takes a share of the image's tokens: one image comes out "
        "faster. Needs the model to fit one GPU, and fast links between GPUs.",
        transformer={"strategy": "context_parallel", "ring_degree": 1, "ulysses_degree": 0},
        tips="`ulysses_degree` 0 uses every GPU (all-to-all; best over NVLink). `ring_degree` > 1 passes keys and "
        "values around a ring instead (slower links); both > 1 is Unified attention. Sizes whose token count "
        "does not divide by the degree (e.g. 1008×1008) need `anything`.",
    ),
    Example(
        "flux1_lora_context_parallel",
        "FLUX.1-dev",
        "FLUX.1 with a LoRA, context parallel (Ulysses)",
        "A LoRA on the transformer, every GPU taking a share of the image's tokens. The LoRA is merged into the "
        "weights the GPUs already hold: changing it or its strength never reloads the transformer, and setting a "
        "strength back gives the same image back.",
        transformer={"strategy": "context_parallel", "ring_degree": 1, "ulysses_degree": 0},
        loras=({"lora_name": LORA_PLACEHOLDERS["FLUX.1-dev"], "strength": 1.0},),
        tips="Chain more **LoRA Loader (parallel)** nodes to stack LoRAs, each with its own strength. The same "
        "loader works with every strategy (tensor parallel merges into each GPU's slice). Only the transformer "
        "changes: a LoRA's text-encoder weights are not applied (the node says so).",
    ),
    Example(
        "flux1_hires_fix",
        "FLUX.1-dev",
        "FLUX.1 hires fix: 1024² upscaled to 1536², context parallel",
        "A first pass at 1024², its latent upscaled 1.5× with ComfyUI's own **Upscale Latent By**, and a second "
        "pass at 1536² that re-denoises half of it (`denoise` 0.5: 14 of 28 steps). The large second pass is where "
        "splitting the image's tokens over the GPUs pays most.",
        transformer={"strategy": "context_parallel", "ring_degree": 1, "ulysses_degree": 0},
        hires_fix={"denoise": 0.5, "upscale": {"upscale_method": "bilinear", "scale_by": 1.5}},
        tips="The second sampler's size comes from its `latent_image` (its width and height are ignored). Any of "
        "ComfyUI's latent nodes fits in between (LatentUpscale, LatentCrop, LatentComposite, SetLatentNoiseMask "
        "for inpainting). Sizes whose token count does not divide by the GPUs need `anything`.",
    ),
    Example(
        "flux1_native_nodes",
        "FLUX.1-dev",
        "FLUX.1 with ComfyUI's own text encoders and VAE, context parallel",
        "ComfyUI's **DualCLIPLoader**, **CLIP Text Encode** and **FluxGuidance** make the conditioning, the pack "
        "runs only the transformer over the GPUs (**Parallel Sampler** takes ComfyUI's CONDITIONING), and ComfyUI's "
        "**Load VAE** / **VAE Decode** turn its LATENT into the image.",
        transformer={"strategy": "context_parallel", "ring_degree": 1, "ulysses_degree": 0},
        sampler={"guidance_scale": 1.0},
        native=True,
        tips="FluxGuidance's `guidance` replaces the sampler's `guidance_scale` (the sampler says so). Any of "
        "ComfyUI's FLUX.1 text-encoder files work (fp8 T5, GGUF through ComfyUI-GGUF's loader). For Qwen-Image: "
        "CLIPLoader (type qwen_image) into CLIPTextEncode, and a negative CONDITIONING into the sampler's "
        "`negative` for true CFG.",
    ),
    Example(
        "qwenimage_img2img",
        "Qwen-Image",
        "Qwen-Image img2img from a loaded picture",
        "A picture from ComfyUI's **Load Image**, encoded by the model's VAE on one GPU (**VAE Encode (single "
        "GPU)**), re-denoised at `denoise` 0.6 (30 of 50 steps) with every GPU taking a share of its tokens.",
        encode={"negative_prompt": "blurry, low quality", "max_sequence_length": 1024},
        transformer={"strategy": "context_parallel", "ring_degree": 1, "ulysses_degree": 0, "anything": True},
        sampler={"steps": 50, "true_cfg_scale": 4.0, "denoise": 0.6},
        image_input=True,
        tips="The image's size is the output's (sides cropped to multiples of 16). Lower `denoise` keeps more of "
        "the picture. For inpainting, put ComfyUI's **Set Latent Noise Mask** between the encoder and the sampler. "
        "`anything` lets prompts of any length split over the GPUs (Qwen-Image keeps each prompt's own length).",
    ),
    Example(
        "flux2_tensor_parallel",
        "FLUX.2-dev",
        "FLUX.2, tensor parallel",
        "Every GPU holds a slice of each weight matrix and reads only that slice from disk: a transformer too "
        "big for one GPU fits, and each step runs on all of them.",
        encode={"prompt": FOX},
        transformer={"strategy": "tensor_parallel", "tp_degree": 0},
        sampler={"guidance_scale": 4.0},
        tips="`tp_degree` 0 uses every GPU; it must divide the attention heads (FLUX.2-dev: 48, so 2, 4, 6 or 8 GPUs).",
    ),
    Example(
        "flux1_tp_cp",
        "FLUX.1-dev",
        "FLUX.1, tensor × context parallel (4 GPUs, experimental)",
        "Tensor parallel inside pairs of GPUs, context parallel across the pairs, on one device mesh: for a "
        "transformer that needs TP to fit, made faster still. Experimental in diffusers.",
        backend={"ranks": 4},
        transformer={"strategy": "tp_cp", "tp_degree": 2, "ring_degree": 1, "ulysses_degree": 0},
        tips="`ring_degree` × `ulysses_degree` × `tp_degree` = ranks; `ulysses_degree` 0 fills the rest. Keep each TP "
        "group on one node (TP talks in every block).",
    ),
    Example(
        "qwenimage_data_parallel",
        "Qwen-Image",
        "Qwen-Image, data parallel over a list of prompts",
        "Every GPU holds a full copy and makes whole images: four prompts, one per line, two images each, "
        "spread over the GPUs (eight images: twice as fast on two GPUs, eight times on eight). More images per "
        "minute, not one image faster.",
        encode={
            "prompt": "\n".join(
                [
                    FOX,
                    "a lighthouse on a cliff at dusk, storm clouds, oil painting",
                    "a bowl of ramen on a wooden counter, steam rising, top-down food photo",
                    "an astronaut tending a vegetable garden on the moon, Earth in the sky, watercolor",
                ]
            ),
            "one_prompt_per_line": True,
            "negative_prompt": "blurry, low quality",
            "max_sequence_length": 1024,
        },
        transformer={"strategy": "data_parallel"},
        sampler={"steps": 50, "batch_size": 2, "true_cfg_scale": 4.0},
        tips="`batch_size` images of each prompt (seed + i for image i). Qwen-Image uses true CFG against the "
        "negative prompt: `true_cfg_scale` 1 turns it off and halves the work.",
    ),
    Example(
        "qwenimage_cfg_parallel",
        "Qwen-Image",
        "Qwen-Image, CFG parallel (true CFG's two passes on two halves of the GPUs)",
        "True CFG runs the transformer twice per step, with the prompt and with the negative prompt. Here half of "
        "the GPUs run the first pass and half the second, combined each step with one exchange: every GPU runs one "
        "pass per step instead of two, and the image is the one-GPU image.",
        encode={"prompt": FOX, "negative_prompt": "blurry, low quality", "max_sequence_length": 1024},
        transformer={"strategy": "cfg_parallel", "ring_degree": 1, "ulysses_degree": 0, "anything": True},
        sampler={"steps": 50, "true_cfg_scale": 4.0},
        tips="Needs an even number of GPUs and `true_cfg_scale` > 1. `ring_degree` × `ulysses_degree` split each "
        "half's tokens (4 GPUs: CFG 2 × Ulysses 2; `ulysses_degree` 0 fills the half); `anything` lets prompts of "
        "any length split. `cache` (first_block_cache, taylorseer) skips work between steps on top.",
    ),
    Example(
        "wan22_t2v_context_parallel",
        "Wan2.2-T2V-A14B",
        "Wan 2.2 A14B text-to-video, context parallel (Ulysses)",
        "A 5-second 480p clip (81 frames) is about 33,000 tokens per step, where splitting the tokens over the GPUs "
        "pays best: every GPU holds both experts (high noise for the early steps, low noise for the late ones) and "
        "takes a share of the clip's tokens. The frames come back as an IMAGE batch, saved by ComfyUI's own "
        "**SaveAnimatedWEBP**.",
        encode={
            "prompt": "a red fox trotting through fresh snow in a birch forest at sunrise, cinematic tracking shot",
            "negative_prompt": WAN_NEGATIVE,
            "max_sequence_length": 512,
        },
        transformer={"strategy": "context_parallel", "ring_degree": 1, "ulysses_degree": 0},
        sampler={**WAN_480P, "true_cfg_scale": 4.0, "guidance_scale_2": 3.0},
        saver=CLIP_SAVER,
        tips="Both experts stay on every GPU: 2 × 28 GB in bf16, half that with ComfyUI's fp8 files (**Parallel "
        "Model From Comfy Files**, `weights` as_stored). `length` is 4k + 1 frames; 1280×720 is Wan's 720p. "
        "`true_cfg_scale` guides the high-noise expert, `guidance_scale_2` the low-noise one; cfg_parallel splits "
        "the two CFG passes over the GPUs instead. A **LoRA Loader (parallel)** between the transformer and the "
        "sampler picks the expert it changes (`expert`).",
    ),
    Example(
        "qwenimage_edit_context_parallel",
        "Qwen-Image-Edit-2511",
        "Qwen-Image-Edit, a picture edited as the prompt says, context parallel (Ulysses)",
        "ComfyUI's **Load Image** into the encoder's `image`: Qwen-Image-Edit's text encoder reads the picture beside "
        "the prompt, and its transformer sees it again as about a megapixel of tokens beside the output's. That long "
        "sequence is what splitting the tokens over the GPUs speeds up.",
        encode={"prompt": EDIT_PROMPT, "negative_prompt": "blurry, low quality", "max_sequence_length": 1024},
        transformer={"strategy": "context_parallel", "ring_degree": 1, "ulysses_degree": 0, "anything": True},
        sampler={"steps": 40, "true_cfg_scale": 4.0},
        edits="encoder",
        tips='`image_2` and `image_3` take two more pictures ("picture 2" in the prompt). The encoder shows the '
        "sizes its pipeline resizes each picture to; the output's size is the sampler's `width` and `height`. "
        "`cfg_parallel` splits true CFG's two passes over the GPUs instead (or with Ulysses on 4).",
    ),
    Example(
        "flux1_kontext_tensor_parallel",
        "FLUX.1-Kontext-dev",
        "FLUX.1 Kontext, a picture edited as the prompt says, tensor parallel",
        "ComfyUI's **Load Image** into the sampler's `image`: Kontext's transformer reads the picture, resized to its "
        "nearest trained resolution (about a megapixel), beside the output's tokens. Every GPU holds a slice of each "
        "weight matrix: a transformer too big for one GPU fits, and each step runs on all of them.",
        encode={"prompt": EDIT_PROMPT},
        transformer={"strategy": "tensor_parallel", "tp_degree": 0},
        sampler={"guidance_scale": 2.5},
        edits="sampler",
        tips="`tp_degree` 0 uses every GPU; it must divide the attention heads (FLUX.1: 24, so 2, 3, 4, 6 or 8 "
        "GPUs). The sampler shows the size the picture runs at. `context_parallel` splits the picture's tokens "
        "instead, for GPUs that each hold the model.",
    ),
    Example(
        "wan21_i2v_cfg_parallel",
        "Wan2.1-I2V-14B-480P",
        "Wan 2.1 image-to-video from a loaded picture, CFG parallel",
        "ComfyUI's **Load Image** into the sampler's `image`: the clip's first frame, resized to 832×480, from which "
        "Wan 2.1 I2V makes 81 frames (5 seconds at 16 fps). Wan's CFG runs the transformer twice per step, with the "
        "prompt and with the negative prompt: here one GPU runs each pass, combined each step with one exchange, so "
        "every GPU runs one pass per step instead of two and the clip is the one-GPU clip. The frames come back as "
        "an IMAGE batch, saved by ComfyUI's own **SaveAnimatedWEBP**.",
        backend={"ranks": 2},
        encode={
            "prompt": "a golden sun drifts slowly across a pastel sky at dusk, soft glowing light, the camera pushes "
            "in slowly",
            "negative_prompt": WAN_NEGATIVE,
            "max_sequence_length": 512,
        },
        transformer={"strategy": "cfg_parallel", "ring_degree": 1, "ulysses_degree": 0},
        sampler={**WAN_480P, "true_cfg_scale": 5.0},
        edits="sampler",
        picture=START_PICTURE,
        saver=CLIP_SAVER,
        tips="Every GPU holds the whole I2V transformer (16.4B parameters, 30.5 GiB in bf16) and, while it denoises, "
        "the VAE and the CLIP image encoder that read the start picture (1.4 GiB). `ranks` is 2 here, one pass per "
        "GPU; on 4 GPUs set it to 4 (or 0): CFG 2 × Ulysses 2 (`ulysses_degree` 0 fills each half), the clip's "
        "tokens split inside each half. Wan 2.1 I2V reads exactly 512 text tokens (`max_sequence_length`); `length` "
        "is 4k + 1 frames; the 720P model takes 1280×720.",
    ),
]


def node_specs(example: Example) -> list:
    """(id, class, position, size, widget values, sockets {input: (from node, output slot)}) per node."""
    model = example.model
    sampler = {**SAMPLER_DEFAULTS, **example.sampler}
    loras = [
        (
            LORAS + i,
            "ParallelLoraLoader",
            [870, 640 + 150 * i],
            [320, 110],
            values,
            {"transformer": (LORAS + i - 1 if i else TRANSFORMER, 0)},
        )
        for i, values in enumerate(example.loras)
    ]
    transformer = (loras[-1][0], 0) if loras else (TRANSFORMER, 0)
    images, decoded, sampler_sockets = [], (SAMPLER, 0), {"transformer": transformer, "positive": (ENCODER, 0)}
    if example.hires_fix:
        second = {key: value for key, value in example.hires_fix.items() if key != "upscale"}
        images = [
            (
                UPSCALE,
                "LatentUpscaleBy",
                [1250, 60],
                [320, 110],
                example.hires_fix["upscale"],
                {"samples": (SAMPLER, 0)},
            ),
            (
                REFINER,
                "ParallelSampler",
                [1250, 230],
                [320, 330],
                {**sampler, **second},
                {"transformer": transformer, "positive": (ENCODER, 0), "latent_image": (UPSCALE, 0)},
            ),
        ]
        decoded = (REFINER, 0)
    if example.image_input:
        images = [
            (LOAD_IMAGE_NODE, "LoadImage", [390, 900], [320, 360], {"image": "example.png"}, {}),
            (
                IMAGE_ENCODER,
                "VAEEncodeSingleGPU",
                [870, 900],
                [320, 130],
                {"model": model, "device": "auto"},
                {"pixels": (LOAD_IMAGE_NODE, 0), "backend": (BACKEND, 0)},
            ),
        ]
        sampler_sockets["latent_image"] = (IMAGE_ENCODER, 0)
    if example.edits:
        # Under the sampler: the transformer loader grows below its widgets with what it reports.
        images = [(LOAD_IMAGE_NODE, "LoadImage", [870, 800], [320, 360], {"image": example.picture}, {})]
    right = 380 if example.hires_fix else 0  # the decoder and the saver make room for the second pass
    encoder = (
        ENCODER,
        "EncodeOnBalancedGPUs",
        [390, 60],
        [420, 400],
        {"model": model, "prompt": FOX, **example.encode},
        {"backend": (BACKEND, 0), **({"image": (LOAD_IMAGE_NODE, 0)} if example.edits == "encoder" else {})},
    )
    if example.edits == "sampler":
        sampler_sockets["image"] = (LOAD_IMAGE_NODE, 0)
    decoder = (
        DECODER,
        "VAEDecodeSingleGPU",
        [1250 + right, 230],
        [320, 130],
        {"model": model, "device": "auto"},
        {"samples": decoded, "backend": (BACKEND, 0)},
    )
    if example.native:  # ComfyUI's text encoders, FluxGuidance and VAE in place of the pack's encoder and decoder
        encoder = (ENCODER, "CLIPTextEncode", [390, 200], [420, 200], {"text": FOX}, {"clip": (TEXT_ENCODERS, 0)})
        decoder = (DECODER, "VAEDecode", [1250, 230], [320, 80], {}, {"samples": decoded, "vae": (VAE_NODE, 0)})
        sampler_sockets["positive"] = (GUIDANCE_NODE, 0)
        images = [
            (TEXT_ENCODERS, "DualCLIPLoader", [390, 40], [420, 130], {**TEXT_ENCODER_FILES, "type": "flux"}, {}),
            (GUIDANCE_NODE, "FluxGuidance", [870, 60], [320, 60], {"guidance": 3.5}, {"conditioning": (ENCODER, 0)}),
            (VAE_NODE, "VAELoader", [1250, 60], [320, 60], {"vae_name": NATIVE_FILES["vae_name"]}, {}),
        ]
    return [
        (
            BACKEND,
            "ParallelBackend",
            [40, 270],
            [300, 230],  # seven widgets: it ends above the note at y 520
            {"ranks": 0, "device": "auto", "memory_policy": "staged", **example.backend},
            {},
        ),
        encoder,
        (
            TRANSFORMER,
            "LoadShardedTransformer",
            [390, 510],
            [420, 330],
            {"model": model, **example.transformer},
            {"backend": (BACKEND, 0)},
        ),
        (
            SAMPLER,
            "ParallelSampler",
            [870, 230],
            [320, 262],
            sampler,
            sampler_sockets,
        ),
        decoder,
        (
            SAVER,
            example.saver[0],
            [1630 + right, 230],
            [540, 600],
            {"filename_prefix": f"parallel_{example.name}", **example.saver[1]},
            {"images": (DECODER, 0)},
        ),
        *loras,
        *images,
    ]


def note(example: Example) -> str:
    if example.native:
        return (
            f"**Parallel Diffusers: {example.title}**\n\n{example.why}\n\n"
            "**Model**: the transformer from a diffusers folder in `ComfyUI/models/diffusers/` (or "
            "**Parallel Model From Comfy Files** on ComfyUI's own files):\n\n"
            f"```\nComfyUI/models/diffusers/{example.model}/\n  model_index.json\n  {FOLDERS[example.model]}\n```\n\n"
            f"**Text encoders and VAE**: ComfyUI's files: `models/text_encoders/` {NATIVE_FILES['clip_name1']} and "
            f"{NATIVE_FILES['clip_name2']}, `models/vae/` {NATIVE_FILES['vae_name']}.\n\n"
            "**Parallel Backend**: `ranks` 0 = one rank per visible GPU."
            + (f"\n\n**Tips**: {example.tips}" if example.tips else "")
        )
    return (
        f"**Parallel Diffusers: {example.title}**\n\n{example.why}\n\n"
        "**Model**: a diffusers folder (`save_pretrained`, safetensors) in `ComfyUI/models/diffusers/`:\n\n"
        f"```\nComfyUI/models/diffusers/{example.model}/\n  model_index.json\n  {FOLDERS[example.model]}\n```\n\n"
        f"Pick it in the {'four' if example.image_input else 'three'} `model` widgets.\n\n"
        + (
            "**Image**: any picture in `ComfyUI/input/` (Load Image's upload button puts it there).\n\n"
            if example.image_input
            else ""
        )
        + (
            f"**Image**: {PICTURE_ROLES[example.picture]}, in `ComfyUI/input/` (Load Image's upload button puts it "
            f"there); {example.picture} ships in the pack's `example_workflows/input/`.\n\n"
            if example.edits
            else ""
        )
        + (
            "**LoRA**: a LoRA for this model (`.safetensors`: diffusers, kohya, ComfyUI or xlabs layout) in "
            "`ComfyUI/models/loras/`; pick it in `lora_name`.\n\n"
            if example.loras
            else ""
        )
        + "**Parallel Backend**: `ranks` 0 = one rank per visible GPU."
        + (f"\n\n**Tips**: {example.tips}" if example.tips else "")
    )


def describe(class_name: str):
    if class_name in CORE_NODES:
        core = CORE_NODES[class_name]
        return core["INPUT_TYPES"], core["RETURN_TYPES"], core["RETURN_NAMES"], core["title"]
    cls = NODES_BY_ID[class_name]
    # Only the sockets and widgets a workflow holds (ComfyUI 0.26 dropped INPUT_TYPES' include_hidden argument).
    inputs = {section: specs for section, specs in cls.INPUT_TYPES().items() if section in ("required", "optional")}
    return inputs, cls.RETURN_TYPES, cls.RETURN_NAMES, cls.define_schema().display_name


def is_widget(spec) -> bool:
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
    return (isinstance(kind, (list, tuple)) or kind in WIDGET_TYPES) and not options.get("forceInput")


def default_of(spec):
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
    if "default" in options:
        return options["default"]
    if isinstance(kind, (list, tuple)):
        return kind[0] if kind else None
    if kind == "COMBO":  # a V3 combo: its options travel beside it
        return options["options"][0] if options["options"] else None
    return {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}[kind]


def build(example: Example) -> tuple[dict, dict]:
    """The (UI, API) documents of one example."""
    nodes = node_specs(example)
    ui_nodes, links, api = [], [], {}
    specs = {nid: describe(cls) for nid, cls, *_ in nodes}
    for order, (nid, cls, pos, size, values, sockets) in enumerate(nodes):
        input_types, return_types, return_names, title = specs[nid]
        widgets_values, ui_inputs, api_inputs = [], [], {}
        for section in ("required", "optional"):
            for name, spec in input_types.get(section, {}).items():
                options = (spec[1] if len(spec) > 1 else {}) or {}
                if is_widget(spec):
                    value = values[name] if name in values else default_of(spec)
                    widgets_values.append(value)
                    if options.get("control_after_generate"):
                        widgets_values.append(CONTROL_AFTER_GENERATE)
                    api_inputs[name] = value
                elif name in sockets:
                    origin, slot = sockets[name]
                    link_id = len(links) + 1
                    # A link has its origin's type; the input may take several ("PD_CONDITIONING,CONDITIONING").
                    links.append([link_id, origin, slot, nid, len(ui_inputs), specs[origin][1][slot]])
                    ui_inputs.append(
                        {
                            "name": name,
                            "type": spec[0],
                            **({"shape": 7} if section == "optional" else {}),
                            "link": link_id,
                        }
                    )
                    api_inputs[name] = [str(origin), slot]
                elif section == "required":
                    raise SystemExit(f"{example.name}: {cls}.{name} is a required socket and nothing feeds it")
        unknown = (set(values) | set(sockets)) - {n for s in input_types.values() for n in s}
        if unknown:
            raise SystemExit(f"{example.name}: {cls} has no input(s) {sorted(unknown)}")
        ui_nodes.append(
            {
                "id": nid,
                "type": cls,
                "pos": pos,
                "size": size,
                "flags": {},
                "order": order,
                "mode": 0,
                "inputs": ui_inputs,
                "outputs": [],
                "properties": {"Node name for S&R": cls, **(CORE if cls in CORE_NODES else PACK)},
                "widgets_values": widgets_values,
            }
        )
        api[str(nid)] = {"class_type": cls, "inputs": api_inputs, "_meta": {"title": title}}
    for node in ui_nodes:
        _, return_types, return_names, _ = specs[node["id"]]
        node["outputs"] = [
            {
                "name": name,
                "type": typ,
                "slot_index": slot,
                "links": [link[0] for link in links if link[1] == node["id"] and link[2] == slot],
            }
            for slot, (name, typ) in enumerate(zip(return_names, return_types))
        ]
    ui_nodes.append(
        {
            "id": len(nodes) + 1,
            "type": "MarkdownNote",
            "pos": [40, 520],
            "size": [320, 440],
            "flags": {},
            "order": len(nodes),
            "mode": 0,
            "inputs": [],
            "outputs": [],
            "properties": {},
            "widgets_values": [note(example)],
            "color": "#432",
            "bgcolor": "#653",
        }
    )
    ui = {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"comfyui-parallel-diffusers/{example.name}")),
        "revision": 0,
        "last_node_id": len(nodes) + 1,
        "last_link_id": len(links),
        "nodes": ui_nodes,
        "links": links,
        "groups": [],
        "config": {},
        "extra": {"ds": {"scale": 0.75, "offset": [0, 0]}},
        "version": 0.4,
    }
    return ui, api


def main() -> None:
    os.makedirs(SHIPPED_INPUTS, exist_ok=True)
    for name, (width, height) in SHIPPED_PICTURES.items():
        path = os.path.join(SHIPPED_INPUTS, name)
        picture(path, width, height)  # deterministic: the same bytes each time
        print("wrote", os.path.relpath(path))
    for example in EXAMPLES:
        ui, api = build(example)
        for path, doc in (
            (os.path.join(HERE, f"{example.name}.json"), ui),
            (os.path.join(HERE, "api", f"{example.name}_api.json"), api),
        ):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(doc, f, indent=2, ensure_ascii=False)
                f.write("\n")
            print("wrote", os.path.relpath(path))


if __name__ == "__main__":
    main()
