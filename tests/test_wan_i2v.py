"""Wan image-to-video (``families/wan_i2v``): Wan 2.1 I2V (a CLIP image encoder) and Wan 2.2 A14B I2V (two experts,
no image encoder) from a start image on ParallelSampler's ``image``, against diffusers' one-shot
``WanImageToVideoPipeline`` (fp32, ≤ 1e-4) in one process and on real CPU ranks, Wan 2.1 I2V also from ComfyUI's own
files (its CLIP vision file among them); the start image and the text length refused by name before anything loads.
Tiny models: 4 heads, 5 frames (2 latent frames) of 48×32 from a 56×40 start image (the pipeline resizes it to the
clip's size), the text at Wan's 512 tokens (Wan 2.1 I2V reads its image tokens as what precedes the last 512)."""

from __future__ import annotations

import pytest
import torch
from helpers import WAN_CLIP, wan_clip_latent, wan_latents
from helpers import wan_start_image as start_image
from PIL import Image

from parallel_runtime import InvalidInput, default_spec, jobs
from parallel_runtime.families import Placement
from parallel_runtime.families import family as family_adapter
from parallel_runtime.families.wan.adapter import has_second_expert, pipeline_config
from parallel_runtime.families.wan.tiny import make_tiny_model as make_tiny_t2v
from parallel_runtime.families.wan_i2v.tiny import make_tiny_model
from parallel_runtime.samplers import Sampler
from parallel_runtime.wire import Prompts, Sampling

wan_i2v = family_adapter("wan_i2v")
PROMPT, NEGATIVE, CFG = WAN_CLIP["prompt"], WAN_CLIP["negative_prompt"], WAN_CLIP["guidance_scale"]
WIDTH, HEIGHT, FRAMES, STEPS = WAN_CLIP["width"], WAN_CLIP["height"], WAN_CLIP["num_frames"], 2
TOKENS = 512
CFG_2, SEED = 3.0, 3
MODELS = {"wan21": "tiny-wan21-i2v", "wan22": "tiny-wan22-i2v", "t2v": "tiny-wan21-t2v"}


IMAGE = start_image()


@pytest.fixture(scope="module")
def wan_dir(models_root):
    """The module's model folder: tiny Wan 2.1 I2V, Wan 2.2 A14B I2V and (for the refusal) Wan 2.1 T2V."""
    make_tiny_model(str(models_root / MODELS["wan21"]), 0)
    make_tiny_model(str(models_root / MODELS["wan22"]), 0, two_experts=True)
    make_tiny_t2v(str(models_root / MODELS["t2v"]), 0)
    return models_root


def one_shot(folder, batch_size: int = 1, image: torch.Tensor = IMAGE) -> torch.Tensor:
    """WanImageToVideoPipeline's latents in one call, as ComfyUI's LATENT (un-normalised), from the start image."""
    second = {"guidance_scale_2": CFG_2} if has_second_expert(pipeline_config(str(folder))) else {}
    return wan_latents(folder, "WanImageToVideoPipeline", batch_size, image, SEED, max_sequence_length=TOKENS, **second)


# -- the adapter in one process ---------------------------------------------------------------------------------
def test_staged_equals_one_shot_and_reads_the_start_image(wan_dir):
    """Wan 2.1 I2V's staged clip is the pipeline's (the start image through the VAE and the CLIP encoder); another
    start image makes another clip."""
    folder = str(wan_dir / MODELS["wan21"])
    cpu = Placement("cpu")
    text = wan_i2v.load_text_encoders(folder, torch.float32, cpu)
    embeds = wan_i2v.encode(text, Prompts((PROMPT,), negative_prompts=(NEGATIVE,), max_sequence_length=TOKENS))
    transformer = wan_i2v.load_transformer(folder, torch.float32, cpu)
    assert transformer.config.image_dim is not None and transformer.config.in_channels == 36
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
    latent = wan_i2v.denoise(folder, transformer, embeds, sampling, image=IMAGE)
    assert latent.shape == (1, 16, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)
    assert (latent - one_shot(folder)).abs().max().item() <= 1e-5
    other = wan_i2v.denoise(folder, transformer, embeds, sampling, image=start_image(shift=100))
    assert (other - latent).abs().max().item() > 1e-3
    with pytest.raises(ValueError, match="one image"):
        wan_i2v.denoise(folder, transformer, embeds, sampling)


# -- the widgets, before anything loads ------------------------------------------------------------------------
def backend(ranks: int = 2):
    return default_spec(ranks=ranks, device="cpu", memory_policy="staged")


def _validate(name: str, conditioning=None, **widgets) -> None:
    transformer = jobs.plan_transformer(backend(), model=MODELS[name], strategy="context_parallel")
    args = {"steps": STEPS, "width": WIDTH, "height": HEIGHT, "batch_size": 1, "true_cfg_scale": CFG}
    jobs.validate_sample(transformer, conditioning, **{**args, "sampler": "uni_pc", "length": FRAMES, **widgets})


def _read(name: str, image) -> jobs.ReferenceImage:
    transformer = jobs.plan_transformer(backend(), model=MODELS[name], strategy="context_parallel")
    (reference,) = jobs.read_reference_images(transformer, {"image": image}, (WIDTH, HEIGHT))
    return reference


def _short_text() -> None:
    embeds = torch.zeros(1, 64, 32)
    tensors = {"prompt_embeds": embeds, "negative_prompt_embeds": embeds}
    _validate("wan21", jobs.Conditioning(None, (PROMPT,), tensors, source="a test"), references_linked=("image",))


@pytest.mark.parametrize(
    "call, hint",
    [
        (lambda: _validate("wan21"), "starts its clip from an image; link the clip's first frame"),
        (lambda: _validate("t2v", references_linked=("image",)), r"reads no reference image; unlink it.*Wan I2V"),
        (lambda: _read("wan22", torch.cat([IMAGE, IMAGE])), "starts every clip from one"),
        (_short_text, "64 text tokens.*max_sequence_length 512"),
    ],
    ids=["no-start-image", "t2v-given-one", "two-start-images", "text-not-512"],
)
def test_start_image_and_text_refused_before_anything_runs(wan_dir, call, hint):
    with pytest.raises(InvalidInput, match=hint) as info:
        call()
    assert info.value.widget in ("image", "positive")


def test_the_start_image_runs_at_the_clips_size(wan_dir):
    reference = _read("wan22", IMAGE)
    assert reference.describe() == "start image 56×40, resized to 48×32"
    # Its 56×40 adds no tokens: 48×32 × 5 frames split over 2 ranks, with a start image of any size.
    _validate("wan22", references=(reference,))


# -- the memory check, before anything loads ---------------------------------------------------------------------
def _parameters(folder) -> int:
    """Every tensor's elements in a folder's safetensors files, read with safetensors itself."""
    from safetensors import safe_open

    count = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            count += sum(f.get_tensor(key).numel() for key in f.keys())
    return count


def _clip_tokens(folder) -> int:
    """The tokens Wan 2.1 I2V's CLIP encoder gives one image, as the pipeline takes them (its hidden states before the
    last layer), from running the folder's encoder on one picture."""
    from transformers import CLIPImageProcessor, CLIPVisionModel

    encoder = CLIPVisionModel.from_pretrained(folder / "image_encoder")
    processor = CLIPImageProcessor.from_pretrained(folder / "image_processor")
    pixels = processor(images=Image.new("RGB", (56, 40)), return_tensors="pt")
    with torch.no_grad():
        hidden = encoder(pixel_values=pixels["pixel_values"], output_hidden_states=True).hidden_states[-2]
    return hidden.shape[1]


@pytest.mark.parametrize("name, loaded", [("wan21", ("vae", "image_encoder")), ("wan22", ("vae",))])
def test_the_memory_check_counts_what_the_denoise_loads_for_the_start_image(wan_dir, name, loaded):
    """The VAE and (Wan 2.1) the CLIP image encoder load in the denoise beside the transformer on every rank: the
    estimate counts their weights (their parameters × the dtype's size, whether the transformer is resident or not),
    and the CLIP tokens beside Wan 2.1's text; Wan 2.2 I2V has no image encoder and no image tokens. Against the
    same folder read as text-to-video (the ``wan`` family), which loads neither."""
    from parallel_runtime.estimates import activation_bytes, hidden_size
    from parallel_runtime.worker import memory

    folder = wan_dir / MODELS[name]
    transformer = jobs.plan_transformer(backend(), model=MODELS[name], strategy="cfg_parallel")
    plan = transformer.plan
    sampling = Sampling(seed=SEED, steps=STEPS, guidance_scale=1.0, width=WIDTH, height=HEIGHT, frames=FRAMES)
    common = dict(local_ranks=1, loads_weights=False, freed_by_load=0)
    args = (str(folder), plan, sampling, TOKENS, torch.float32, torch.device("cpu"))
    started = memory.check_denoise(wan_i2v, *args, references=True, **common)
    as_t2v = memory.check_denoise(family_adapter("wan"), *args, references=True, **common)
    components = sum(_parameters(folder / c) for c in loaded) * 4  # fp32
    assert started.components == started.weights == components > 0 and as_t2v.weights == as_t2v.components == 0
    assert {c for c in ("vae", "image_encoder") if (folder / c).is_dir()} == set(loaded)
    clip = _clip_tokens(folder) if name == "wan21" else 0
    assert (clip > 0) == (name == "wan21")
    video = ((FRAMES - 1) // 4 + 1) * (WIDTH // 16) * (HEIGHT // 16)
    hidden = hidden_size(transformer.config)
    assert started.activations == activation_bytes(plan, hidden, video + TOKENS + clip, 1, 4)
    assert as_t2v.activations == activation_bytes(plan, hidden, video + TOKENS, 1, 4)


def test_a_start_image_short_of_memory_is_refused_naming_what_loads(wan_dir, monkeypatch):
    """A device whose free memory holds the transformer and its step (as the folder read as text-to-video needs) but
    not the VAE and image encoder beside them: refused before anything loads, the message naming them and the fix."""
    from parallel_runtime.wire import Memory
    from parallel_runtime.worker import memory
    from parallel_runtime.worker.ops import WidgetError

    folder = str(wan_dir / MODELS["wan21"])
    plan = jobs.plan_transformer(backend(), model=MODELS["wan21"], strategy="cfg_parallel").plan
    sampling = Sampling(seed=SEED, steps=STEPS, guidance_scale=1.0, width=WIDTH, height=HEIGHT, frames=FRAMES)
    args = (folder, plan, sampling, TOKENS, torch.float32, torch.device("cpu"))
    common = dict(local_ranks=1, loads_weights=True, freed_by_load=0, references=True)
    as_t2v = memory.check_denoise(family_adapter("wan"), *args, **common)
    free = int((as_t2v.activations + as_t2v.weights) / memory.HEADROOM) + 1  # the transformer's step just fits
    monkeypatch.setattr(memory, "memory_of", lambda device: Memory(kind="cpu", total_bytes=free, free_bytes=free))
    assert memory.check_denoise(family_adapter("wan"), *args, **common) == as_t2v
    with pytest.raises(WidgetError) as info:
        memory.check_denoise(wan_i2v, *args, **common)
    message = str(info.value)
    assert info.value.widget == "width" and "the vae and image_encoder the denoise loads beside" in message
    assert "tensor_parallel or device_map" in message and "context_parallel over more ranks" in message


# -- the strategies on real ranks -----------------------------------------------------------------------------
def check(
    wan_dir,
    name: str,
    strategy: str,
    *,
    batch_size: int = 1,
    ranks: int = 2,
    tolerance: float = 1e-4,
    model: str | None = None,
    reference=None,
    **args,
):
    """The clips' LATENT of ``name`` (or of ``model``, a converted folder of the same kind whose diffusers twin is
    ``reference``) under ``strategy`` through the nodes' steps, against the one-shot pipeline's."""
    model = model or MODELS[name]
    second = CFG_2 if name == "wan22" else 0.0
    widgets = {"batch_size": batch_size, "guidance_scale_2": second, "image": IMAGE}
    latent = wan_clip_latent(backend(ranks), model, strategy, args, TOKENS, **widgets)
    reference = one_shot(reference or wan_dir / model, batch_size)
    assert latent.shape == reference.shape == (batch_size, 16, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)
    diff = (latent - reference).abs().max().item()
    print(f"{name} {strategy} {args} on {ranks} ranks: max |diff| vs one-shot {diff:.3g}")
    assert diff <= tolerance


CASES = [
    # (id, model, strategy, widgets)
    ("ulysses_wan21", "wan21", "context_parallel", {"ulysses_degree": 2}),
    ("cfg_parallel_wan22_two_experts", "wan22", "cfg_parallel", {}),
]


@pytest.mark.multirank
@pytest.mark.parametrize("name, strategy, args", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_strategy_matches_one_shot(wan_dir, name, strategy, args):
    check(wan_dir, name, strategy, **args)


SLOW_CASES = [
    # (id, model, strategy, widgets, batch_size)
    ("device_map_wan22_two_experts", "wan22", "device_map", {}, 1),
    ("data_parallel_wan21", "wan21", "data_parallel", {}, 2),
    # The pack's plan splits Wan 2.1 I2V's image projections too (families/wan/tp_plan.py).
    ("tensor_parallel_wan21", "wan21", "tensor_parallel", {}, 1),
    ("ring_wan21", "wan21", "context_parallel", {"ring_degree": 2, "ulysses_degree": 1}, 1),
]


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, strategy, args, batch_size", [c[1:] for c in SLOW_CASES], ids=[c[0] for c in SLOW_CASES]
)
def test_more_strategies_match_one_shot(wan_dir, name, strategy, args, batch_size):
    # Data parallel is not bit-exact: CPU GEMM kernels block differently for another batch size.
    check(wan_dir, name, strategy, batch_size=batch_size, **args)


@pytest.mark.multirank
def test_comfyui_files_run_on_ranks_as_the_diffusers_folder(wan_dir, tmp_path_factory, monkeypatch):
    """Wan 2.1 I2V from ComfyUI's four files (the transformer, UMT5, Wan 2.1's VAE and clip_vision_h), converted by
    ParallelModelFromComfyFiles' step and run under ulysses 2 on the module's backend: the clip equals
    WanImageToVideoPipeline's on the diffusers folder of the same weights."""
    from parallel_runtime.families.wan.comfy_tiny import make_tiny_wan_files

    base = tmp_path_factory.mktemp("wan21-i2v-files")
    made = make_tiny_wan_files(str(base / "models"), str(base / "reference"), formats=("bf16",), i2v=True)
    names, reference = made["bf16"]
    monkeypatch.setenv("COMFY_PARALLEL_COMFY_MODELS", str(base / "models"))
    monkeypatch.setenv("COMFY_PARALLEL_CONVERTED", str(base / "converted"))
    model, plan = jobs.model_from_comfy_files(**names)
    assert plan.variant.startswith("Wan 2.1 I2V")
    check(wan_dir, "wan21", "context_parallel", ulysses_degree=2, model=model, reference=reference)
