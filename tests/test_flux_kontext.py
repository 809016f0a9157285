"""FLUX.1 Kontext [dev] (``families/flux_kontext``): a reference image edited on 2 CPU ranks through the pack's steps
(encode, plan, sample with ParallelSampler's ``image``, decode) equals diffusers' ``FluxKontextPipeline`` one-shot
with the same image and seeds; the image is refused by name where the model takes none, and required where it
edits one, before anything loads."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from comfyui_workflows import progress_texts, prompt_window, references_workflow, refusal
from diffusers import FluxKontextPipeline
from helpers import MODEL, PROMPT, STEPS, TOKENS, with_references
from PIL import Image

from parallel_runtime import InvalidInput, default_spec, jobs
from parallel_runtime.families import family
from parallel_runtime.families.base import pil_images
from parallel_runtime.families.tiny import make_tiny_model

KONTEXT = "tiny-flux-kontext"
SEED, GUIDANCE = 4, 2.5
# The output: 4×3 tokens. The reference, 56×40 (48×32 in whole tokens, aspect 1.5), runs at Kontext's 1248×832 (78×52
# tokens): the sequence is 12 + 4056 tokens, which plain Ulysses over 2 ranks splits.
WIDTH, HEIGHT = 64, 48
SAMPLER = {"seed": SEED, "steps": STEPS, "guidance_scale": GUIDANCE, "width": WIDTH, "height": HEIGHT}
REFERENCE_SIZE = (1248, 832)


def reference_image(batch: int = 1) -> torch.Tensor:
    """A random IMAGE as LoadImage makes it: 8-bit pixels / 255."""
    pixels = torch.randint(0, 256, (batch, 40, 56, 3), generator=torch.Generator().manual_seed(11))
    return pixels.float() / 255


def spec():
    return default_spec(ranks=2, device="cpu", memory_policy="staged")


@pytest.fixture(scope="module")
def kontext_dir(models_root):
    """The module's model folder with a tiny FLUX.1 Kontext and a tiny FLUX.1."""
    make_tiny_model("flux_kontext", str(models_root / KONTEXT))
    make_tiny_model("flux", str(models_root / MODEL))
    return models_root


@pytest.fixture(scope="module")
def one_shot(kontext_dir):
    """batch_size -> diffusers' FluxKontextPipeline's IMAGE of the reference image, image i from SEED + i, made once."""
    pipe = FluxKontextPipeline.from_pretrained(kontext_dir / KONTEXT, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    cache = {}

    def reference(batch_size: int) -> torch.Tensor:
        if batch_size not in cache:
            cache[batch_size] = pipe(
                image=pil_images(reference_image())[0],
                prompt=PROMPT,
                num_inference_steps=STEPS,
                guidance_scale=GUIDANCE,
                width=WIDTH,
                height=HEIGHT,
                max_area=WIDTH * HEIGHT,
                max_sequence_length=TOKENS,
                num_images_per_prompt=batch_size,
                generator=[torch.Generator("cpu").manual_seed(SEED + i) for i in range(batch_size)],
                output_type="pt",
            ).images.permute(0, 2, 3, 1)
        return cache[batch_size]

    return reference


STRATEGIES = [
    pytest.param({"strategy": "device_map"}, 1, id="device_map"),
    pytest.param({"strategy": "context_parallel", "ulysses_degree": 2}, 1, id="ulysses"),
    pytest.param({"strategy": "context_parallel", "ring_degree": 2}, 1, id="ring", marks=pytest.mark.slow),
    pytest.param({"strategy": "tensor_parallel", "tp_degree": 2}, 1, id="tp", marks=pytest.mark.slow),
    pytest.param({"strategy": "data_parallel"}, 2, id="data_parallel", marks=pytest.mark.slow),
]


@pytest.mark.multirank
@pytest.mark.parametrize("strategy, batch_size", STRATEGIES)
def test_edit_equals_kontext_pipeline(one_shot, strategy, batch_size):
    latent, image = with_references(
        KONTEXT, strategy, tokens=TOKENS, sampler=SAMPLER, batch_size=batch_size, image=reference_image()
    )
    assert latent.shape == (batch_size, 16, HEIGHT // 8, WIDTH // 8)  # the size asked for, the reference cut off
    diff = (image - one_shot(batch_size)).abs().max().item()
    print(f"{strategy}: max |diff| vs FluxKontextPipeline {diff:.3g}")
    assert diff <= 1e-4


def test_reference_size_is_the_pipelines():
    """The size the node shows is the one FluxKontextPipeline's _auto_resize picks (1024² for a square)."""
    kontext = family("flux_kontext")
    assert kontext.reference_size(500, 500) == (1024, 1024)
    assert kontext.reference_size(56, 40) == REFERENCE_SIZE
    assert kontext.reference_size(40, 100) == (672, 1568)


def test_kontext_folder_is_its_own_family(kontext_dir):
    transformer = jobs.plan_transformer(spec(), model=KONTEXT, strategy="device_map")
    assert transformer.family.key == "flux_kontext"
    assert jobs.plan_transformer(spec(), model=MODEL, strategy="device_map").family.key == "flux"


@pytest.mark.parametrize(
    "model, strategy, given, hint",
    [
        (KONTEXT, {"strategy": "device_map"}, {}, "is not linked, and tiny-flux-kontext .FLUX.1 Kontext. edits"),
        (MODEL, {"strategy": "device_map"}, {"references_linked": ("image",)}, "reads no reference image; unlink it"),
        (KONTEXT, {"strategy": "device_map"}, {"references_linked": ("image",), "latent_linked": True}, None),
    ],
)
def test_image_refused_by_name_before_anything_loads(kontext_dir, model, strategy, given, hint):
    transformer = jobs.plan_transformer(spec(), model=model, **strategy)
    with pytest.raises(InvalidInput, match=hint or "no img2img") as info:
        jobs.validate_sample(transformer, None, steps=1, width=WIDTH, height=HEIGHT, batch_size=1, **given)
    assert info.value.widget == ("latent_image" if hint is None else "image")


def test_sequence_that_does_not_split_is_refused(kontext_dir):
    """An 80×48 output's 15 tokens and the reference's 4056 make 4071, which 2 ranks do not split: the image is
    named, with the fix."""
    transformer = jobs.plan_transformer(spec(), model=KONTEXT, strategy="context_parallel", ulysses_degree=2)
    (image,) = jobs.read_reference_images(transformer, {"image": reference_image()})
    assert (image.width, image.height) == REFERENCE_SIZE
    assert image.describe() == "reference image 56×40, resized to 1248×832"
    with pytest.raises(InvalidInput, match="sequence of 4071, which does not split over 2 ranks") as info:
        jobs.validate_sample(transformer, None, steps=1, width=80, height=HEIGHT, batch_size=1, references=(image,))
    assert info.value.widget == "image"


# -- in a real ComfyUI: LoadImage -> ParallelSampler's image, and the image refused by name at validation (a 400) ------
def kontext_workflow(model: str, image: str | None) -> dict:
    """LoadImage (``image``, a file in ComfyUI's input/; None: none linked) edited by ``model``."""
    linked = {"image": image} if image is not None else {}
    return references_workflow(model, linked, prompt=PROMPT, tokens=TOKENS, sampler=SAMPLER)


@pytest.fixture(scope="module")
def comfyui_kontext(comfyui_server, comfyui_models_dir):
    """The tiny Kontext (and FLUX.1) in the server's diffusers folder, and the reference image in its input/."""
    for key, name in (("flux_kontext", KONTEXT), ("flux", MODEL)):
        if not (comfyui_models_dir / name / "model_index.json").is_file():
            make_tiny_model(key, str(comfyui_models_dir / name))
    pil_images(reference_image())[0].save(comfyui_server.input_dir / "kontext.png")
    return comfyui_server


@pytest.mark.comfyui
def test_image_refused_by_name_in_the_host(comfyui_kontext):
    for model, image, hint in (
        (KONTEXT, None, "image: is not linked, and tiny-flux-kontext (FLUX.1 Kontext) edits an image"),
        (MODEL, "kontext.png", "image: is linked, but tiny-flux (FLUX.1) reads no reference image; unlink it"),
    ):
        details = refusal(comfyui_kontext, kontext_workflow(model, image), "4")
        assert hint in details, details


@pytest.mark.comfyui
@pytest.mark.multirank
@pytest.mark.slow
def test_load_image_to_save_image_in_the_host(comfyui_kontext, one_shot):
    prompt_id, _ = comfyui_kontext.run(kontext_workflow(KONTEXT, "kontext.png"), timeout=600)
    shown = progress_texts(prompt_window(comfyui_kontext, prompt_id), "4")
    assert any("64×48 from the reference image 56×40, resized to 1248×832" in text for text in shown), shown
    (saved,) = comfyui_kontext.output_images(prompt_id)
    got = np.asarray(Image.open(io.BytesIO(comfyui_kontext.view(**saved))).convert("RGB")).astype(np.int16)
    # ComfyUI's SaveImage quantises as uint8(clip(255 * x)).
    expected = np.clip(255.0 * one_shot(1)[0].numpy(), 0, 255).astype(np.uint8).astype(np.int16)
    assert got.shape == (HEIGHT, WIDTH, 3)
    assert np.abs(got - expected).max() <= 1
