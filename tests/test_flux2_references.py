"""FLUX.2 with reference images (``families/flux2``, ParallelSampler's ``image``, ``image_2``, ``image_3``): two
references on 2 CPU ranks through the pack's steps (encode, plan, sample, decode) equal diffusers'
``Flux2Pipeline(image=[...])`` one-shot with the same images and seeds; the size the node shows is the one the
pipeline runs each at; the references are optional (FLUX.2 still makes images from text alone, test_strategies),
refused by name beyond three, out of order, of a size the pipeline refuses, and where the longer sequence does not
split, before anything loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from comfyui_workflows import assert_close_uint8, progress_texts, prompt_window, references_workflow, refusal, saved_png
from diffusers import Flux2Pipeline
from helpers import NEW_FAMILIES, PROMPT, STEPS, with_references

from parallel_runtime import InvalidInput, default_spec, jobs
from parallel_runtime.families import family
from parallel_runtime.families.base import pil_images
from parallel_runtime.families.tiny import make_tiny_model

MODEL, TOKENS = NEW_FAMILIES["flux2"]["model"], NEW_FAMILIES["flux2"]["max_sequence_length"]
SEED, GUIDANCE = 5, 4.0
# The output: 4×4 tokens. The references: 72×64, center-cropped by the pipeline to 64×64 (16 tokens), and 64×96 (24
# tokens): a sequence of 56 image tokens, and 48 text tokens, which plain Ulysses and Ring over 2 ranks split.
WIDTH, HEIGHT = 64, 64
SAMPLER = {"seed": SEED, "steps": STEPS, "guidance_scale": GUIDANCE, "width": WIDTH, "height": HEIGHT}
SIZES = ((72, 64), (64, 96))


def reference(width: int, height: int, seed: int, batch: int = 1) -> torch.Tensor:
    """A random IMAGE as LoadImage makes it: 8-bit pixels / 255."""
    pixels = torch.randint(0, 256, (batch, height, width, 3), generator=torch.Generator().manual_seed(seed))
    return pixels.float() / 255


REFERENCES = {name: reference(*size, seed=20 + i) for i, (name, size) in enumerate(zip(("image", "image_2"), SIZES))}


def spec():
    return default_spec(ranks=2, device="cpu", memory_policy="staged")


@pytest.fixture(scope="module")
def flux2_dir(models_root):
    make_tiny_model("flux2", str(models_root / MODEL))
    return models_root


@pytest.fixture(scope="module")
def pipe(flux2_dir):
    """diffusers' Flux2Pipeline of the tiny FLUX.2, in float32 as the CPU ranks run it."""
    pipe = Flux2Pipeline.from_pretrained(flux2_dir / MODEL, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def one_shot(pipe):
    """(batch_size, with the references) -> diffusers' Flux2Pipeline's IMAGE (with the two references unless told
    otherwise), image i from SEED + i, made once."""
    cache = {}

    def image(batch_size: int, references: bool = True) -> torch.Tensor:
        if (batch_size, references) not in cache:
            images = [pil_images(pixels)[0] for pixels in REFERENCES.values()] if references else None
            cache[batch_size, references] = pipe(
                image=images,
                prompt=PROMPT,
                num_inference_steps=STEPS,
                guidance_scale=GUIDANCE,
                width=WIDTH,
                height=HEIGHT,
                max_sequence_length=TOKENS,
                num_images_per_prompt=batch_size,
                generator=[torch.Generator("cpu").manual_seed(SEED + i) for i in range(batch_size)],
                output_type="pt",
            ).images.permute(0, 2, 3, 1)
        return cache[batch_size, references]

    return image


STRATEGIES = [
    pytest.param({"strategy": "context_parallel", "ulysses_degree": 2}, 1, id="ulysses"),
    pytest.param({"strategy": "device_map"}, 1, id="device_map", marks=pytest.mark.slow),
    pytest.param({"strategy": "context_parallel", "ring_degree": 2}, 1, id="ring", marks=pytest.mark.slow),
    pytest.param({"strategy": "tensor_parallel", "tp_degree": 2}, 1, id="tp", marks=pytest.mark.slow),
    pytest.param({"strategy": "data_parallel"}, 2, id="data_parallel", marks=pytest.mark.slow),
]


@pytest.mark.multirank
@pytest.mark.parametrize("strategy, batch_size", STRATEGIES)
def test_references_equal_flux2_pipeline(one_shot, strategy, batch_size):
    latent, image = with_references(
        MODEL, strategy, tokens=TOKENS, sampler=SAMPLER, batch_size=batch_size, **REFERENCES
    )
    assert latent.shape == (batch_size, 128, HEIGHT // 16, WIDTH // 16)  # the size asked for, the references cut off
    diff = (image - one_shot(batch_size)).abs().max().item()
    print(f"{strategy}: max |diff| vs Flux2Pipeline(image=[...]) {diff:.3g}")
    assert diff <= 1e-4


def test_the_references_change_the_image(one_shot):
    """Not references that the pipeline ignores: the same run without them is another image."""
    assert (one_shot(1, references=False) - one_shot(1)).abs().max() > 1e-3


@pytest.mark.parametrize("size", [(64, 64), (72, 64), (100, 70), (1500, 1000), (1100, 1000), (512, 64)])
def test_reference_size_is_the_pipelines(pipe, monkeypatch, size):
    """What the node shows is what Flux2Pipeline runs: its own call, stopped where it hands the resized images to the
    VAE (a megapixel and more scaled down, then cropped to whole tokens)."""

    class Resized(Exception):
        pass

    def stop(images, **_kwargs):
        raise Resized([tuple(image.shape[-2:][::-1]) for image in images])

    monkeypatch.setattr(pipe, "prepare_image_latents", stop)
    image = pil_images(reference(*size, seed=1))[0]
    with pytest.raises(Resized) as resized:
        pipe(image=[image], prompt_embeds=torch.zeros(1, TOKENS, 3 * 32), width=WIDTH, height=HEIGHT)
    assert resized.value.args[0] == [family("flux2").reference_size(*size)]


@pytest.mark.parametrize("size, hint", [((48, 80), "at least 64 pixels a side"), ((64, 576), "more than 8:1")])
def test_sizes_the_pipeline_refuses_are_refused_by_name(pipe, size, hint):
    with pytest.raises(ValueError):  # the pipeline's own refusal of it
        pipe(image=[pil_images(reference(*size, seed=1))[0]], prompt_embeds=torch.zeros(1, TOKENS, 96))
    transformer = jobs.plan_transformer(spec(), model=MODEL, strategy="device_map")
    with pytest.raises(InvalidInput, match=hint) as info:
        jobs.read_reference_images(transformer, {"image": REFERENCES["image"], "image_2": reference(*size, seed=1)})
    assert info.value.widget == "image_2"


def validate(strategy: dict | None = None, **given) -> None:
    transformer = jobs.plan_transformer(spec(), model=MODEL, **(strategy or {"strategy": "device_map"}))
    jobs.validate_sample(transformer, None, steps=1, width=WIDTH, height=HEIGHT, batch_size=1, **given)


@pytest.mark.parametrize(
    "given, widget, hint",
    [
        ({"references_linked": ("image_2",)}, "image_2", "is linked but image is not.*link this one to image$"),
        ({"references_linked": ("image", "image_3")}, "image_3", "link this one to image_2$"),
        ({"references_linked": ("image",), "latent_linked": True}, "latent_image", "or unlink the reference images"),
    ],
)
def test_references_refused_by_name_before_anything_loads(flux2_dir, given, widget, hint):
    with pytest.raises(InvalidInput, match=hint) as info:
        validate(**given)
    assert info.value.widget == widget


def test_references_are_optional_and_one_image_each(flux2_dir):
    validate()  # text to image, as before
    validate(references_linked=("image", "image_2", "image_3"))
    transformer = jobs.plan_transformer(spec(), model=MODEL, strategy="device_map")
    references = jobs.read_reference_images(transformer, {"image": reference(64, 64, seed=2, batch=2)})
    with pytest.raises(InvalidInput, match="takes one image per reference input") as info:
        validate(references=references)
    assert info.value.widget == "image"


def test_sequence_that_does_not_split_is_refused(flux2_dir):
    """The output's 16 tokens split over 2 ranks; with an 80×80 reference (25 tokens) and a 64×64 one (16) the
    sequence is 57, which they do not: the last reference is named, with the fix. Under anything it runs."""
    transformer = jobs.plan_transformer(spec(), model=MODEL, strategy="context_parallel", ulysses_degree=2)
    references = jobs.read_reference_images(
        transformer, {"image": reference(80, 80, seed=3), "image_2": reference(64, 64, seed=4)}
    )
    assert [r.describe() for r in references] == ["reference image 80×80", "reference image_2 64×64"]
    with pytest.raises(InvalidInput, match="sequence of 57, which does not split over 2 ranks; turn on anything"):
        validate({"strategy": "context_parallel", "ulysses_degree": 2}, references=references)
    validate({"strategy": "context_parallel", "ulysses_degree": 2, "anything": True}, references=references)


def test_more_references_than_a_family_takes_are_refused_by_name(models_root):
    """Kontext takes one reference image: its image_2 is named."""
    make_tiny_model("flux_kontext", str(models_root / "tiny-flux-kontext"))
    kontext = jobs.plan_transformer(spec(), model="tiny-flux-kontext", strategy="device_map")
    with pytest.raises(InvalidInput, match=r"takes 1 reference image \(image\); unlink image_2") as info:
        jobs.validate_sample(
            kontext, None, steps=1, width=64, height=48, batch_size=1, references_linked=("image", "image_2")
        )
    assert info.value.widget == "image_2"


def test_memory_estimate_counts_the_reference_tokens(flux2_dir):
    """The ranks' estimate of a step's activations (``worker/memory.py``) runs over the references' tokens too, at the
    size the pipeline runs them: the two references here add 16 + 24 tokens to the output's 16 and the text's 48."""
    from parallel_runtime.estimates import activation_bytes, hidden_size
    from parallel_runtime.families.base import reference_tokens
    from parallel_runtime.wire import Sampling
    from parallel_runtime.worker.memory import step_activations

    flux2 = family("flux2")
    extra = sum(reference_tokens(flux2, *size) for size in SIZES)
    assert extra == 16 + 24
    transformer = jobs.plan_transformer(spec(), model=MODEL, strategy="context_parallel", ulysses_degree=2)
    sampling = Sampling(seed=SEED, steps=STEPS, guidance_scale=GUIDANCE, width=WIDTH, height=HEIGHT)
    folder = str(flux2_dir / MODEL)
    estimate = step_activations(flux2, folder, transformer.plan, sampling, TOKENS, torch.float32, extra)
    expected = activation_bytes(transformer.plan, hidden_size(transformer.config), 16 + TOKENS + 40, 1, 4)
    assert estimate == expected > step_activations(flux2, folder, transformer.plan, sampling, TOKENS, torch.float32)


def test_memory_estimate_counts_the_vae_only_when_it_encodes_references(flux2_dir):
    """FLUX.2-dev's denoise loads its VAE beside the transformer only to encode reference images: the ranks' estimate
    counts its weights (its parameters × 4 bytes in float32) then, and not for text alone."""
    from safetensors import safe_open

    from parallel_runtime.worker.memory import denoise_component_bytes

    flux2, folder = family("flux2"), flux2_dir / MODEL
    (weights,) = (folder / "vae").glob("*.safetensors")
    with safe_open(str(weights), "pt") as f:
        parameters = sum(f.get_tensor(key).numel() for key in f.keys())
    assert denoise_component_bytes(flux2, str(folder), torch.float32, references=True) == parameters * 4 > 0
    assert denoise_component_bytes(flux2, str(folder), torch.float32, references=False) == 0


# -- in a real ComfyUI: LoadImage -> ParallelSampler's image and image_2, and the inputs refused by name (a 400) -------
KONTEXT = "tiny-flux-kontext"


def workflow(model: str, linked: dict[str, str]) -> dict:
    return references_workflow(model, linked, prompt=PROMPT, tokens=TOKENS, sampler=SAMPLER)


@pytest.fixture(scope="module")
def comfyui_references(comfyui_server, comfyui_models_dir):
    """The tiny FLUX.2 (and Kontext) in the server's diffusers folder, and the two references in its input/."""
    for key, name in (("flux2", MODEL), ("flux_kontext", KONTEXT)):
        if not (comfyui_models_dir / name / "model_index.json").is_file():
            make_tiny_model(key, str(comfyui_models_dir / name))
    for name, pixels in REFERENCES.items():
        pil_images(pixels)[0].save(comfyui_server.input_dir / f"flux2_{name}.png")
    return comfyui_server


@pytest.mark.comfyui
def test_references_refused_by_name_in_the_host(comfyui_references):
    for model, linked, hint in (
        (MODEL, {"image_2": "flux2_image.png"}, "image_2: is linked but image is not"),
        (
            KONTEXT,
            {"image": "flux2_image.png", "image_2": "flux2_image_2.png"},
            "image_2: is linked, but tiny-flux-kontext (FLUX.1 Kontext) takes 1 reference image (image); unlink",
        ),
    ):
        details = refusal(comfyui_references, workflow(model, linked), "4")
        assert hint in details, details


@pytest.mark.comfyui
@pytest.mark.multirank
@pytest.mark.slow
def test_load_image_to_save_image_in_the_host(comfyui_references, one_shot):
    linked = {name: f"flux2_{name}.png" for name in REFERENCES}
    prompt_id, _ = comfyui_references.run(workflow(MODEL, linked), timeout=600)
    shown = progress_texts(prompt_window(comfyui_references, prompt_id), "4")
    said = "64×64 from the reference image 72×64, resized to 64×64; the reference image_2 64×96"
    assert any(said in text for text in shown), shown
    # ComfyUI's SaveImage quantises as uint8(clip(255 * x)).
    expected = np.clip(255.0 * one_shot(1)[0].numpy(), 0, 255).astype(np.uint8)
    assert_close_uint8(saved_png(comfyui_references, prompt_id), expected)
