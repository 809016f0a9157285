"""Img2img, hires fix and inpainting through the nodes on a real backend (2 CPU ranks, tiny FLUX.1): VAEEncodeSingleGPU
-> ParallelSampler(latent_image, denoise) -> VAEDecodeSingleGPU equals diffusers' FluxImg2ImgPipeline /
FluxInpaintPipeline given the same latents, on every strategy; and every bad input is refused by name before any step
runs. Needs COMFYUI_DIR (the nodes); ComfyUI's own latent nodes run in test_examples_comfyui.py, in the real host."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL, FluxImg2ImgPipeline, FluxInpaintPipeline

from parallel_runtime import InvalidInput, default_spec, jobs
from parallel_runtime.client import get_backend
from parallel_runtime.families import family
from parallel_runtime.families.tiny import make_tiny_model
from parallel_runtime.wire import OutputArgs, StatusArgs

PROMPT = "a red cat on a sofa"
STEPS, DENOISE, SEED = 4, 0.6, 9
MAX_SEQUENCE_LENGTH = 16
flux = family("flux")


@pytest.fixture(scope="module")
def tiny(models_root):
    make_tiny_model("flux", str(models_root / "tiny-flux"))
    return models_root / "tiny-flux"


@pytest.fixture(scope="module")
def vae(tiny):
    return AutoencoderKL.from_pretrained(tiny / "vae")


@pytest.fixture(scope="module")
def graph(nodes, tiny):
    """The nodes of one backend: (backend, conditioning, run(strategy, ...) -> IMAGE)."""
    (backend,) = nodes["ParallelBackend"].execute(ranks=2, device="cpu", memory_policy="resident").args
    (positive,) = (
        nodes["EncodeOnBalancedGPUs"]
        .execute(model=tiny.name, prompt=PROMPT, max_sequence_length=MAX_SEQUENCE_LENGTH, backend=backend)
        .args
    )

    def run(strategy: str, latent: dict, batch_size: int = 1, **strategy_args) -> torch.Tensor:
        (transformer,) = (
            nodes["LoadShardedTransformer"]
            .execute(model=tiny.name, strategy=strategy, backend=backend, **strategy_args)
            .args
        )
        (samples,) = (
            nodes["ParallelSampler"]
            .execute(
                transformer=transformer,
                positive=positive,
                seed=SEED,
                steps=STEPS,
                guidance_scale=3.5,
                width=1024,  # ignored: the latent's size is the image's
                height=1024,
                batch_size=batch_size,
                latent_image=latent,
                denoise=DENOISE,
            )
            .args
        )
        (image,) = nodes["VAEDecodeSingleGPU"].execute(samples=samples, model=tiny.name, backend=backend).args
        return image

    return backend, positive, run


def encode(nodes, backend, tiny, pixels: torch.Tensor) -> dict:
    (latent,) = nodes["VAEEncodeSingleGPU"].execute(pixels=pixels, model=tiny.name, backend=backend).args
    return latent


def pixels(width: int, height: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.rand((batch, height, width, 3), generator=torch.Generator().manual_seed(seed))


_PIPELINES: dict = {}


def reference(tiny, vae, latent: dict, batch_size: int = 1) -> torch.Tensor:
    """diffusers' FluxImg2ImgPipeline (FluxInpaintPipeline with a noise_mask) on the same latents, as an IMAGE."""
    samples, mask = latent["samples"], latent.get("noise_mask")
    kind = FluxInpaintPipeline if mask is not None else FluxImg2ImgPipeline
    if kind not in _PIPELINES:
        _PIPELINES[kind] = kind.from_pretrained(tiny)
        _PIPELINES[kind].set_progress_bar_config(disable=True)
    image = (samples - vae.config.shift_factor) * vae.config.scaling_factor  # as its _encode_vae_image normalises
    extra = {"mask_image": mask, "masked_image_latents": image} if mask is not None else {}
    images = _PIPELINES[kind](
        prompt=PROMPT,
        image=image,
        strength=DENOISE,
        num_inference_steps=STEPS,
        guidance_scale=3.5,
        width=samples.shape[-1] * 8,
        height=samples.shape[-2] * 8,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        num_images_per_prompt=batch_size,
        generator=[torch.Generator().manual_seed(SEED + i) for i in range(batch_size)],
        output_type="pt",
        **extra,
    ).images
    return images.permute(0, 2, 3, 1)


def upscaled(latent: dict, scale: float) -> dict:
    """What ComfyUI's LatentUpscaleBy (bilinear) makes of a LATENT: comfy.utils.common_upscale, crop disabled."""
    samples = latent["samples"]
    size = (round(samples.shape[-2] * scale), round(samples.shape[-1] * scale))
    return {**latent, "samples": torch.nn.functional.interpolate(samples, size=size, mode="bilinear")}


def test_vae_encode_node_is_the_mode_and_crops_as_comfyui(nodes, graph, tiny, vae):
    backend, _, _ = graph
    image = pixels(70, 50)  # cropped to the centre 64×48, as ComfyUI's VAEEncode crops to its VAE's factor
    latent = encode(nodes, backend, tiny, image)
    x = image[:, 1:49, 3:67].permute(0, 3, 1, 2) * 2 - 1
    with torch.no_grad():
        mode = vae.encode(x).latent_dist.mode()
    assert latent["samples"].shape == mode.shape == (1, 16, 6, 8)
    # equal up to float rounding: the rank runs its convolutions with a thread count of its own
    assert (latent["samples"] - mode).abs().max().item() <= 1e-5


def test_vae_encode_is_a_stage_whose_peak_memory_counts_from_its_start(nodes, graph, tiny):
    """Like every stage op, the VAE encode starts its rank's peak memory afresh (and flushes at its end), so the status
    after it says what the encode took, not what an earlier op held: here 256 MiB that rank 0 made for the client."""
    backend, _, _ = graph
    ranks = get_backend(backend)
    ranks.call(OutputArgs(nbytes=256 << 20))
    before = ranks.call(StatusArgs()).per_rank[0].memory.peak_bytes
    encode(nodes, backend, tiny, pixels(64, 48))
    after = ranks.call(StatusArgs()).per_rank[0].memory.peak_bytes
    assert after < before - (128 << 20), (before, after)


CP, ODD = {"ulysses_degree": 2, "ring_degree": 1}, (48, 80)  # 3×5 tokens: an uneven split needs anything
SLOW = pytest.mark.slow
STRATEGIES = [
    # (id, strategy, its widgets, image size, LatentUpscaleBy scale, batch)
    pytest.param("context_parallel", CP, (64, 64), 1.5, 1, id="ulysses_hires_fix"),
    pytest.param("context_parallel", {**CP, "anything": True}, ODD, 1.0, 1, id="ulysses_anything"),
    pytest.param("data_parallel", {}, (64, 48), 1.0, 2, id="data_parallel"),
    pytest.param("device_map", {}, (64, 48), 1.0, 1, id="device_map"),
    pytest.param("context_parallel", {"ring_degree": 2, "ulysses_degree": 1}, (64, 64), 1.0, 1, id="ring"),
    pytest.param(
        "context_parallel",
        {"ring_degree": 2, "ulysses_degree": 1, "anything": True},
        ODD,
        1.0,
        1,
        id="ring_anything",
        marks=SLOW,
    ),
    pytest.param("tensor_parallel", {}, ODD, 1.0, 1, id="tensor_parallel"),
]


@pytest.mark.multirank
@pytest.mark.parametrize("strategy, args, size, scale, batch_size", STRATEGIES)
def test_img2img_on_every_strategy_equals_diffusers(nodes, graph, tiny, vae, strategy, args, size, scale, batch_size):
    backend, _, run = graph
    # One latent per image under data parallelism (each rank gets its own), one for all otherwise.
    latent = upscaled(encode(nodes, backend, tiny, pixels(*size, batch=batch_size)), scale)
    image = run(strategy, latent, batch_size=batch_size, **args)
    expected = reference(tiny, vae, latent, batch_size)
    assert (
        image.shape
        == expected.shape
        == (batch_size, latent["samples"].shape[-2] * 8, latent["samples"].shape[-1] * 8, 3)
    )
    diff = (image - expected).abs().max().item()
    print(f"{strategy} {args}: img2img vs FluxImg2ImgPipeline max |diff| {diff:.3g}")
    assert diff <= 1e-4


@pytest.mark.multirank
def test_inpainting_through_the_nodes_equals_diffusers(nodes, graph, tiny, vae):
    """A noise_mask as SetLatentNoiseMask sets it (a pixel-sized MASK), under context parallelism, and a batch of two
    masks for one latent under data parallelism (the ranks take their own mask)."""
    backend, _, run = graph
    latent = encode(nodes, backend, tiny, pixels(64, 48))
    mask = torch.zeros((1, 48, 64))
    mask[:, 8:40, 16:48] = 1.0
    masked = {**latent, "noise_mask": mask.reshape(-1, 1, 48, 64)}
    image = run("context_parallel", masked, **CP)
    assert (image - reference(tiny, vae, masked)).abs().max().item() <= 1e-4
    two = {**latent, "noise_mask": torch.cat([masked["noise_mask"], 1.0 - masked["noise_mask"]])}
    image = run("data_parallel", two, batch_size=2)
    assert (image - reference(tiny, vae, two, batch_size=2)).abs().max().item() <= 1e-4


# -- bad input ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def handle(tiny):
    """A transformer handle on a backend that is never started: every refusal comes before any call."""
    return jobs.plan_transformer(default_spec(ranks=2, device="cpu"), model=tiny.name, strategy="context_parallel")


@pytest.fixture(scope="module")
def conditioning(graph):
    return graph[1]


def flux_latent(width: int = 64, height: int = 64, batch: int = 1, **extra) -> dict:
    return {"samples": torch.zeros((batch, 16, height // 8, width // 8)), **extra}


BAD = [
    ("latent_image", {"latent_image": {"samples": torch.zeros((1, 128, 4, 4))}}, "does not fit tiny-flux"),
    ("latent_image", {"latent_image": {"samples": torch.zeros((1, 16, 1, 8, 8))}}, "it was made for another model"),
    ("latent_image", {"latent_image": {"samples": torch.zeros((1, 4, 8, 8))}}, "4-D, 16 channels"),
    ("latent_image", {"latent_image": {"nothing": 1}}, "link a LATENT output"),
    ("latent_image", {"latent_image": flux_latent(72, 64)}, "crop or scale it to 8 or 10 latent pixels"),
    ("latent_image", {"latent_image": {"samples": torch.full((1, 16, 8, 8), float("nan"))}}, "NaN"),
    ("latent_image", {"latent_image": flux_latent(batch=3), "batch_size": 2}, "holds 3 images but the sampler makes 2"),
    (
        "latent_image",
        {"latent_image": flux_latent(48, 80)},
        "makes 15 image tokens, which do not split over 2 ranks; turn on anything",
    ),
    ("noise_mask", {"latent_image": flux_latent(noise_mask=torch.ones((1, 64, 32)))}, "another aspect ratio"),
    ("noise_mask", {"latent_image": flux_latent(noise_mask=torch.ones((3, 64, 64)))}, "holds 3 images"),
    ("noise_mask", {"latent_image": flux_latent(noise_mask="mask")}, "SetLatentNoiseMask"),
    ("denoise", {"denoise": 0.5}, "no latent_image is linked"),
    ("denoise", {"latent_image": flux_latent(), "denoise": 0.0}, "raise denoise above 0"),
    ("denoise", {"latent_image": flux_latent(), "denoise": 1.5}, "outside 0..1"),
    ("denoise", {"latent_image": flux_latent(), "denoise": float("nan")}, "give a finite value"),
]


@pytest.mark.parametrize("widget, given, hint", BAD, ids=[f"{w}-{i}" for i, (w, _, _) in enumerate(BAD)])
def test_bad_image_input_is_refused_by_name_before_anything_runs(handle, conditioning, widget, given, hint):
    kwargs = {"seed": 0, "steps": STEPS, "guidance_scale": 3.5, "width": 64, "height": 64, **given}
    with pytest.raises(InvalidInput) as refused:
        jobs.sample(handle, conditioning, **kwargs)
    assert refused.value.widget == widget and hint in str(refused.value), str(refused.value)


def test_denoise_below_one_without_a_latent_is_refused_at_validation(handle):
    """What ParallelSampler's validate_inputs asks: the graph says whether a latent_image is linked."""
    with pytest.raises(InvalidInput, match=r"denoise: 0\.5 keeps part of an image"):
        jobs.validate_sample(handle, None, steps=4, width=64, height=64, batch_size=1, denoise=0.5)
    # linked: the latent's size is not known yet, so width and height (ignored) are not checked either
    jobs.validate_sample(handle, None, steps=4, width=72, height=64, batch_size=1, denoise=0.5, latent_linked=True)


def test_bad_pixels_are_refused_by_name(tiny):
    spec = default_spec(ranks=2, device="cpu")
    for pixels_given, hint in (
        (torch.zeros((1, 8, 64, 3)), "smaller than FLUX.1's 16-pixel patches"),
        (torch.zeros((64, 64, 3)), "is not an IMAGE"),
        (torch.full((1, 32, 32, 3), float("inf")), "NaN or infinite"),
    ):
        with pytest.raises(InvalidInput, match=hint) as refused:
            jobs.vae_encode(spec, model=tiny.name, pixels=pixels_given)
        assert refused.value.widget == "pixels"
