"""FLUX.2 [klein] (``families/flux2_klein``): a tiny distilled [klein] and a tiny base one on 2 CPU ranks through the
pack's steps (encode with Qwen3, plan, sample, decode) equal diffusers' ``Flux2KleinPipeline`` one-shot with the same
prompt and seeds, under each strategy (the base model with its CFG against the negative prompt); a distilled model
refuses CFG by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from diffusers import Flux2KleinPipeline
from helpers import PROMPT, STEPS, TOKENS

from parallel_runtime import default_spec, jobs
from parallel_runtime.errors import InvalidInput
from parallel_runtime.families import family
from parallel_runtime.families.tiny import family_tiny, make_tiny_model
from parallel_runtime.wire import Sampling

KLEIN, KLEIN_BASE = "tiny-flux2-klein", "tiny-flux2-klein-base"
SEED, CFG, NEGATIVE = 5, 3.0, "a blue painting"
WIDTH, HEIGHT = 64, 48  # 4×3 tokens beside TOKENS text tokens: 44, which plain Ulysses and Ring split over 2


def spec():
    return default_spec(ranks=2, device="cpu", memory_policy="staged")


@pytest.fixture(scope="module")
def klein_dir(models_root):
    """The module's model folder with a tiny distilled [klein] and a tiny base [klein]."""
    make_tiny_model("flux2_klein", str(models_root / KLEIN))
    family_tiny("flux2_klein").make_tiny_model(str(models_root / KLEIN_BASE), 0, distilled=False)
    return models_root


@pytest.fixture(scope="module")
def one_shot(klein_dir):
    """(model, batch_size) -> diffusers' Flux2KleinPipeline's IMAGE, image i from SEED + i, made once: the distilled
    model without guidance, the base one with CFG against NEGATIVE."""
    cache = {}

    def reference(model: str, batch_size: int) -> torch.Tensor:
        if (model, batch_size) not in cache:
            pipe = Flux2KleinPipeline.from_pretrained(klein_dir / model, dtype=torch.float32)
            pipe.set_progress_bar_config(disable=True)
            guidance = {}
            if model == KLEIN_BASE:
                negative = pipe.encode_prompt(NEGATIVE, max_sequence_length=TOKENS)[0]
                guidance = {"guidance_scale": CFG, "negative_prompt_embeds": negative}
            cache[model, batch_size] = pipe(
                prompt=PROMPT,
                num_inference_steps=STEPS,
                width=WIDTH,
                height=HEIGHT,
                max_sequence_length=TOKENS,
                num_images_per_prompt=batch_size,
                generator=[torch.Generator("cpu").manual_seed(SEED + i) for i in range(batch_size)],
                output_type="pt",
                **guidance,
            ).images.permute(0, 2, 3, 1)
        return cache[model, batch_size]

    return reference


def generate(model: str, strategy: dict, batch_size: int = 1) -> torch.Tensor:
    backend = spec()
    positive = jobs.encode_prompt(
        backend, model=model, prompt=PROMPT, negative_prompt=NEGATIVE, max_sequence_length=TOKENS
    )
    transformer = jobs.plan_transformer(backend, model=model, **strategy)
    latent = jobs.sample(
        transformer,
        positive,
        seed=SEED,
        steps=STEPS,
        guidance_scale=3.5,  # FLUX.2-dev's embedded guidance: [klein] has no layer it reaches
        true_cfg_scale=CFG if model == KLEIN_BASE else 1.0,
        width=WIDTH,
        height=HEIGHT,
        batch_size=batch_size,
    )
    assert latent.shape == (batch_size, 128, HEIGHT // 16, WIDTH // 16)  # FLUX.2's LATENT
    return jobs.decode(backend, model=model, samples=latent)


STRATEGIES = [
    pytest.param(KLEIN, {"strategy": "context_parallel", "ulysses_degree": 2}, 1, id="ulysses"),
    pytest.param(KLEIN, {"strategy": "device_map"}, 1, id="device_map", marks=pytest.mark.slow),
    pytest.param(KLEIN, {"strategy": "context_parallel", "ring_degree": 2}, 1, id="ring", marks=pytest.mark.slow),
    pytest.param(KLEIN, {"strategy": "tensor_parallel", "tp_degree": 2}, 1, id="tp", marks=pytest.mark.slow),
    pytest.param(KLEIN, {"strategy": "data_parallel"}, 2, id="data_parallel", marks=pytest.mark.slow),
    pytest.param(
        KLEIN_BASE, {"strategy": "context_parallel", "ulysses_degree": 2}, 1, id="base-cfg-ulysses",
        marks=pytest.mark.slow,
    ),
    pytest.param(KLEIN_BASE, {"strategy": "cfg_parallel"}, 1, id="base-cfg_parallel", marks=pytest.mark.slow),
]  # fmt: skip


@pytest.mark.multirank
@pytest.mark.parametrize("model, strategy, batch_size", STRATEGIES)
def test_klein_equals_its_pipeline(one_shot, model, strategy, batch_size):
    image = generate(model, strategy, batch_size)
    diff = (image - one_shot(model, batch_size)).abs().max().item()
    print(f"{model} {strategy}: max |diff| vs Flux2KleinPipeline {diff:.3g}")
    assert diff <= 1e-4


def test_klein_folder_is_its_own_family(klein_dir):
    transformer = jobs.plan_transformer(spec(), model=KLEIN, strategy="device_map")
    assert transformer.family.key == "flux2_klein"
    assert transformer.family.true_cfg  # the base models' CFG is the pack's true CFG


def test_distilled_klein_refuses_cfg(klein_dir):
    """A step-distilled [klein] takes no guidance (the pipeline would ignore it, and cfg_parallel's second half would
    wait for a pass that never comes): asked for CFG, it names the widget and the fix, on the client before anything
    loads and on the ranks before any step runs."""
    from diffusers import Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel.from_pretrained(klein_dir / KLEIN, subfolder="transformer")
    embeds = {name: torch.zeros(1, TOKENS, 48) for name in ("prompt_embeds", "negative_prompt_embeds")}
    sampling = Sampling(seed=0, steps=1, guidance_scale=1.0, width=WIDTH, height=HEIGHT, true_cfg_scale=CFG)
    with pytest.raises(
        ValueError, match=r"true_cfg_scale: 3.0 asks for CFG, but this FLUX.2 \[klein\] is step-distilled"
    ):
        family("flux2_klein").denoise(str(klein_dir / KLEIN), transformer, embeds, sampling)
    # The client asks the same before anything loads, once the conditioning holds a negative prompt; a base model's
    # CFG passes.
    conditioning = jobs.Conditioning(None, (PROMPT,), embeds, source="a test")
    widgets = {"steps": 4, "width": WIDTH, "height": HEIGHT, "batch_size": 1, "true_cfg_scale": CFG}
    with pytest.raises(InvalidInput, match=r"3.0 asks for CFG, but this FLUX.2 \[klein\] is step-distilled") as e:
        jobs.validate_sample(jobs.plan_transformer(spec(), model=KLEIN, strategy="device_map"), conditioning, **widgets)
    assert e.value.widget == "true_cfg_scale"
    jobs.validate_sample(
        jobs.plan_transformer(spec(), model=KLEIN_BASE, strategy="device_map"), conditioning, **widgets
    )


def test_klein_img2img_runs_the_pipelines_schedule(klein_dir):
    """Img2img and inpainting on [klein] are FLUX.2's tail of the schedule (``from_image``, checked against diffusers'
    scheduler calls for FLUX.2 in test_images.py) around Flux2KleinPipeline's loop; diffusers has no [klein] img2img
    pipeline to hold them against (its inpaint pipeline also conditions on the picture as a reference image). In one
    process: at denoise 1 the start is pure noise, so the result is the text-to-image one; with a mask, the area
    kept is the picture's latent exactly after the last step."""
    from parallel_runtime.families import Placement
    from parallel_runtime.wire import Prompts

    folder, klein = str(klein_dir / KLEIN), family("flux2_klein")
    text_encoders = klein.load_text_encoders(folder, torch.float32, Placement("cpu"))
    embeds = klein.encode(text_encoders, Prompts((PROMPT,), max_sequence_length=TOKENS))
    vae = klein.load_vae(folder, torch.float32, "cpu")
    transformer = klein.load_transformer(folder, torch.float32, Placement("cpu"))
    picture = klein.encode_image(vae, torch.rand(1, HEIGHT, WIDTH, 3, generator=torch.Generator().manual_seed(1)))
    sampling = Sampling(seed=SEED, steps=STEPS, guidance_scale=1.0, width=WIDTH, height=HEIGHT)
    text_to_image = klein.denoise(folder, transformer, embeds, sampling)
    from_noise = klein.denoise(folder, transformer, embeds, sampling, latent_image=picture)
    assert (from_noise - text_to_image).abs().max() <= 1e-5
    mask = torch.zeros(1, 1, HEIGHT, WIDTH)
    mask[..., WIDTH // 2 :] = 1.0  # repaint the right half: its tokens' columns 2 and 3
    half = dataclasses.replace(sampling, denoise=0.5)
    repainted = klein.denoise(folder, transformer, embeds, half, latent_image=picture, noise_mask=mask)
    assert torch.equal(repainted[..., :2], picture[..., :2]) and not torch.equal(repainted, picture)


def test_klein_reference_images_are_the_pipelines(klein_dir):
    """[klein] takes FLUX.2-dev's reference inputs: in one process, the denoise with two references (one cropped
    to whole tokens by the pipeline) equals ``Flux2KleinPipeline(image=[...])``'s latents (packed as ComfyUI's
    LATENT), and differs from the text-to-image one."""
    from parallel_runtime.families import Placement
    from parallel_runtime.families.base import pil_images
    from parallel_runtime.families.flux2.adapter import comfy_latent
    from parallel_runtime.wire import Prompts

    folder, klein = str(klein_dir / KLEIN), family("flux2_klein")
    embeds = klein.encode(klein.load_text_encoders(folder, torch.float32, Placement("cpu")), Prompts((PROMPT,)))
    transformer = klein.load_transformer(folder, torch.float32, Placement("cpu"))
    sampling = Sampling(seed=SEED, steps=STEPS, guidance_scale=1.0, width=WIDTH, height=HEIGHT)
    pictures = [torch.rand(1, h, w, 3, generator=torch.Generator().manual_seed(h)) for w, h in ((64, 64), (96, 72))]
    latent = klein.denoise(folder, transformer, embeds, sampling, image=pictures[0], image_2=pictures[1])
    pipe = Flux2KleinPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    kept = {}

    def keep(pipeline, step, timestep, callback_kwargs):
        kept["latents"] = callback_kwargs["latents"]
        return callback_kwargs

    pipe(
        prompt_embeds=embeds["prompt_embeds"],
        image=[pil_images(picture)[0] for picture in pictures],
        num_inference_steps=STEPS,
        width=WIDTH,
        height=HEIGHT,
        generator=[torch.Generator("cpu").manual_seed(SEED)],
        output_type="latent",
        callback_on_step_end=keep,
    )
    assert (latent - comfy_latent(kept["latents"], sampling)).abs().max().item() <= 1e-5
    assert (latent - klein.denoise(folder, transformer, embeds, sampling)).abs().max().item() > 1e-3
