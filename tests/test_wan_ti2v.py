"""Wan 2.2 TI2V-5B (``families/wan_ti2v``): one folder (a ``WanPipeline`` with ``expand_timesteps``) that makes clips
from text and, with a start image on ParallelSampler's optional ``image``, from the image, against diffusers'
one-shot ``WanPipeline`` / ``WanImageToVideoPipeline`` on the same folder (fp32, ≤ 1e-4) in one process and on real
CPU ranks; its LATENT in ComfyUI's Wan 2.2 convention ([B, 48, T, H/16, W/16], un-normalised); the size refused by
name before anything loads. Tiny model: 4 heads, 5 frames (2 latent frames) of 64×32 (2 × 1 tokens of 32 pixels per
frame), from a 56×40 start image."""

from __future__ import annotations

import pytest
import torch
from helpers import WAN_CLIP, wan_clip_latent, wan_latents
from helpers import wan_start_image as start_image

from parallel_runtime import InvalidInput, default_spec, jobs, model_folders
from parallel_runtime.families import Placement
from parallel_runtime.families import family as family_adapter
from parallel_runtime.families.base import image_tokens
from parallel_runtime.families.wan.tiny import make_tiny_model as make_tiny_t2v
from parallel_runtime.families.wan_ti2v.tiny import make_tiny_model
from parallel_runtime.samplers import Sampler
from parallel_runtime.wire import Prompts, Sampling

ti2v = family_adapter("wan_ti2v")
PROMPT, NEGATIVE, CFG = WAN_CLIP["prompt"], WAN_CLIP["negative_prompt"], WAN_CLIP["guidance_scale"]
FRAMES, STEPS, TOKENS = WAN_CLIP["num_frames"], WAN_CLIP["num_inference_steps"], WAN_CLIP["max_sequence_length"]
WIDTH, HEIGHT, SEED = 64, 32, 3
MODEL, T2V = "tiny-wan22-ti2v", "tiny-wan21"
LATENT = (1, 48, (FRAMES - 1) // 4 + 1, HEIGHT // 16, WIDTH // 16)


IMAGE = start_image()


@pytest.fixture(scope="module")
def wan_dir(models_root):
    """The module's model folder: a tiny Wan 2.2 TI2V-5B and (for telling the two apart) a Wan 2.1 T2V."""
    make_tiny_model(str(models_root / MODEL), 0)
    make_tiny_t2v(str(models_root / T2V), 0)
    return models_root


def one_shot(folder, batch_size: int = 1, image: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' latents in one call as ComfyUI's LATENT (un-normalised): ``WanPipeline`` from text, or
    ``WanImageToVideoPipeline`` loaded from the same folder from the start image."""
    pipeline = "WanPipeline" if image is None else "WanImageToVideoPipeline"
    return wan_latents(folder, pipeline, batch_size, image, SEED, width=WIDTH, height=HEIGHT)


# -- the adapter in one process ---------------------------------------------------------------------------------
def test_a_ti2v_folder_is_its_own_family(wan_dir):
    """Both folders are WanPipelines; model_index.json's expand_timesteps tells TI2V-5B's."""
    assert model_folders.resolve(MODEL).family == "wan_ti2v"
    assert model_folders.resolve(T2V).family == "wan"
    assert model_folders.pipeline_class(str(wan_dir / MODEL)) == model_folders.pipeline_class(str(wan_dir / T2V))
    # A clip's tokens are 32-pixel squares of its latent frames: 720p × 121 frames is 31 × 22 × 40.
    assert image_tokens(ti2v, 1280, 704, 121) == 31 * 22 * 40


def test_staged_equals_one_shot_from_text_and_from_a_start_image(wan_dir):
    """The staged clip is WanPipeline's without a start image and WanImageToVideoPipeline's with one (its first
    latent frame the image's encoding); another start image makes another clip."""
    folder = str(wan_dir / MODEL)
    cpu = Placement("cpu")
    text = ti2v.load_text_encoders(folder, torch.float32, cpu)
    embeds = ti2v.encode(text, Prompts((PROMPT,), negative_prompts=(NEGATIVE,), max_sequence_length=TOKENS))
    transformer = ti2v.load_transformer(folder, torch.float32, cpu)
    assert transformer.config.in_channels == transformer.config.out_channels == 48
    sampling = Sampling(
        seed=SEED,
        steps=STEPS,
        guidance_scale=1.0,
        width=WIDTH,
        height=HEIGHT,
        true_cfg_scale=CFG,
        sampler=Sampler.UNI_PC,
        frames=FRAMES,
    )
    from_text = ti2v.denoise(folder, transformer, embeds, sampling)
    assert from_text.shape == LATENT and from_text.dtype == torch.float32
    assert (from_text - one_shot(folder)).abs().max().item() <= 1e-5
    from_image = ti2v.denoise(folder, transformer, embeds, sampling, image=IMAGE)
    assert (from_image - one_shot(folder, image=IMAGE)).abs().max().item() <= 1e-5
    assert (from_image - from_text).abs().max().item() > 1e-3
    other = ti2v.denoise(folder, transformer, embeds, sampling, image=start_image(shift=100))
    assert (other[:, :, 0] - from_image[:, :, 0]).abs().max().item() > 1e-3
    frames = ti2v.decode(ti2v.load_vae(folder, torch.float32, "cpu"), from_image)
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3)


# -- the widgets, before anything loads ------------------------------------------------------------------------
def backend(ranks: int = 2):
    return default_spec(ranks=ranks, device="cpu", memory_policy="staged")


def _validate(strategy: str = "context_parallel", **widgets) -> None:
    transformer = jobs.plan_transformer(backend(), model=MODEL, strategy=strategy)
    args = {"steps": STEPS, "width": WIDTH, "height": HEIGHT, "batch_size": 1, "true_cfg_scale": CFG}
    jobs.validate_sample(transformer, None, **{**args, "sampler": "uni_pc", "length": FRAMES, **widgets})


def _read(image) -> tuple[jobs.ReferenceImage, ...]:
    transformer = jobs.plan_transformer(backend(), model=MODEL, strategy="context_parallel")
    return jobs.read_reference_images(transformer, {"image": image}, (WIDTH, HEIGHT))


@pytest.mark.parametrize(
    "widget, call, hint",
    [
        ("width", lambda: _validate(width=48), "multiple of 32"),
        ("height", lambda: _validate(height=48), "multiple of 32"),
        ("image", lambda: _read(torch.cat([IMAGE, IMAGE])), "starts every clip from one"),
        # 64×64, one frame: 2 × 2 tokens of one latent frame split over 2 ranks; 96×32: 3 × 1 do not.
        ("width", lambda: _validate(width=96, length=1), "do not split over 2"),
    ],
)
def test_ti2v_widgets_fail_before_anything_runs(wan_dir, widget, call, hint):
    with pytest.raises(InvalidInput, match=hint) as info:
        call()
    assert info.value.widget == widget


def test_the_start_image_is_optional(wan_dir):
    _validate()  # text-to-video
    (reference,) = _read(IMAGE)
    assert reference.describe() == "start image 56×40, resized to 64×32"
    _validate(references=(reference,))  # its 56×40 adds no tokens


# -- the strategies on real ranks -----------------------------------------------------------------------------
def check(wan_dir, strategy: str, *, batch_size: int = 1, image: torch.Tensor | None = None, **args) -> None:
    start = {} if image is None else {"image": image}
    latent = wan_clip_latent(backend(), MODEL, strategy, args, batch_size=batch_size, width=WIDTH, **start)
    reference = one_shot(wan_dir / MODEL, batch_size, image)
    assert latent.shape == reference.shape == (batch_size, *LATENT[1:])
    diff = (latent - reference).abs().max().item()
    what = "image-to-video" if image is not None else "text-to-video"
    print(f"TI2V {what} {strategy} {args}: max |diff| vs one-shot {diff:.3g}")
    assert diff <= 1e-4


@pytest.mark.multirank
def test_ulysses_matches_one_shot_from_text_and_from_a_start_image(wan_dir):
    """One backend, one loaded transformer: the per-token timesteps split with the tokens over 2 ranks."""
    check(wan_dir, "context_parallel", ulysses_degree=2)
    check(wan_dir, "context_parallel", image=IMAGE, ulysses_degree=2)


SLOW_CASES = [
    # (id, strategy, widgets, batch_size, start image)
    ("device_map", "device_map", {}, 1, IMAGE),
    ("cfg_parallel", "cfg_parallel", {}, 1, IMAGE),
    ("data_parallel", "data_parallel", {}, 2, IMAGE),
    # The pack's plan (families/wan/tp_plan.py): 4 heads and the 64-wide feed-forward over 2 ranks.
    ("tensor_parallel", "tensor_parallel", {}, 1, IMAGE),
    ("ring", "context_parallel", {"ring_degree": 2, "ulysses_degree": 1}, 1, None),
]


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, args, batch_size, image", [c[1:] for c in SLOW_CASES], ids=[c[0] for c in SLOW_CASES]
)
def test_more_strategies_match_one_shot(wan_dir, strategy, args, batch_size, image):
    check(wan_dir, strategy, batch_size=batch_size, image=image, **args)
