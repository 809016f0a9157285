"""The FLUX.1 adapter's staged path (encode -> denoise -> decode) against the one-shot FluxPipeline, on a tiny model.

Single process, fp32, CPU. The adapter runs the same pipeline code with components left out, so the staged image
is expected to be bitwise equal; the tolerance only guards against harmless reordering.
"""

import dataclasses
import logging

import pytest
import torch
from diffusers import FluxPipeline

from parallel_runtime.families import Placement, family
from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux
from parallel_runtime.wire import Prompts, Sampling

flux = family("flux")


PROMPT = "a photo of a cat"
# Non-square, so a swapped width / height shows up as a shape error.
WIDTH, HEIGHT = 96, 64
STEPS = 3
GUIDANCE = 3.5
MAX_SEQUENCE_LENGTH = 16
CPU = Placement("cpu")


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> str:
    return make_tiny_flux(str(tmp_path_factory.mktemp("tiny-flux")), seed=0)


@pytest.fixture(scope="module")
def stages(tiny_flux):
    """The three stages' models, loaded once for the module."""
    return (
        flux.load_text_encoders(tiny_flux, torch.float32, CPU),
        flux.load_transformer(tiny_flux, torch.float32, CPU),
        flux.load_vae(tiny_flux, torch.float32, "cpu"),
    )


def one_shot(model_dir: str, seed: int, num_images_per_prompt: int = 1) -> torch.Tensor:
    """The reference: the full pipeline in one call, as an IMAGE [B, H, W, 3]."""
    pipe = FluxPipeline.from_pretrained(model_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        PROMPT,
        num_images_per_prompt=num_images_per_prompt,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        width=WIDTH,
        height=HEIGHT,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(num_images_per_prompt)],
        output_type="pt",
    ).images
    return images.permute(0, 2, 3, 1)


def staged_latents(model_dir: str, stages, seed: int, batch_size: int = 1, on_step=None) -> torch.Tensor:
    text_pipe, transformer, _ = stages
    embeds = flux.encode(text_pipe, Prompts((PROMPT,), max_sequence_length=MAX_SEQUENCE_LENGTH))
    sampling = Sampling(
        seed=seed, steps=STEPS, guidance_scale=GUIDANCE, width=WIDTH, height=HEIGHT, batch_size=batch_size
    )
    return flux.denoise(model_dir, transformer, embeds, sampling, on_step=on_step)


def test_staged_equals_one_shot(tiny_flux, stages):
    samples = staged_latents(tiny_flux, stages, seed=42)
    assert samples.shape == (1, 16, HEIGHT // 8, WIDTH // 8)
    assert samples.dtype == torch.float32

    image = flux.decode(stages[2], samples)
    assert image.shape == (1, HEIGHT, WIDTH, 3)
    assert image.dtype == torch.float32 and image.device.type == "cpu"
    assert 0.0 <= image.min() and image.max() <= 1.0

    reference = one_shot(tiny_flux, seed=42)
    assert (image - reference).abs().max().item() <= 1e-5


def test_latent_is_comfyui_convention(tiny_flux, stages):
    """ComfyUI's VAEDecode decodes LATENT samples as they are: no scale, no shift, no unpacking of its own."""
    vae = stages[2]
    samples = staged_latents(tiny_flux, stages, seed=1)
    with torch.no_grad():
        raw = vae.decode(samples).sample
    # comfy.sd.VAE.decode: process_output = clamp((x + 1) / 2, 0, 1), then channels last.
    comfy_image = torch.clamp((raw + 1.0) / 2.0, min=0.0, max=1.0).movedim(1, -1)
    assert (flux.decode(vae, samples) - comfy_image).abs().max().item() <= 1e-6


def test_batch_of_two_equals_num_images_per_prompt(tiny_flux, stages):
    samples = staged_latents(tiny_flux, stages, seed=7, batch_size=2)
    assert samples.shape == (2, 16, HEIGHT // 8, WIDTH // 8)
    # Image i draws its noise from seed + i, so the two images differ ...
    assert not torch.equal(samples[0], samples[1])
    # ... and the second one alone, from seed + 1, is the same image (how data parallelism splits a batch); equal
    # up to float rounding, since a batch of one multiplies matrices in a different blocking than a batch of two.
    alone = staged_latents(tiny_flux, stages, seed=8)
    assert (alone - samples[1:]).abs().max().item() <= 1e-5

    image = flux.decode(stages[2], samples)
    reference = one_shot(tiny_flux, seed=7, num_images_per_prompt=2)
    assert (image - reference).abs().max().item() <= 1e-5


def test_different_prompts_give_different_embeds(stages):
    embeds = flux.encode(
        stages[0], Prompts(("a photo of a cat", "a painting of a dog"), max_sequence_length=MAX_SEQUENCE_LENGTH)
    )
    assert embeds["prompt_embeds"].shape == (2, MAX_SEQUENCE_LENGTH, 32)
    assert embeds["pooled_prompt_embeds"].shape == (2, 32)
    for name, tensor in embeds.items():
        assert tensor.device.type == "cpu"
        assert not torch.allclose(tensor[0], tensor[1]), name


def test_on_step_reports_every_step_and_can_cancel(tiny_flux, stages):
    seen = []
    staged_latents(tiny_flux, stages, seed=0, on_step=lambda i, total: seen.append((i, total)))
    assert seen == [(i, STEPS) for i in range(STEPS)]

    class Cancelled(Exception):
        pass

    def cancel_after_first(i, total):
        if i == 0:
            raise Cancelled

    with pytest.raises(Cancelled):
        staged_latents(tiny_flux, stages, seed=0, on_step=cancel_after_first)


def test_size_not_divisible_by_16_is_refused(tiny_flux, stages):
    embeds = flux.encode(stages[0], Prompts((PROMPT,), max_sequence_length=MAX_SEQUENCE_LENGTH))
    with pytest.raises(ValueError, match="divisible by 16"):
        flux.denoise(tiny_flux, stages[1], embeds, Sampling(seed=0, steps=1, guidance_scale=1.0, width=72, height=64))


def test_device_map_is_skipped_on_cpu(tiny_flux, caplog):
    balanced = Placement("cpu", device_map="balanced", max_memory={0: "1GB"})
    with caplog.at_level(logging.INFO, logger="parallel_runtime.families"):
        pipe = flux.load_text_encoders(tiny_flux, torch.float32, balanced)
        transformer = flux.load_transformer(tiny_flux, torch.float32, dataclasses.replace(balanced, device_map="auto"))
    assert pipe.text_encoder_2.device.type == "cpu" and transformer.device.type == "cpu"
    assert "device_map='balanced' skipped on CPU" in caplog.text
    assert "device_map='auto' skipped on CPU" in caplog.text
