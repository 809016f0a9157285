"""Img2img, inpainting and the VAE encode at the family level, against diffusers: FLUX.1 and Qwen-Image against their
Img2Img / Inpaint pipelines, FLUX.2 (diffusers 0.42.1 has no FLUX.2-dev img2img pipeline) against a reference loop
written here from the scheduler calls those pipelines make. Single process, fp32, CPU, tiny models (one slow test runs
a FLUX.1 whose VAE has 4 latent channels through the nodes on real ranks).

"The same latents": diffusers' pipelines sample the VAE's posterior with the generator when given pixels, so both
sides start from the posterior's mode (what VAEEncodeSingleGPU gives), normalised for the pipeline as its
``_encode_vae_image`` normalises.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    Flux2Pipeline,
    FluxImg2ImgPipeline,
)
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from diffusers.utils.torch_utils import randn_tensor
from img2img import (
    CPU,
    DENOISE,
    FAMILIES,
    GUIDANCE,
    HEIGHT,
    NEGATIVE,
    PROMPT,
    STEPS,
    WIDTH,
    ours,
    pipeline_latents,
    pixel_mask,
    pixels,
    posterior_mode,
)

from parallel_runtime.families import family as family_adapter
from parallel_runtime.families import img2img_steps
from parallel_runtime.wire import Prompts, Sampling


@pytest.fixture(params=sorted(FAMILIES))
def family(request, load):
    return request.param, *load(request.param)


_PIPELINES: dict = {}


def diffusers_image(name, model_dir, kind, image_latents, seed=11, num_images_per_prompt=1, **kwargs) -> torch.Tensor:
    """The reference for FLUX.1 / Qwen-Image: diffusers' Img2Img or Inpaint pipeline, whole, as an IMAGE."""
    settings = FAMILIES[name]
    key = (model_dir, kind)
    if key not in _PIPELINES:
        _PIPELINES[key] = settings[kind].from_pretrained(model_dir, dtype=torch.float32)
        _PIPELINES[key].set_progress_bar_config(disable=True)
    if name == "qwenimage":
        kwargs.update(negative_prompt=NEGATIVE, true_cfg_scale=4.0)
    else:
        kwargs.update(guidance_scale=GUIDANCE)
    images = _PIPELINES[key](
        prompt=PROMPT,
        image=image_latents,
        strength=DENOISE,
        num_inference_steps=STEPS,
        width=WIDTH,
        height=HEIGHT,
        max_sequence_length=settings["max_sequence_length"],
        num_images_per_prompt=num_images_per_prompt,
        generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(num_images_per_prompt)],
        output_type="pt",
        **kwargs,
    ).images
    return images.permute(0, 2, 3, 1)


@torch.no_grad()
def flux2_reference(model_dir, transformer, embeds, image_latents, mask=None, seed=11) -> torch.Tensor:
    """FLUX.2 img2img / inpainting from diffusers' scheduler calls, as its img2img pipelines make them
    (``get_timesteps``, ``scale_noise``; the inpaint blend of ``Flux2KleinInpaintPipeline``) around Flux2Pipeline's
    transformer call. The normalised, patchified latents [B, 128, h, w] (ComfyUI's FLUX.2 LATENT)."""
    batch, channels, h, w = image_latents.shape
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir, subfolder="scheduler")
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / STEPS, STEPS), mu=compute_empirical_mu(h * w, STEPS))
    t_start = int(max(STEPS - min(STEPS * DENOISE, STEPS), 0))
    timesteps = scheduler.timesteps[t_start:]
    scheduler.set_begin_index(t_start)
    generator = [torch.Generator("cpu").manual_seed(seed + i) for i in range(batch)]
    noise = randn_tensor((batch, channels, h, w), generator=generator, dtype=torch.float32)
    latents = Flux2Pipeline._pack_latents(scheduler.scale_noise(image_latents, timesteps[:1].repeat(batch), noise))
    packed_image, packed_noise = Flux2Pipeline._pack_latents(image_latents), Flux2Pipeline._pack_latents(noise)
    if mask is not None:
        binary = (mask >= 0.5).float()  # the inpaint pipelines' mask processor binarises
        mask = Flux2Pipeline._pack_latents(torch.nn.functional.interpolate(binary, size=(h, w), mode="bilinear"))
    prompt_embeds = embeds["prompt_embeds"].repeat(batch, 1, 1)
    text_ids = Flux2Pipeline._prepare_text_ids(prompt_embeds)
    latent_ids = Flux2Pipeline._prepare_latent_ids(image_latents)
    guidance = torch.full([batch], GUIDANCE, dtype=torch.float32)
    for i, t in enumerate(timesteps):
        noise_pred = transformer(
            hidden_states=latents,
            timestep=t.expand(batch) / 1000,
            guidance=guidance,
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=latent_ids,
            return_dict=False,
        )[0]
        latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        if mask is not None:
            proper = packed_image
            if i < len(timesteps) - 1:
                proper = scheduler.scale_noise(packed_image, torch.tensor([timesteps[i + 1]]), packed_noise)
            latents = (1 - mask) * proper + mask * latents
    return latents.permute(0, 2, 1).reshape(batch, channels, h, w)


def reference_image(name, adapter, model_dir, stages, mode, kind, seed=11, batch_size=1, **kwargs) -> torch.Tensor:
    """The reference result as an IMAGE (FLUX.2's reference latents decoded by the adapter, whose decode
    test_families checks against ComfyUI's)."""
    _, transformer, vae = stages
    image_latents = pipeline_latents(name, vae, mode)
    if name != "flux2":
        return diffusers_image(name, model_dir, kind, image_latents, seed, batch_size, **kwargs)
    prompts = Prompts((PROMPT,), max_sequence_length=FAMILIES[name]["max_sequence_length"])
    embeds = adapter.encode(stages[0], prompts)
    image_latents = image_latents.repeat(batch_size, 1, 1, 1)
    return adapter.decode(
        vae, flux2_reference(model_dir, transformer, embeds, image_latents, kwargs.get("mask_image"), seed)
    )


def test_img2img_steps_count_as_diffusers_does():
    """The steps that run are the count diffusers' img2img pipelines' get_timesteps gives, on a grid of strengths."""
    pipe = FluxImg2ImgPipeline(None, None, None, None, None, None, None)
    for steps in (1, 4, 10, 28):
        for strength in np.linspace(0.0, 1.0, 41):
            pipe.scheduler = FlowMatchEulerDiscreteScheduler()
            pipe.scheduler.set_timesteps(steps)
            assert img2img_steps(steps, float(strength)) == pipe.get_timesteps(steps, float(strength), "cpu")[1]
    assert img2img_steps(28, 0.5) == 14 and img2img_steps(4, 0.6) == 3 and img2img_steps(8, 0.1) == 1
    assert img2img_steps(8, 0.01) == 1 and img2img_steps(3, 0.0) == 0  # rounded up: only 0 runs none


def test_encode_image_is_the_posterior_mode_and_round_trips(family):
    """VAEEncodeSingleGPU's latent is the posterior's mode in ComfyUI's convention: decoded by the adapter (what
    VAEDecodeSingleGPU runs), it gives what diffusers' VAE decodes from the mode."""
    name, adapter, _, (_, _, vae) = family
    image = pixels()
    latent = adapter.encode_image(vae, image)
    mode = posterior_mode(name, vae, image)
    expected = {"flux": mode, "qwenimage": mode, "flux2": pipeline_latents(name, vae, mode)}[name]
    assert latent.dtype == torch.float32 and latent.shape == expected.shape
    assert torch.equal(latent, expected.float())
    assert torch.equal(adapter.encode_image(vae, image), latent)  # deterministic
    with torch.no_grad():
        decoded = vae.decode(mode, return_dict=False)[0]
    if name == "qwenimage":
        decoded = decoded[:, :, 0]
    reference = VaeImageProcessor().postprocess(decoded, output_type="pt").permute(0, 2, 3, 1)
    assert (adapter.decode(vae, latent) - reference).abs().max().item() <= 1e-5


def test_img2img_equals_diffusers(family):
    name, adapter, model_dir, stages = family
    image = pixels()
    latent = adapter.encode_image(stages[2], image)
    samples = ours(name, adapter, model_dir, stages, latent)
    assert samples.shape == latent.shape
    result = adapter.decode(stages[2], samples)
    reference = reference_image(name, adapter, model_dir, stages, posterior_mode(name, stages[2], image), "img2img")
    diff = (result - reference).abs().max().item()
    print(f"{name}: img2img vs diffusers max |diff| {diff:.3g}")
    assert diff <= 1e-5  # (that the image is kept at all, the inpainting test shows)


def test_inpaint_equals_diffusers_and_keeps_the_unmasked_area(family):
    name, adapter, model_dir, stages = family
    image = pixels()
    latent = adapter.encode_image(stages[2], image)
    mask = pixel_mask()
    samples = ours(name, adapter, model_dir, stages, latent, mask=mask)
    mode = posterior_mode(name, stages[2], image)
    kwargs = {"mask_image": mask}
    if name != "flux2":  # diffusers cannot mask a latent-sized image with a pixel-sized mask: it is only carried
        kwargs["masked_image_latents"] = pipeline_latents(name, stages[2], mode)
    reference = reference_image(name, adapter, model_dir, stages, mode, "inpaint", **kwargs)
    diff = (adapter.decode(stages[2], samples) - reference).abs().max().item()
    print(f"{name}: inpaint vs diffusers max |diff| {diff:.3g}")
    assert diff <= 1e-5
    # The left half (mask 0) is the image's latent again, the right half repainted.
    half = samples.shape[-1] // 2
    assert (samples[..., : half - 1] - latent[..., : half - 1]).abs().max().item() <= 1e-5
    assert (samples[..., half + 1 :] - latent[..., half + 1 :]).abs().max().item() > 1e-2


@pytest.fixture(scope="module")
def four_channels(tmp_path_factory):
    """A tiny FLUX.1 whose VAE has 4 latent channels (its transformer takes 4 x 2x2), loaded once."""
    from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux

    adapter = family_adapter("flux")
    model_dir = make_tiny_flux(str(tmp_path_factory.mktemp("flux-4-channels")), latent_channels=4)
    stages = (
        adapter.load_text_encoders(model_dir, torch.float32, CPU),
        adapter.load_transformer(model_dir, torch.float32, CPU),
        adapter.load_vae(model_dir, torch.float32, "cpu"),
    )
    return adapter, model_dir, stages


def test_img2img_with_a_vae_of_other_than_16_latent_channels_equals_diffusers(four_channels):
    """The pipelines run without a VAE and took 16 latent channels for granted: a 4-channel latent was taken for an
    image to encode ('NoneType' object has no attribute 'encode'). Inpainting, whose diffusers pipeline takes only
    16-channel latents however it is built, is refused naming the model."""
    adapter, model_dir, stages = four_channels
    image = pixels()
    latent = adapter.encode_image(stages[2], image)
    assert latent.shape[1] == 4
    samples = ours("flux", adapter, model_dir, stages, latent)
    reference = reference_image("flux", adapter, model_dir, stages, posterior_mode("flux", stages[2], image), "img2img")
    assert (adapter.decode(stages[2], samples) - reference).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match=r"flux-4-channels.* 4 latent channels.* 16"):
        ours("flux", adapter, model_dir, stages, latent, mask=pixel_mask())


@pytest.mark.slow  # the family-level test above is the default check; this one is the same through the nodes
@pytest.mark.multirank
def test_img2img_of_4_latent_channels_on_ranks_equals_diffusers(nodes, models_root, four_channels):
    """VAEEncodeSingleGPU -> ParallelSampler (Ulysses over 2 CPU ranks) -> VAEDecodeSingleGPU on the 4-channel model
    equals diffusers' FluxImg2ImgPipeline built with that VAE."""
    _, model_dir, (_, _, vae) = four_channels
    model = "flux-4-channels"
    os.symlink(model_dir, models_root / model)
    (backend,) = nodes["ParallelBackend"].execute(ranks=2, device="cpu", memory_policy="resident").args
    (latent,) = nodes["VAEEncodeSingleGPU"].execute(pixels=pixels(), model=model, backend=backend).args
    settings = FAMILIES["flux"]
    (positive,) = (
        nodes["EncodeOnBalancedGPUs"]
        .execute(model=model, prompt=PROMPT, backend=backend, max_sequence_length=settings["max_sequence_length"])
        .args
    )
    (transformer,) = (
        nodes["LoadShardedTransformer"]
        .execute(model=model, strategy="context_parallel", backend=backend, ulysses_degree=2, ring_degree=1)
        .args
    )
    (samples,) = (
        nodes["ParallelSampler"]
        .execute(
            transformer=transformer,
            positive=positive,
            seed=11,
            steps=STEPS,
            guidance_scale=GUIDANCE,
            width=WIDTH,
            height=HEIGHT,
            batch_size=1,
            latent_image=latent,
            denoise=DENOISE,
        )
        .args
    )
    (image,) = nodes["VAEDecodeSingleGPU"].execute(samples=samples, model=model, backend=backend).args
    assert latent["samples"].shape[1] == 4
    mode = posterior_mode("flux", vae, pixels())
    reference = diffusers_image("flux", model_dir, "img2img", pipeline_latents("flux", vae, mode))
    # the ranks run their convolutions and attention with thread counts of their own
    assert (image - reference).abs().max().item() <= 1e-4


@pytest.mark.slow  # test_images_nodes checks batches per rank, test_images_comfyui EmptySD3LatentImage at denoise 1
def test_a_latent_of_batch_one_serves_the_batch_and_denoise_one_is_text_to_image(load):
    """Batch 1 is repeated for every image, each with its own seed (as the pipelines' num_images_per_prompt); a
    zero latent at denoise 1 (ComfyUI's EmptySD3LatentImage) gives the text-to-image result."""
    adapter, model_dir, stages = load("flux")
    latent = adapter.encode_image(stages[2], pixels())
    batch = ours("flux", adapter, model_dir, stages, latent, batch_size=2, seed=5)
    reference = reference_image("flux", adapter, model_dir, stages, posterior_mode("flux", stages[2], pixels()),
                                "img2img", seed=5, batch_size=2)  # fmt: skip
    assert (adapter.decode(stages[2], batch) - reference).abs().max().item() <= 1e-5
    second = ours("flux", adapter, model_dir, stages, latent, seed=6)
    assert (second - batch[1:]).abs().max().item() <= 1e-5

    text_pipe, transformer, _ = stages
    embeds = adapter.encode(text_pipe, Prompts((PROMPT,), max_sequence_length=16))
    sampling = Sampling(seed=5, steps=STEPS, guidance_scale=GUIDANCE, width=WIDTH, height=HEIGHT)
    txt2img = adapter.denoise(model_dir, transformer, embeds, sampling)
    empty = ours("flux", adapter, model_dir, stages, torch.zeros_like(latent), seed=5, denoise=1.0)
    assert (empty - txt2img).abs().max().item() <= 1e-5
