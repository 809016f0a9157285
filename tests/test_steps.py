"""The nodes' steps (``parallel_runtime.jobs``, what each node's execute calls) as plain Python on a 2-rank CPU backend
and a tiny FLUX.1: the image equals diffusers' one-shot pipeline, a warm run loads nothing, staged frees the text
encoders, bad widgets fail before any load. tests/test_node_schemas.py runs the node classes themselves."""

from __future__ import annotations

import os

import pytest
import torch
from diffusers import AutoencoderKL, FluxPipeline
from diffusers.image_processor import VaeImageProcessor

from parallel_runtime import (
    BackendSpec,
    InvalidInput,
    current_backend,
    default_spec,
    get_backend,
    jobs,
    shutdown_backend,
)
from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux

pytestmark = pytest.mark.multirank

MODEL = "tiny-flux"
PROMPT = "a red cat on a blue sky"
SIZE, STEPS = 64, 3


@pytest.fixture(scope="module")
def models_dir(models_root):
    make_tiny_flux(str(models_root / MODEL))
    return models_root


def staged_spec(policy: str = "staged") -> BackendSpec:
    return default_spec(ranks=2, device="cpu", memory_policy=policy)


def run_graph(spec: BackendSpec, *, seed: int, batch_size: int = 1, prompt: str = PROMPT):
    positive = jobs.encode_prompt(spec, model=MODEL, prompt=prompt)
    transformer = jobs.plan_transformer(spec, model=MODEL, strategy="device_map")
    latent = jobs.sample(
        transformer,
        positive,
        seed=seed,
        steps=STEPS,
        guidance_scale=3.5,
        width=SIZE,
        height=SIZE,
        batch_size=batch_size,
    )
    return latent, jobs.decode(spec, model=MODEL, samples=latent)


def rank0(spec: BackendSpec):
    return get_backend(spec).status().ranks[0]


def test_image_equals_one_shot_pipeline(models_dir):
    spec = staged_spec()
    latent, image = run_graph(spec, seed=7, batch_size=2)
    pipe = FluxPipeline.from_pretrained(models_dir / MODEL)
    reference = pipe(
        PROMPT,
        num_inference_steps=STEPS,
        guidance_scale=3.5,
        width=SIZE,
        height=SIZE,
        num_images_per_prompt=2,
        output_type="pt",
        generator=[torch.Generator("cpu").manual_seed(7 + i) for i in range(2)],
    ).images  # image i: seed+i
    assert image.shape == (2, SIZE, SIZE, 3) and image.dtype == torch.float32
    assert 0 <= image.min() and image.max() <= 1
    assert (image - reference.permute(0, 2, 3, 1)).abs().max() <= 1e-5
    assert latent.shape == (2, 16, SIZE // 8, SIZE // 8)


def test_second_run_with_a_new_seed_loads_no_weights(models_dir):
    """ComfyUI re-runs only the nodes whose inputs changed: with a new seed, the sampler and the decoder."""
    spec = staged_spec()
    get_backend(spec).free()  # start cold, so the first run loads every stage
    positive = jobs.encode_prompt(spec, model=MODEL, prompt=PROMPT)
    transformer = jobs.plan_transformer(spec, model=MODEL, strategy="device_map")
    images, loads = [], []
    for seed in (1, 2):
        latent = jobs.sample(transformer, positive, seed=seed, steps=STEPS, guidance_scale=3.5, width=SIZE, height=SIZE)
        images.append(jobs.decode(spec, model=MODEL, samples=latent))
        loads.append(rank0(spec).load_counts)
    assert loads[1] == loads[0]
    assert not torch.equal(images[0], images[1])


def test_staged_frees_text_encoders_before_the_transformer_loads(models_dir):
    spec = staged_spec()
    positive = jobs.encode_prompt(spec, model=MODEL, prompt="a green tree")
    assert "text_encoders" in {m.component for m in rank0(spec).resident}
    transformer = jobs.plan_transformer(spec, model=MODEL, strategy="device_map")
    jobs.sample(transformer, positive, seed=0, steps=1, guidance_scale=3.5, width=SIZE, height=SIZE)
    resident = {m.component for m in rank0(spec).resident}
    assert "transformer" in resident and "text_encoders" not in resident
    log = open(os.path.join(get_backend(spec).run_dir, "rank0.log")).read()
    freed, loaded = log.rfind("freed text_encoders:tiny-flux"), log.rfind("loaded transformer:tiny-flux")
    assert 0 <= freed < loaded


def test_decode_accepts_a_comfyui_latent(models_dir):
    """A LATENT as ComfyUI's samplers make it (un-normalised VAE space) decodes like ComfyUI's VAEDecode would."""
    torch.manual_seed(0)
    samples = torch.randn(1, 16, SIZE // 8, SIZE // 8)
    image = jobs.decode(staged_spec(), model=MODEL, samples=samples)
    vae = AutoencoderKL.from_pretrained(models_dir / MODEL, subfolder="vae")
    with torch.no_grad():
        expected = VaeImageProcessor().postprocess(vae.decode(samples).sample, output_type="pt").permute(0, 2, 3, 1)
    assert (image - expected).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "widget, kwargs, hint",
    [
        ("width", {"width": 1000}, "use 992 or 1008"),
        ("height", {"height": 8}, "use 16"),
        ("steps", {"steps": 0}, "at least 1"),
        ("batch_size", {"batch_size": 0}, "at least 1"),
    ],
)
def test_bad_sampler_widgets_name_the_widget_and_the_fix(models_dir, widget, kwargs, hint):
    spec = staged_spec()
    positive = jobs.encode_prompt(spec, model=MODEL, prompt=PROMPT)
    loads = rank0(spec).load_counts
    transformer = jobs.plan_transformer(spec, model=MODEL, strategy="device_map")
    args = {"seed": 0, "steps": STEPS, "guidance_scale": 3.5, "width": SIZE, "height": SIZE, "batch_size": 1, **kwargs}
    with pytest.raises(InvalidInput, match=hint) as info:
        jobs.sample(transformer, positive, **args)
    assert info.value.widget == widget
    assert rank0(spec).load_counts == loads


@pytest.mark.parametrize(
    "widget, call",
    [
        ("model", lambda spec: jobs.encode_prompt(spec, model="no-such-model", prompt=PROMPT)),
        ("model", lambda spec: jobs.plan_transformer(spec, model="../escape", strategy="device_map")),
        ("max_memory", lambda spec: jobs.encode_prompt(spec, model=MODEL, prompt=PROMPT, max_memory="lots")),
        (
            "max_memory",
            lambda spec: jobs.plan_transformer(spec, model=MODEL, strategy="device_map", max_memory="0:16XB"),
        ),
        ("prompt", lambda spec: jobs.encode_prompt(spec, model=MODEL, prompt="   ")),
        ("device", lambda spec: jobs.decode(spec, model=MODEL, samples=torch.zeros(1, 16, 8, 8), device="cuda:7")),
        ("samples", lambda spec: jobs.decode(spec, model=MODEL, samples=torch.zeros(1, 4, 8, 8))),
    ],
)
def test_bad_widgets_fail_before_anything_runs(models_dir, widget, call):
    shutdown_backend()
    spec = staged_spec()
    with pytest.raises(InvalidInput) as info:
        call(spec)
    assert info.value.widget == widget and str(info.value).startswith(f"{widget}:")
    assert current_backend() is None or not current_backend().running  # nothing started, nothing loaded


# Last: it needs a backend of another spec, which replaces the staged one the tests above share.
def test_resident_policy_keeps_everything(models_dir):
    spec = staged_spec("resident")
    run_graph(spec, seed=0)
    assert {m.component for m in rank0(spec).resident} == {"text_encoders", "transformer", "vae"}
    loads = rank0(spec).load_counts
    run_graph(spec, seed=0, prompt="a blue dog")  # a new prompt re-encodes without reloading anything
    assert rank0(spec).load_counts == loads
