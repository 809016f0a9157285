"""The FLUX.2 and Qwen-Image adapters' staged path (encode -> denoise -> decode) against the one-shot pipelines, and
their LATENTs against ComfyUI's conventions for the two families. Single process, fp32, CPU, tiny models.

The adapters run the same pipeline code with components left out, so a staged image is expected to be bitwise
equal to the one-shot one; the tolerances only guard against harmless reordering.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import Flux2Pipeline, QwenImagePipeline

from parallel_runtime.families import Placement
from parallel_runtime.families import family as family_adapter
from parallel_runtime.families.tiny import make_tiny_model
from parallel_runtime.wire import Prompts, Sampling

flux2, qwenimage = family_adapter("flux2"), family_adapter("qwenimage")


PROMPT = "a photo of a cat"
NEGATIVE = "a blue painting"
# Non-square, so a swapped width / height shows up as a shape error.
WIDTH, HEIGHT = 96, 64
STEPS = 2  # Qwen-Image's minimum (one step gives NaN)
CPU = Placement("cpu")

FAMILIES = {
    # FLUX.2's max_sequence_length counts the chat template's system message (31 tiny tokens) too.
    "flux2": {
        "adapter": flux2,
        "pipeline": Flux2Pipeline,
        "max_sequence_length": 48,
        "sampling": {"guidance_scale": 4.0},
        "encode": {},
    },
    "qwenimage": {
        "adapter": qwenimage,
        "pipeline": QwenImagePipeline,
        "max_sequence_length": 64,
        "sampling": {"guidance_scale": 4.0, "true_cfg_scale": 4.0},
        "encode": {"negative_prompts": (NEGATIVE,)},
    },
}


def latent_shape(name: str, batch_size: int) -> tuple[int, ...]:
    """ComfyUI's LATENT shape for the tiny models (comfy/latent_formats.py)."""
    if name == "flux2":  # Flux2: 4 x the VAE's 32 channels in 2x2 patches, 16x downscale
        return (batch_size, 128, HEIGHT // 16, WIDTH // 16)
    return (batch_size, 16, 1, HEIGHT // 8, WIDTH // 8)  # Wan21: 16 channels, one frame, 8x downscale


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """name -> (name, settings, model_dir, (text encoders, transformer, VAE)); each family built and loaded once."""
    loaded = {}

    def get(name: str):
        if name not in loaded:
            settings = FAMILIES[name]
            model_dir = make_tiny_model(settings["adapter"].key, str(tmp_path_factory.mktemp(name)), 0)
            adapter = settings["adapter"]
            stages = (
                adapter.load_text_encoders(model_dir, torch.float32, CPU),
                adapter.load_transformer(model_dir, torch.float32, CPU),
                adapter.load_vae(model_dir, torch.float32, "cpu"),
            )
            loaded[name] = (name, settings, model_dir, stages)
        return loaded[name]

    return get


@pytest.fixture(params=sorted(FAMILIES))
def family(request, load):
    return load(request.param)


@pytest.fixture
def qwen(load):
    return load("qwenimage")


def embeds_of(family) -> dict[str, torch.Tensor]:
    _, settings, _, (text_pipe, _, _) = family
    prompts = Prompts((PROMPT,), max_sequence_length=settings["max_sequence_length"], **settings["encode"])
    return settings["adapter"].encode(text_pipe, prompts)


def staged_latents(family, seed: int, batch_size: int = 1, on_step=None, **overrides) -> torch.Tensor:
    _, settings, model_dir, (_, transformer, _) = family
    sampling = Sampling(
        seed=seed,
        steps=STEPS,
        width=WIDTH,
        height=HEIGHT,
        batch_size=batch_size,
        **{**settings["sampling"], **overrides},
    )
    return settings["adapter"].denoise(model_dir, transformer, embeds_of(family), sampling, on_step=on_step)


_PIPELINES = {}


def one_shot(family, seed: int, num_images_per_prompt: int = 1, **overrides) -> torch.Tensor:
    """The reference: the full pipeline in one call, as an IMAGE [B, H, W, 3]."""
    name, settings, model_dir, _ = family
    if model_dir not in _PIPELINES:
        _PIPELINES[model_dir] = settings["pipeline"].from_pretrained(model_dir, dtype=torch.float32)
        _PIPELINES[model_dir].set_progress_bar_config(disable=True)
    pipe = _PIPELINES[model_dir]
    kwargs = {**settings["sampling"], **overrides}
    if name == "qwenimage":
        kwargs.setdefault("negative_prompt", NEGATIVE)
        kwargs.pop("guidance_scale")  # Qwen-Image has no guidance embedding
    images = pipe(
        prompt=PROMPT,
        num_images_per_prompt=num_images_per_prompt,
        num_inference_steps=STEPS,
        width=WIDTH,
        height=HEIGHT,
        max_sequence_length=settings["max_sequence_length"],
        generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(num_images_per_prompt)],
        output_type="pt",
        **kwargs,
    ).images
    return images.permute(0, 2, 3, 1)


def test_staged_equals_one_shot(family):
    name, settings, _, (_, _, vae) = family
    samples = staged_latents(family, seed=42)
    assert samples.shape == latent_shape(name, 1) and samples.dtype == torch.float32

    image = settings["adapter"].decode(vae, samples)
    assert image.shape == (1, HEIGHT, WIDTH, 3)
    assert image.dtype == torch.float32 and image.device.type == "cpu"
    assert 0.0 <= image.min() and image.max() <= 1.0
    diff = (image - one_shot(family, seed=42)).abs().max().item()
    print(f"{name}: staged vs one-shot max |diff| {diff:.3g}")
    assert diff <= 1e-5


def test_batch_of_two_uses_seed_plus_i(family):
    name, settings, _, (_, _, vae) = family
    samples = staged_latents(family, seed=7, batch_size=2)
    assert samples.shape == latent_shape(name, 2)
    # Image i draws its noise from seed + i, so the two images differ ...
    assert not torch.equal(samples[0], samples[1])
    # ... and the second one alone, from seed + 1, is the same image (how data parallelism splits a batch); equal
    # up to float rounding, since a batch of one multiplies matrices in a different blocking than a batch of two.
    alone = staged_latents(family, seed=8)
    assert (alone - samples[1:]).abs().max().item() <= 1e-5

    image = settings["adapter"].decode(vae, samples)
    diff = (image - one_shot(family, seed=7, num_images_per_prompt=2)).abs().max().item()
    print(f"{name}: batch of 2 vs one-shot num_images_per_prompt=2 max |diff| {diff:.3g}")
    assert diff <= 1e-5


def comfyui_decode(name: str, vae, samples: torch.Tensor) -> torch.Tensor:
    """What ComfyUI's VAEDecode does with a LATENT of this family, written out with ComfyUI's own arithmetic
    (the decoder network is diffusers' port of the same weights)."""
    with torch.no_grad():
        if name == "flux2":
            # comfy/ldm/models/autoencoder.py, AutoencodingEngine.decode with batch_norm_latent: the VAE itself undoes
            # the batch-norm (eps fixed at 1e-4) and the 2x2 patches, then post_quant_conv + decoder.
            std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-4)
            z = samples * std + vae.bn.running_mean.view(1, -1, 1, 1)
            # einops.rearrange(z, "... (c pi pj) i j -> ... c (i pi) (j pj)", pi=2, pj=2), spelled out
            b, c4, h, w = z.shape
            z = z.view(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, h * 2, w * 2)
            raw = vae.decode(z).sample
        else:
            # Wan 2.1 VAE (latent_dim 3): decodes [B, C, T, h, w] as it is, no normalisation (Wan21.process_out
            # already ran in the sampler); VAEDecode then folds the frames into the batch.
            raw = vae.decode(samples).sample
        # comfy.sd.VAE.decode: process_output = clamp((x + 1) / 2, 0, 1), then channels last.
        image = torch.clamp((raw + 1.0) / 2.0, min=0.0, max=1.0).movedim(1, -1)
    if image.ndim == 5:  # nodes.VAEDecode: "Combine batches"
        image = image.reshape(-1, image.shape[-3], image.shape[-2], image.shape[-1])
    return image


def test_latent_decodes_as_comfyui_decodes_it(family):
    name, settings, _, (_, _, vae) = family
    samples = staged_latents(family, seed=1)
    ours = settings["adapter"].decode(vae, samples)
    diff = (ours - comfyui_decode(name, vae, samples)).abs().max().item()
    print(f"{name}: our decode vs ComfyUI's VAEDecode arithmetic max |diff| {diff:.3g}")
    assert diff <= 1e-6


def test_qwenimage_accepts_a_4d_latent_as_one_frame(qwen):
    """ComfyUI's LATENT for Qwen-Image is a one-frame video latent; a 4-D one (EmptySD3LatentImage's shape, which
    ComfyUI's samplers unsqueeze) is taken as that frame, more frames are refused."""
    _, _, _, (_, _, vae) = qwen
    samples = staged_latents(qwen, seed=1)
    assert torch.equal(qwenimage.decode(vae, samples[:, :, 0]), qwenimage.decode(vae, samples))
    with pytest.raises(ValueError, match="one frame"):
        qwenimage.decode(vae, samples.repeat(1, 1, 2, 1, 1))


def test_qwenimage_true_cfg_scale_1_ignores_the_negative(qwen):
    guided = staged_latents(qwen, seed=5)
    # true_cfg_scale 1 turns true CFG off: the negative embeddings are there but unused, as in the pipeline.
    unguided = staged_latents(qwen, seed=5, true_cfg_scale=1.0)
    assert not torch.allclose(guided, unguided)
    _, _, _, (_, _, vae) = qwen
    reference = one_shot(qwen, seed=5, true_cfg_scale=1.0, negative_prompt=None)
    assert (qwenimage.decode(vae, unguided) - reference).abs().max().item() <= 1e-5


def test_encode_shapes(family):
    name, settings, _, _ = family
    embeds = embeds_of(family)
    assert all(t.device.type == "cpu" for t in embeds.values())
    if name == "flux2":
        # Padded to max_sequence_length; three stacked Mistral hidden states (3 x 16).
        assert set(embeds) == {"prompt_embeds"}
        assert embeds["prompt_embeds"].shape == (1, settings["max_sequence_length"], 48)
    else:
        # The prompt's own length after the template's 34-token prefix, not padded; the negative has its own.
        assert set(embeds) == {
            "prompt_embeds",
            "prompt_embeds_mask",
            "negative_prompt_embeds",
            "negative_prompt_embeds_mask",
        }
        assert embeds["prompt_embeds"].shape[0] == 1 and embeds["prompt_embeds"].shape[2] == 32
        assert embeds["prompt_embeds_mask"].shape == embeds["prompt_embeds"].shape[:2]
        assert embeds["prompt_embeds_mask"].dtype == torch.long and bool(embeds["prompt_embeds_mask"].all())
    with pytest.raises(ValueError, match="one text encoder"):
        settings["adapter"].encode(family[3][0], Prompts((PROMPT,), (PROMPT,), max_sequence_length=8))


def test_on_step_reports_every_step(family):
    seen = []
    staged_latents(family, seed=0, on_step=lambda i, total: seen.append((i, total)))
    assert seen == [(i, STEPS) for i in range(STEPS)]  # true CFG's second pass is not a step of its own


def test_qwenimage_refuses_one_step(qwen):
    _, _, model_dir, (_, transformer, _) = qwen
    with pytest.raises(ValueError, match="at least 2 steps"):
        qwenimage.denoise(
            model_dir,
            transformer,
            embeds_of(qwen),
            Sampling(seed=0, steps=1, guidance_scale=1.0, width=WIDTH, height=HEIGHT),
        )


def test_size_not_divisible_by_16_is_refused(family):
    _, settings, model_dir, (_, transformer, _) = family
    with pytest.raises(ValueError, match="divisible by 16"):
        settings["adapter"].denoise(
            model_dir,
            transformer,
            embeds_of(family),
            Sampling(seed=0, steps=STEPS, guidance_scale=1.0, width=72, height=64),
        )
