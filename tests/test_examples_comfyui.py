"""Every shipped example workflow (one per strategy, example_workflows/make_examples.py) on a real ComfyUI server.

Each UI-format file must match the server's /object_info widget by widget and convert, the way the frontend
converts it, to its API copy; the template browser must list exactly the UI files. Then each example runs headless
through /prompt with its placeholder models (and LoRAs) swapped for tiny random ones of the same family, 2 CPU ranks
(the TP×CP example keeps its 4, marked ``four_ranks``), 64×64 and 2 steps, and every saved PNG must equal diffusers'
one-shot pipeline (with the same LoRAs, ``load_lora_weights``) after 8-bit quantisation (±1 level); the image
examples' (a hires fix through ComfyUI's LatentUpscaleBy, img2img from ComfyUI's LoadImage) must equal diffusers'
text-to-image and img2img pipelines chained the same way; the video example's frames (through ComfyUI's
SaveAnimatedWEBP, lossless for the check, 5 frames) must equal diffusers' ``WanPipeline``'s, both experts, and the
image-to-video example's ``WanImageToVideoPipeline``'s from the start picture the pack ships; the edit examples' (the
picture the pack ships, from ComfyUI's LoadImage) must equal FluxKontextPipeline and QwenImageEditPlusPipeline on it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from comfyui_host import REPO_ROOT, ComfyUIServer

from parallel_runtime.examples import copy_shipped_inputs

pytestmark = pytest.mark.comfyui

WORKFLOWS = REPO_ROOT / "example_workflows"
EXAMPLES = sorted(path.stem for path in WORKFLOWS.glob("*.json"))
PLACEHOLDERS = {
    "FLUX.1-dev": "flux",
    "FLUX.2-dev": "flux2",
    "Qwen-Image": "qwenimage",
    "Wan2.2-T2V-A14B": "wan",
    "FLUX.1-Kontext-dev": "flux_kontext",
    "Qwen-Image-Edit-2511": "qwenimage_edit",
    "Wan2.1-I2V-14B-480P": "wan_i2v",
}
LORA_PLACEHOLDERS = {"FLUX.1-dev-lora.safetensors": "flux"}  # the LoRA an example names -> its family
IMAGE_PLACEHOLDER = "example.png"  # the picture an img2img example loads: ComfyUI ships it in its input folder
EDIT_PICTURE = "parallel_edit_example.png"  # the picture the edit examples edit: the pack ships it
START_PICTURE = "parallel_i2v_start.png"  # the image-to-video example's first frame: the pack ships it
SHIPPED_PICTURES = (EDIT_PICTURE, START_PICTURE)
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
CONTROL_VALUES = ("fixed", "increment", "decrement", "randomize")
FRONTEND_ONLY = ("MarkdownNote", "Note")  # frontend nodes: saved in UI workflows, never sent to /prompt
SIZE, STEPS, SEED = 64, 2, 5
# Shorter text than the examples' (512 / 1024 tokens) keeps the tiny runs quick; FLUX.2 counts its 31-token tiny
# system message in it.
# Qwen-Image-Edit's pipeline cuts no prompt (its pictures' tokens ride in the text), and Wan 2.1 I2V reads exactly 512
# tokens: their examples keep their length.
MAX_SEQUENCE_LENGTH = {"flux": 32, "flux2": 48, "qwenimage": 64, "wan": 16, "flux_kontext": 32}
FRAMES = 5  # a video example's clip: 2 latent frames
SAVERS = ("SaveImage", "SaveAnimatedWEBP")
FOUR_RANKS = {"flux1_tp_cp"}
# One edit example runs in the default run (Kontext under tensor parallel, which no other default test covers with a
# picture); the Qwen-Image-Edit one, Ulysses with the encoder's picture, only with -m slow.
SLOW = {"qwenimage_edit_context_parallel"}
# test_e2e_comfyui.py runs flux1_device_map against the one-shot pipeline already, and checks that a new seed loads
# nothing. ComfyUI's DualCLIPLoader and VAELoader load only full-size files: test_comfyui_conditioning.py runs the
# native example's graph with ComfyUI's same code on the tiny files (tests/comfyui_test_nodes).
RUN_ELSEWHERE = {"flux1_device_map", "flux1_native_nodes"}
# The ComfyUI files the native example names (make_examples.NATIVE_FILES), by widget.
FILE_PLACEHOLDERS = {
    "clip_name1": ["clip_l.safetensors"],
    "clip_name2": ["t5xxl_fp16.safetensors"],
    "vae_name": ["ae.safetensors"],
}


def load(name: str, api: bool = False) -> dict:
    path = WORKFLOWS / "api" / f"{name}_api.json" if api else WORKFLOWS / f"{name}.json"
    return json.loads(path.read_text())


def is_widget(spec: list) -> bool:
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
    return (isinstance(kind, list) or kind in WIDGET_TYPES) and not options.get("forceInput")


def ui_to_api(ui: dict, info: dict) -> dict:
    """Convert a UI workflow as the frontend does, asserting on the way that every widget value sits where
    /object_info says (INPUT_TYPES order; a seed followed by its control value) and every link joins matching types."""
    assert ui["version"] == 0.4
    assert ui["last_node_id"] == max(n["id"] for n in ui["nodes"])
    assert ui["last_link_id"] == max(link[0] for link in ui["links"])
    nodes = {n["id"]: n for n in ui["nodes"]}
    links = {link[0]: link for link in ui["links"]}
    converted = {}
    for node in ui["nodes"]:
        if node["type"] in FRONTEND_ONLY:
            continue
        assert node["type"] in info, node["type"]
        entry = info[node["type"]]
        values = list(node["widgets_values"])
        sockets = {i["name"]: i for i in node["inputs"]}
        inputs = {}
        for section in ("required", "optional"):
            for name in entry["input_order"].get(section, []):
                spec = entry["input"][section][name]
                if is_widget(spec):
                    assert values, f"{node['type']}: no widget value left for {name}"
                    value = values.pop(0)
                    kind, options = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
                    if isinstance(kind, list) or kind == "COMBO":  # a V1 list, or a V3 combo with its options
                        choices = kind if isinstance(kind, list) else options["options"]
                        allowed = choices + {
                            "model": list(PLACEHOLDERS),
                            "lora_name": list(LORA_PLACEHOLDERS),
                            "image": [IMAGE_PLACEHOLDER, *SHIPPED_PICTURES],
                            **FILE_PLACEHOLDERS,
                        }.get(name, [])
                        assert value in allowed, (node["type"], name, value, kind)
                    elif kind in ("INT", "FLOAT"):
                        assert isinstance(value, (int, float)) and not isinstance(value, bool), (name, value)
                        assert options.get("min", value) <= value <= options.get("max", value), (name, value)
                    elif kind == "STRING":
                        assert isinstance(value, str), (name, value)
                    elif kind == "BOOLEAN":
                        assert isinstance(value, bool), (name, value)
                    inputs[name] = value
                    if options.get("control_after_generate"):
                        assert values and values.pop(0) in CONTROL_VALUES, f"{node['type']}.{name}: control value"
                else:
                    socket = sockets.get(name)
                    if section == "required":
                        assert socket is not None and socket["link"] is not None, f"{node['type']}.{name} unlinked"
                    if socket is None or socket["link"] is None:
                        continue
                    assert socket["type"] == spec[0]
                    link = links[socket["link"]]
                    _, origin, origin_slot, target, target_slot, link_type = link
                    assert target == node["id"] and node["inputs"][target_slot]["name"] == name, link
                    source = nodes[origin]
                    assert link[0] in source["outputs"][origin_slot]["links"], link
                    # A link has its origin's type, which the input takes (one of its types, as ComfyUI checks it).
                    assert info[source["type"]]["output"][origin_slot] == link_type, link
                    assert link_type in spec[0].split(","), (link, spec[0])
                    inputs[name] = [str(origin), origin_slot]
        assert values == [], f"{node['type']}: widget values left over: {values}"
        converted[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return converted


def inputs_of(workflow: dict, class_type: str) -> dict:
    (node,) = [n for n in workflow.values() if n["class_type"] == class_type]
    return node["inputs"]


def samplers(workflow: dict) -> list[dict]:
    """Every ParallelSampler's inputs, by node id (a hires fix has two: the first pass, then the one it upscales)."""
    return [
        n["inputs"]
        for _, n in sorted(workflow.items(), key=lambda item: int(item[0]))
        if n["class_type"] == "ParallelSampler"
    ]


# ---------------------------------------------------------------------------------------------------------------
def test_there_is_an_example_per_strategy():
    from parallel_runtime.strategy import Strategy

    shown = {inputs_of(load(name, api=True), "LoadShardedTransformer")["strategy"] for name in EXAMPLES}
    assert shown == {s.value for s in Strategy}
    assert {path.stem.removesuffix("_api") for path in (WORKFLOWS / "api").glob("*.json")} == set(EXAMPLES)


def test_template_browser_lists_every_ui_workflow_and_no_api_copy(comfyui_server):
    """ComfyUI lists every example_workflows/*.json of a pack as a template and loads it as a UI graph; the API
    copies sit in a subfolder so that they are not offered as (empty) templates."""
    templates = comfyui_server.get_json("/workflow_templates")
    assert sorted(templates.get(comfyui_server.pack_name, [])) == EXAMPLES, templates
    for name in EXAMPLES:
        status, raw = comfyui_server.request("GET", f"/api/workflow_templates/{comfyui_server.pack_name}/{name}.json")
        assert status == 200 and json.loads(raw) == load(name)


@pytest.mark.parametrize("name", EXAMPLES)
def test_ui_workflow_matches_object_info_and_the_api_copy(comfyui_server, name):
    api = load(name, api=True)
    converted = ui_to_api(load(name), comfyui_server.object_info())
    assert converted == {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in api.items()}
    # What a user with GPUs wants out of the box: full size, placeholder models named like the hub's repos.
    for sampler in samplers(api):
        # a clip: Wan's 480p, 81 frames (its 5 seconds at 16 fps)
        size = (1024, 1024) if sampler["length"] == 1 else (832, 480)
        assert (sampler["width"], sampler["height"]) == size and sampler["steps"] >= 28
    assert len({n["inputs"]["model"] for n in api.values() if "model" in n["inputs"]} & set(PLACEHOLDERS)) == 1


# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_models(comfyui_models_dir) -> dict[str, Path]:
    """A tiny random model per family under a name of its own (the placeholder names stay unknown to the server,
    which other tests rely on)."""
    from parallel_runtime.examples import STAND_IN_OPTIONS
    from parallel_runtime.families.tiny import make_tiny_model

    made = {}
    for placeholder, family in PLACEHOLDERS.items():
        path = Path(comfyui_models_dir) / f"tiny-{family}-examples"
        if not (path / "model_index.json").is_file():
            make_tiny_model(family, str(path), **STAND_IN_OPTIONS.get(placeholder, {}))
        made[family] = path
    return made


@pytest.fixture(scope="module")
def tiny_loras(tiny_models, comfyui_loras_dir) -> dict[str, Path]:
    """A tiny random LoRA per family named by an example, in the server's loras folder under a name of its own."""
    from parallel_runtime.families.tiny import make_tiny_lora, save_diffusers_lora

    made = {}
    for family in set(LORA_PLACEHOLDERS.values()):
        path = Path(comfyui_loras_dir) / f"tiny-{family}-examples-lora.safetensors"
        if not path.is_file():
            save_diffusers_lora(make_tiny_lora(tiny_models[family], family, seed=11), path, family)
        made[family] = path
    return made


def small(name: str, tiny_models: dict[str, Path], tiny_loras: dict[str, Path]) -> tuple[dict, str]:
    """The API copy with tiny models and LoRAs, 2 CPU ranks (more if the example needs them), 64×64 and 2 steps."""
    workflow = load(name, api=True)
    family = PLACEHOLDERS[inputs_of(workflow, "EncodeOnBalancedGPUs")["model"]]
    for node in workflow.values():
        if "model" in node["inputs"]:
            node["inputs"]["model"] = tiny_models[family].name
        if node["class_type"] == "ParallelLoraLoader":
            node["inputs"]["lora_name"] = tiny_loras[LORA_PLACEHOLDERS[node["inputs"]["lora_name"]]].name
    backend = inputs_of(workflow, "ParallelBackend")
    backend.update(ranks=max(2, backend["ranks"]), device="cpu")
    if family in MAX_SEQUENCE_LENGTH:
        inputs_of(workflow, "EncodeOnBalancedGPUs")["max_sequence_length"] = MAX_SEQUENCE_LENGTH[family]
    for sampler in samplers(workflow):
        sampler.update(seed=SEED, steps=STEPS, width=SIZE, height=SIZE)
        if sampler["length"] > 1:
            sampler["length"] = FRAMES
    (saver,) = [n["inputs"] for n in workflow.values() if n["class_type"] in SAVERS]
    saver["filename_prefix"] = f"example_{name}"
    if "lossless" in saver:
        saver["lossless"] = True  # the frames exactly as decoded (8-bit), for the comparison
    return workflow, family


def reference_images(family: str, model_dir: Path, workflow: dict, loras_dir: Path) -> np.ndarray:
    """diffusers' one-shot pipeline for the workflow's settings (its LoRAs loaded with ``load_lora_weights`` and
    weighted with ``set_adapters``), quantised as ComfyUI's SaveImage does.

    One call per prompt (image i of the whole batch from seed + i): diffusers 0.42.1's QwenImagePipeline tiles the
    attention mask where it interleaves the embeddings (`encode_prompt`, `prompt_embeds_mask.repeat(1, n, 1)`), so a
    batched call with prompts of different lengths and num_images_per_prompt > 1 masks the wrong tokens.
    """
    from diffusers import Flux2Pipeline, FluxPipeline, QwenImagePipeline, WanPipeline

    encode, (sampler,) = inputs_of(workflow, "EncodeOnBalancedGPUs"), samplers(workflow)
    prompts = (
        [line.strip() for line in encode["prompt"].splitlines() if line.strip()]
        if encode["one_prompt_per_line"]
        else [encode["prompt"]]
    )
    per_prompt = sampler["batch_size"]
    kwargs = {
        "num_images_per_prompt": per_prompt,
        "num_inference_steps": sampler["steps"],
        "width": sampler["width"],
        "height": sampler["height"],
        "max_sequence_length": encode["max_sequence_length"],
        "output_type": "pt",
    }
    if family == "qwenimage":
        pipeline = QwenImagePipeline
        kwargs.update(negative_prompt=encode["negative_prompt"], true_cfg_scale=sampler["true_cfg_scale"])
    elif family == "wan":
        pipeline = WanPipeline
        kwargs.update(
            negative_prompt=encode["negative_prompt"],
            guidance_scale=sampler["true_cfg_scale"],
            guidance_scale_2=sampler["guidance_scale_2"],
            num_frames=sampler["length"],
            num_videos_per_prompt=kwargs.pop("num_images_per_prompt"),
        )
    else:
        pipeline = FluxPipeline if family == "flux" else Flux2Pipeline
        kwargs["guidance_scale"] = sampler["guidance_scale"]
    pipe = pipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    loras = [n["inputs"] for n in workflow.values() if n["class_type"] == "ParallelLoraLoader"]
    for i, lora in enumerate(loras):
        pipe.load_lora_weights(str(loras_dir / lora["lora_name"]), adapter_name=f"lora{i}")
    if loras:
        pipe.set_adapters([f"lora{i}" for i in range(len(loras))], [lora["strength"] for lora in loras])
    first = sampler["seed"]
    outputs = [
        pipe(
            prompt=prompt,
            generator=[torch.Generator("cpu").manual_seed(first + p * per_prompt + i) for i in range(per_prompt)],
            **kwargs,
        )
        for p, prompt in enumerate(prompts)
    ]
    if family == "wan":  # each clip's frames, clip by clip: [B, frames, 3, H, W]
        images = torch.cat([output.frames.flatten(0, 1) for output in outputs])
    else:
        images = torch.cat([output.images for output in outputs])
    return np.clip(255.0 * images.permute(0, 2, 3, 1).numpy(), 0, 255).astype(np.uint8)


def image_reference(family: str, model_dir: Path, workflow: dict, input_dir: Path) -> np.ndarray:
    """diffusers' pipelines for an image example, quantised as SaveImage does. A hires fix: FluxPipeline, its latent
    upscaled as ComfyUI's LatentUpscaleBy does (``comfy.utils.common_upscale``: ``interpolate`` in the method's mode),
    then FluxImg2ImgPipeline on it. Img2img: the picture as LoadImage reads it, the VAE's posterior mode, then
    QwenImageImg2ImgPipeline. Each img2img pipeline takes the latent normalised as its ``_encode_vae_image`` does."""
    from diffusers import FluxImg2ImgPipeline, FluxPipeline, QwenImageImg2ImgPipeline
    from PIL import Image

    encode, passes = inputs_of(workflow, "EncodeOnBalancedGPUs"), samplers(workflow)
    last = passes[-1]
    common = {"prompt": encode["prompt"], "max_sequence_length": encode["max_sequence_length"]}
    if family == "flux":
        first = FluxPipeline.from_pretrained(model_dir)
        first.set_progress_bar_config(disable=True)
        sampler = passes[0]
        packed = first(
            **common,
            num_inference_steps=sampler["steps"],
            guidance_scale=sampler["guidance_scale"],
            width=sampler["width"],
            height=sampler["height"],
            generator=[torch.Generator("cpu").manual_seed(sampler["seed"])],
            output_type="latent",
        ).images
        vae = first.vae.config
        latent = FluxPipeline._unpack_latents(packed, sampler["height"], sampler["width"], 8)
        latent = latent / vae.scaling_factor + vae.shift_factor  # ComfyUI's LATENT: what VAEDecode takes
        upscale = inputs_of(workflow, "LatentUpscaleBy")
        size = tuple(round(side * upscale["scale_by"]) for side in latent.shape[-2:])
        latent = torch.nn.functional.interpolate(latent, size=size, mode=upscale["upscale_method"])
        image = (latent - vae.shift_factor) * vae.scaling_factor
        pipe, extra = FluxImg2ImgPipeline.from_pretrained(model_dir), {"guidance_scale": last["guidance_scale"]}
    else:
        pipe = QwenImageImg2ImgPipeline.from_pretrained(model_dir)
        picture = Image.open(input_dir / inputs_of(workflow, "LoadImage")["image"]).convert("RGB")
        pixels = torch.from_numpy(np.asarray(picture).astype(np.float32) / 255.0)[None]
        with torch.no_grad():
            mode = pipe.vae.encode((pixels.permute(0, 3, 1, 2) * 2 - 1).unsqueeze(2)).latent_dist.mode()
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        image = ((mode - mean) * (1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)))[:, :, 0]
        extra = {"negative_prompt": encode["negative_prompt"], "true_cfg_scale": last["true_cfg_scale"]}
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        **common,
        image=image,
        strength=last["denoise"],
        num_inference_steps=last["steps"],
        width=image.shape[-1] * 8,
        height=image.shape[-2] * 8,
        generator=[torch.Generator("cpu").manual_seed(last["seed"])],
        output_type="pt",
        **extra,
    ).images
    return np.clip(255.0 * images.permute(0, 2, 3, 1).numpy(), 0, 255).astype(np.uint8)


def edit_reference(family: str, model_dir: Path, workflow: dict, input_dir: Path) -> np.ndarray:
    """diffusers' pipeline for an example that loads a picture into the sampler or the encoder, on the picture as
    LoadImage reads it, quantised as SaveImage does: FluxKontextPipeline (``max_area`` the output's, which the sampler's
    width and height set), QwenImageEditPlusPipeline (true CFG against the negative prompt) or, from a start picture,
    WanImageToVideoPipeline (Wan's CFG against the negative prompt; the clip's frames)."""
    from diffusers import FluxKontextPipeline, QwenImageEditPlusPipeline, WanImageToVideoPipeline
    from PIL import Image

    encode, (sampler,) = inputs_of(workflow, "EncodeOnBalancedGPUs"), samplers(workflow)
    picture = Image.open(input_dir / inputs_of(workflow, "LoadImage")["image"]).convert("RGB")
    if family == "wan_i2v":
        pipe = WanImageToVideoPipeline.from_pretrained(model_dir, dtype=torch.float32)
        extra = {
            "image": picture,
            "negative_prompt": encode["negative_prompt"],
            "guidance_scale": sampler["true_cfg_scale"],
            "num_frames": sampler["length"],
            "max_sequence_length": encode["max_sequence_length"],
        }
    elif family == "flux_kontext":
        pipe = FluxKontextPipeline.from_pretrained(model_dir, dtype=torch.float32)
        extra = {
            "image": picture,
            "guidance_scale": sampler["guidance_scale"],
            "max_area": sampler["width"] * sampler["height"],
            "max_sequence_length": encode["max_sequence_length"],
        }
    else:
        pipe = QwenImageEditPlusPipeline.from_pretrained(model_dir, dtype=torch.float32)
        extra = {
            "image": [picture],
            "negative_prompt": encode["negative_prompt"],
            "true_cfg_scale": sampler["true_cfg_scale"],
        }
    pipe.set_progress_bar_config(disable=True)
    output = pipe(
        prompt=encode["prompt"],
        num_inference_steps=sampler["steps"],
        width=sampler["width"],
        height=sampler["height"],
        generator=[torch.Generator("cpu").manual_seed(sampler["seed"])],
        output_type="pt",
        **extra,
    )
    images = output.frames.flatten(0, 1) if family == "wan_i2v" else output.images  # a clip: its frames
    return np.clip(255.0 * images.permute(0, 2, 3, 1).numpy(), 0, 255).astype(np.uint8)


def saved_pngs(server: ComfyUIServer, prompt_id: str) -> np.ndarray:
    """Every saved image's pixels; an animated file's (SaveAnimatedWEBP) frame by frame."""
    from PIL import Image, ImageSequence

    files = [Image.open(io.BytesIO(server.view(**image))) for image in server.output_images(prompt_id)]
    return np.stack([np.asarray(frame.convert("RGB")) for file in files for frame in ImageSequence.Iterator(file)])


@pytest.mark.multirank
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=[pytest.mark.four_ranks] * (name in FOUR_RANKS) + [pytest.mark.slow] * (name in SLOW),
        )
        for name in EXAMPLES
        if name not in RUN_ELSEWHERE
    ],
)
def test_example_runs_headless_and_equals_the_one_shot_pipeline(
    comfyui_server, tiny_models, tiny_loras, comfyui_loras_dir, name
):
    workflow, family = small(name, tiny_models, tiny_loras)
    starts_from_image = any("latent_image" in sampler for sampler in samplers(workflow))
    loads = [n["inputs"]["image"] for n in workflow.values() if n["class_type"] == "LoadImage"]
    if IMAGE_PLACEHOLDER in loads:
        picture = np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
        from PIL import Image

        Image.fromarray(picture).save(comfyui_server.input_dir / IMAGE_PLACEHOLDER)
    shipped = set(SHIPPED_PICTURES) & set(loads)
    if shipped:  # the shipped pictures, where `python -m parallel_runtime.examples` puts them
        copy_shipped_inputs(str(comfyui_server.input_dir))
    prompt_id, _ = comfyui_server.run(workflow, timeout=300)
    got = saved_pngs(comfyui_server, prompt_id)
    if shipped:
        expected = edit_reference(family, tiny_models[family], workflow, comfyui_server.input_dir)
    elif starts_from_image:
        expected = image_reference(family, tiny_models[family], workflow, comfyui_server.input_dir)
    else:
        expected = reference_images(family, tiny_models[family], workflow, Path(comfyui_loras_dir))
    assert got.shape == expected.shape, (got.shape, expected.shape)
    diff = np.abs(got.astype(np.int16) - expected.astype(np.int16))
    assert diff.max() <= 1, f"{name}: max |diff| {diff.max()} levels; {(diff > 1).sum()} values differ by more than 1"
