"""Qwen-Image-Edit Plus (``families/qwenimage_edit``): one to three images edited on CPU ranks through the pack's steps
(EncodeOnBalancedGPUs with the images, plan, ParallelSampler, decode) equal diffusers' ``QwenImageEditPlusPipeline``
one-shot with the same images and seeds, under true CFG (its per-token norm rescale) and 2511's ``zero_cond_t``; the
images are refused by name where the model takes none, required where it edits, and checked (batch, aspect, the
sequence's split) before anything loads."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from comfyui_host import PromptRejected
from comfyui_workflows import progress_texts, prompt_window
from diffusers import QwenImageEditPlusPipeline
from PIL import Image

from parallel_runtime import InvalidInput, default_spec, jobs
from parallel_runtime.families import family
from parallel_runtime.families.base import pil_images
from parallel_runtime.families.tiny import make_tiny_model

EDIT, QWEN = "tiny-qwen-image-edit", "tiny-qwenimage"
# With an image, 196 and 194 text tokens (each image adds 186: its vision tokens and "Picture n: "), which split.
PROMPT, NEGATIVE = "a photo of a horse", "a blue painting"
SEED, STEPS, TRUE_CFG = 5, 2, 4.0
# The output: 4×3 tokens. The image, 56×40, is seen by the text encoder at 448×320 and VAE-encoded at 1216×864 (76×54
# tokens): a sequence of 12 + 4104 tokens, which plain Ulysses over 2 ranks splits; so do the prompts' lengths.
WIDTH, HEIGHT = 64, 48


def edit_image(seed: int = 11, width: int = 56, height: int = 40) -> torch.Tensor:
    """A random IMAGE [1, H, W, 3] as LoadImage makes it: 8-bit pixels / 255."""
    pixels = torch.randint(0, 256, (1, height, width, 3), generator=torch.Generator().manual_seed(seed))
    return pixels.float() / 255


def spec(ranks: int = 2):
    return default_spec(ranks=ranks, device="cpu", memory_policy="staged")


@pytest.fixture(scope="module")
def edit_dir(models_root):
    """The module's model folder with a tiny Qwen-Image-Edit-2511 and a tiny Qwen-Image."""
    make_tiny_model("qwenimage_edit", str(models_root / EDIT))
    make_tiny_model("qwenimage", str(models_root / QWEN))
    return models_root


@pytest.fixture(scope="module")
def one_shot(edit_dir):
    """(images, batch_size) -> diffusers' QwenImageEditPlusPipeline's IMAGE, image i from SEED + i, made once."""
    pipe = QwenImageEditPlusPipeline.from_pretrained(edit_dir / EDIT, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    cache = {}

    def reference(images: int = 1, batch_size: int = 1) -> torch.Tensor:
        if (images, batch_size) not in cache:
            cache[images, batch_size] = pipe(
                image=[pil_images(edit_image(11 + i))[0] for i in range(images)],
                prompt=PROMPT,
                negative_prompt=NEGATIVE,
                true_cfg_scale=TRUE_CFG,
                num_inference_steps=STEPS,
                width=WIDTH,
                height=HEIGHT,
                num_images_per_prompt=batch_size,
                generator=[torch.Generator("cpu").manual_seed(SEED + i) for i in range(batch_size)],
                output_type="pt",
            ).images.permute(0, 2, 3, 1)
        return cache[images, batch_size]

    return reference


def edit(backend, strategy: dict, images: int = 1, batch_size: int = 1) -> torch.Tensor:
    given = dict(zip(("image", "image_2", "image_3"), (edit_image(11 + i) for i in range(images))))
    positive = jobs.encode_prompt(backend, model=EDIT, prompt=PROMPT, negative_prompt=NEGATIVE, **given)
    assert [image.name for image in positive.images] == list(given)
    transformer = jobs.plan_transformer(backend, model=EDIT, **strategy)
    latent = jobs.sample(
        transformer,
        positive,
        seed=SEED,
        steps=STEPS,
        guidance_scale=1.0,
        width=WIDTH,
        height=HEIGHT,
        batch_size=batch_size,
        true_cfg_scale=TRUE_CFG,
    )
    assert latent.shape == (batch_size, 16, 1, HEIGHT // 8, WIDTH // 8)  # the size asked for, the images cut off
    return jobs.decode(backend, model=EDIT, samples=latent)


STRATEGIES = [
    pytest.param({"strategy": "cfg_parallel"}, 1, 1, id="cfg_parallel"),
    pytest.param({"strategy": "context_parallel", "ulysses_degree": 2}, 1, 1, id="ulysses"),
    pytest.param({"strategy": "device_map"}, 1, 1, id="device_map", marks=pytest.mark.slow),
    pytest.param({"strategy": "context_parallel", "ring_degree": 2}, 2, 1, id="ring-2-images", marks=pytest.mark.slow),
    pytest.param({"strategy": "tensor_parallel", "tp_degree": 2}, 3, 1, id="tp-3-images", marks=pytest.mark.slow),
    pytest.param({"strategy": "data_parallel"}, 1, 2, id="data_parallel", marks=pytest.mark.slow),
]


@pytest.mark.multirank
@pytest.mark.parametrize("strategy, images, batch_size", STRATEGIES)
def test_edit_equals_edit_plus_pipeline(one_shot, strategy, images, batch_size):
    image = edit(spec(), strategy, images, batch_size)
    diff = (image - one_shot(images, batch_size)).abs().max().item()
    print(f"{strategy}, {images} images: max |diff| vs QwenImageEditPlusPipeline {diff:.3g}")
    assert diff <= 1e-4


@pytest.mark.multirank
@pytest.mark.slow
def test_cfg_parallel_with_ulysses_on_4_ranks_equals_pipeline(one_shot):
    image = edit(spec(4), {"strategy": "cfg_parallel", "ulysses_degree": 2})
    diff = (image - one_shot()).abs().max().item()
    print(f"cfg × ulysses on 4 ranks: max |diff| vs QwenImageEditPlusPipeline {diff:.3g}")
    assert diff <= 1e-4


def test_sizes_are_the_pipelines():
    """The sizes the node shows are the pipeline's: about 384² for the text encoder, 1024² for the VAE."""
    qwen_edit = family("qwenimage_edit")
    assert qwen_edit.condition_size(56, 40) == (448, 320)
    assert qwen_edit.reference_size(56, 40) == (1216, 864)
    assert qwen_edit.reference_size(500, 500) == (1024, 1024)


def test_edit_folder_is_its_own_family(edit_dir):
    transformer = jobs.plan_transformer(spec(), model=EDIT, strategy="device_map")
    assert transformer.family.key == "qwenimage_edit"
    assert jobs.plan_transformer(spec(), model=QWEN, strategy="device_map").family.key == "qwenimage"


@pytest.mark.parametrize(
    "model, given, widget, hint",
    [
        (EDIT, {}, "image", "is not linked, and tiny-qwen-image-edit .Qwen-Image-Edit. edits images"),
        (EDIT, {"images_linked": ("image_2",)}, None, None),
        (QWEN, {"images_linked": ("image",)}, "image", "text encoder reads no image; unlink it"),
        (EDIT, {"image": edit_image()[[0, 0]]}, "image", "holds 2 images; each image input takes one"),
        (EDIT, {"image_3": edit_image(width=3000, height=10)}, "image_3", "too narrow for Qwen-Image-Edit"),
        (
            EDIT,
            {"image": edit_image(), "prompt": "a cat\na dog", "one_prompt_per_line": True},
            "one_prompt_per_line",
            "one prompt at a time",
        ),
    ],
)
def test_images_refused_by_name_before_anything_loads(edit_dir, model, given, widget, hint):
    settings = {"model": model, "prompt": PROMPT, **given}
    if widget is None:
        assert jobs.validate_encode(**settings).images == ()  # linked: checked when it runs
        return
    with pytest.raises(InvalidInput, match=hint) as info:
        jobs.validate_encode(**settings)
    assert info.value.widget == widget


def test_sampler_refuses_what_the_edit_model_cannot_run(edit_dir):
    """The sampler's own image input and a latent_image are refused for the edit model, and a sequence that does
    not split names the fix."""
    transformer = jobs.plan_transformer(spec(), model=EDIT, strategy="context_parallel", ulysses_degree=2)
    settings = {"steps": STEPS, "width": WIDTH, "height": HEIGHT, "batch_size": 1, "true_cfg_scale": TRUE_CFG}
    with pytest.raises(InvalidInput, match="link the image to EncodeOnBalancedGPUs' image input") as info:
        jobs.validate_sample(transformer, None, references_linked=("image",), **settings)
    assert info.value.widget == "image"
    with pytest.raises(InvalidInput, match="no img2img") as info:
        jobs.validate_sample(transformer, None, latent_linked=True, **settings)
    assert info.value.widget == "latent_image"
    # 80×48 makes 15 output tokens, and 15 + 4104 does not split over 2 ranks.
    request = jobs.validate_encode(model=EDIT, prompt=PROMPT, negative_prompt=NEGATIVE, image=edit_image())
    embeds = {"prompt_embeds": torch.zeros(1, 200, 32), "negative_prompt_embeds": torch.zeros(1, 200, 32)}
    positive = jobs.Conditioning(request.model, (PROMPT,), embeds, images=request.images)
    with pytest.raises(
        InvalidInput, match=r"image 4104 .1216×864.. make a sequence of 4119, which does not split over 2 ranks"
    ) as info:
        jobs.validate_sample(transformer, positive, **{**settings, "width": 80})
    assert info.value.widget == "width"
    unseen = jobs.Conditioning(request.model, (PROMPT,), embeds)
    with pytest.raises(InvalidInput, match="carries no image") as info:
        jobs.validate_sample(transformer, unseen, **settings)
    assert info.value.widget == "positive"


# -- in a real ComfyUI: LoadImage -> EncodeOnBalancedGPUs' image, and the image refused by name at validation (a 400) --
def edit_workflow(model: str, image: str | None) -> dict:
    """LoadImage (``image``, a file in ComfyUI's input/; None: none linked) edited by ``model`` with true CFG split over
    2 CPU ranks (cfg_parallel), decoded and saved."""

    def link(node: str) -> list:
        return [node, 0]

    nodes = {
        "1": ("ParallelBackend", {"ranks": 2, "device": "cpu", "memory_policy": "staged"}),
        "2": ("EncodeOnBalancedGPUs", {"model": model, "prompt": PROMPT, "negative_prompt": NEGATIVE}),
        "3": ("LoadShardedTransformer", {"model": model, "strategy": "cfg_parallel"}),
        "4": (
            "ParallelSampler",
            {"seed": SEED, "steps": STEPS, "guidance_scale": 1.0, "true_cfg_scale": TRUE_CFG},
        ),
        "5": ("VAEDecodeSingleGPU", {"model": model, "device": "cpu"}),
        "6": ("SaveImage", {"filename_prefix": "qwen_edit"}),
    }
    nodes["2"][1]["backend"] = nodes["3"][1]["backend"] = nodes["5"][1]["backend"] = link("1")
    nodes["4"][1].update(transformer=link("3"), positive=link("2"), batch_size=1, width=WIDTH, height=HEIGHT)
    nodes["5"][1]["samples"] = link("4")
    nodes["6"][1]["images"] = link("5")
    if image is not None:
        nodes["7"] = ("LoadImage", {"image": image})
        nodes["2"][1]["image"] = link("7")
    return {node_id: {"class_type": kind, "inputs": inputs} for node_id, (kind, inputs) in nodes.items()}


@pytest.fixture(scope="module")
def comfyui_edit(comfyui_server, comfyui_models_dir):
    """The tiny Qwen-Image-Edit (and Qwen-Image) in the server's diffusers folder, and the image in its input/."""
    for key, name in (("qwenimage_edit", EDIT), ("qwenimage", QWEN)):
        if not (comfyui_models_dir / name / "model_index.json").is_file():
            make_tiny_model(key, str(comfyui_models_dir / name))
    pil_images(edit_image())[0].save(comfyui_server.input_dir / "qwen_edit.png")
    return comfyui_server


@pytest.mark.comfyui
def test_image_refused_by_name_in_the_host(comfyui_edit):
    for model, image, hint in (
        (EDIT, None, "image: is not linked, and tiny-qwen-image-edit (Qwen-Image-Edit) edits images"),
        (QWEN, "qwen_edit.png", "image: is linked, but tiny-qwenimage's (Qwen-Image) text encoder reads no image"),
    ):
        with pytest.raises(PromptRejected) as rejected:
            comfyui_edit.post_prompt(edit_workflow(model, image))
        assert rejected.value.status == 400 and "2" in rejected.value.node_errors
        (error,) = rejected.value.node_errors["2"]["errors"]
        assert hint in error["details"], error


@pytest.mark.comfyui
@pytest.mark.multirank
@pytest.mark.slow
def test_load_image_to_save_image_in_the_host(comfyui_edit, one_shot):
    prompt_id, _ = comfyui_edit.run(edit_workflow(EDIT, "qwen_edit.png"), timeout=900)
    shown = progress_texts(prompt_window(comfyui_edit, prompt_id), "2")
    assert "image 56×40: the text encoder sees it at 448×320, the transformer at 1216×864" in shown, shown
    (saved,) = comfyui_edit.output_images(prompt_id)
    got = np.asarray(Image.open(io.BytesIO(comfyui_edit.view(**saved))).convert("RGB")).astype(np.int16)
    # ComfyUI's SaveImage quantises as uint8(clip(255 * x)).
    expected = np.clip(255.0 * one_shot()[0].numpy(), 0, 255).astype(np.uint8).astype(np.int16)
    assert got.shape == (HEIGHT, WIDTH, 3)
    assert np.abs(got - expected).max() <= 1
