"""Helpers that several test modules share (tests/README.md): one home, instead of test modules importing each other."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from diffusers import Flux2Pipeline, QwenImagePipeline
from safetensors.torch import load_file

from parallel_runtime import default_spec, jobs, model_folders

# -- the strategies' images through the nodes' steps (test_strategies and the modules that hold other paths to it) --
MODEL = "tiny-flux"
PROMPT = "a photo of a horse in the city"
STEPS, TOKENS = 2, 32

# The families added after FLUX.1, run through the same nodes. Plain Ulysses / Ring split the text tokens too, so the
# settings keep them divisible by 2: FLUX.2 pads to max_sequence_length (its 31-token tiny system message included);
# Qwen-Image keeps each prompt's own length, so a short max_sequence_length cuts the prompt (13 tokens) and the
# negative prompt (8) to 8.
NEW_FAMILIES = {
    "flux2": {
        "model": "tiny-flux2",
        "pipeline": Flux2Pipeline,
        "max_sequence_length": 48,
        "encode": {},
        "sample": {"guidance_scale": 4.0},
        "reference": {"guidance_scale": 4.0},
    },
    "qwenimage": {
        "model": "tiny-qwenimage",
        "pipeline": QwenImagePipeline,
        "max_sequence_length": 8,
        "encode": {"negative_prompt": "a blue painting"},
        "sample": {"guidance_scale": 3.5, "true_cfg_scale": 4.0},
        "reference": {"negative_prompt": "a blue painting", "true_cfg_scale": 4.0},
    },
}


def generate(
    spec,
    strategy: str,
    *,
    model: str = MODEL,
    seed: int = 3,
    guidance_scale: float = 3.5,
    tokens: int = TOKENS,
    width: int = 64,
    height: int = 64,
    batch_size: int = 1,
    **strategy_args,
) -> torch.Tensor:
    """The IMAGE of ``model`` (a FLUX.1 or a model of its settings) under ``strategy`` through the pack's steps."""
    positive = jobs.encode_prompt(spec, model=model, prompt=PROMPT, max_sequence_length=tokens)
    transformer = jobs.plan_transformer(spec, model=model, strategy=strategy, **strategy_args)
    latent = jobs.sample(
        transformer,
        positive,
        seed=seed,
        steps=STEPS,
        guidance_scale=guidance_scale,
        width=width,
        height=height,
        batch_size=batch_size,
    )
    return jobs.decode(spec, model=model, samples=latent)


def with_references(
    model: str, strategy: dict, *, tokens: int, sampler: dict, batch_size: int = 1, **images: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(LATENT, IMAGE) of an edit or reference model under ``strategy`` on 2 CPU ranks through the pack's steps, the
    reference ``images`` by the sampler's inputs (``image``, ``image_2``, ...), ``sampler``'s widgets (seed, steps,
    guidance_scale, width, height)."""
    spec = default_spec(ranks=2, device="cpu", memory_policy="staged")
    positive = jobs.encode_prompt(spec, model=model, prompt=PROMPT, max_sequence_length=tokens)
    transformer = jobs.plan_transformer(spec, model=model, **strategy)
    latent = jobs.sample(transformer, positive, batch_size=batch_size, **sampler, **images)
    return latent, jobs.decode(spec, model=model, samples=latent)


def family_reference(
    folder, name: str, seed: int, batch_size: int = 1, width: int = 64, height: int = 64, **overrides
) -> torch.Tensor:
    """The one-shot pipeline of family ``name`` on the diffusers ``folder``: its IMAGE, image i from seed + i. A folder
    that stores fp8 gets its scales applied (``apply_fp8_scales``)."""
    family = NEW_FAMILIES[name]
    pipe = family["pipeline"].from_pretrained(folder, dtype=torch.float32)  # as the CPU ranks run it
    apply_fp8_scales(pipe.transformer, folder)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {"max_sequence_length": family["max_sequence_length"], **family["reference"], **overrides}
    return pipe(
        prompt=PROMPT,
        num_inference_steps=STEPS,
        width=width,
        height=height,
        num_images_per_prompt=batch_size,
        generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(batch_size)],
        output_type="pt",
        **kwargs,
    ).images.permute(0, 2, 3, 1)


def generate_family(
    spec,
    name: str,
    strategy: str,
    *,
    seed=3,
    batch_size=1,
    width=64,
    height=64,
    encode=None,
    model: str | None = None,
    **strategy_args,
):
    family = {**NEW_FAMILIES[name], **({"model": model} if model else {})}
    encode = {"max_sequence_length": family["max_sequence_length"], **family["encode"], **(encode or {})}
    positive = jobs.encode_prompt(spec, model=family["model"], prompt=PROMPT, **encode)
    transformer = jobs.plan_transformer(spec, model=family["model"], strategy=strategy, **strategy_args)
    latent = jobs.sample(
        transformer,
        positive,
        seed=seed,
        steps=STEPS,
        width=width,
        height=height,
        batch_size=batch_size,
        **family["sample"],
    )
    return latent, jobs.decode(spec, model=family["model"], samples=latent)


def apply_fp8_scales(transformer: torch.nn.Module, folder) -> None:
    """diffusers' own reading of a converted fp8 folder, made what it means, independently of the pack's loader and
    hook: ``from_pretrained`` cast each fp8 weight up (exact) and left its ``<layer>.weight_scale`` unread; here each
    such weight is multiplied by its scale in float32."""
    sub = os.path.join(folder, "transformer")
    with torch.no_grad():
        for file in sorted(f for f in os.listdir(sub) if f.endswith(".safetensors")):
            for key, scale in load_file(os.path.join(sub, file)).items():
                if key.endswith(".weight_scale"):
                    weight = transformer.get_submodule(key.rsplit(".", 1)[0]).weight
                    scale = scale.float() if scale.numel() == 1 else scale.float().reshape(-1, 1)
                    weight.copy_((weight.float() * scale).to(weight.dtype))


@contextlib.contextmanager
def comfy_files_listed(models, converted) -> Iterator[None]:
    """ComfyUI's model folder ``models`` listed for Model from ComfyUI Files (COMFY_PARALLEL_COMFY_MODELS) and its
    conversions written below ``converted`` (COMFY_PARALLEL_CONVERTED) for the block, the environment restored after."""
    names = ("COMFY_PARALLEL_COMFY_MODELS", "COMFY_PARALLEL_CONVERTED")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(zip(names, (str(models), str(converted)), strict=True))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def component_tensors(folder, component: str) -> dict[str, torch.Tensor]:
    """Every tensor of a diffusers folder's ``component``, from all its safetensors files."""
    sub = os.path.join(folder, component)
    out = {}
    for f in sorted(f for f in os.listdir(sub) if f.endswith(".safetensors")):
        out |= load_file(os.path.join(sub, f))
    return out


def fp8_meaning(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A converted transformer's tensors as they mean (what the reference folder holds): each fp8 weight cast to
    float32, times its ``.weight_scale`` when it has one, in bf16 (the tiny files' other dtype); the scales gone.
    Checks, too, that every fp8 weight of a scaled file kept its scale."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    scales = {k.removesuffix("_scale"): v for k, v in tensors.items() if k.endswith(".weight_scale")}
    out = {}
    for key, value in tensors.items():
        if key.endswith(".weight_scale"):
            continue
        if value.dtype in fp8:
            value = value.float()
            if key in scales:
                scale = scales[key]
                value = value * (scale if scale.numel() == 1 else scale.reshape(-1, 1))
            value = value.to(torch.bfloat16)
        out[key] = value
    assert set(scales) <= set(out)
    return out


def converted_and_one_shot(made: dict, pipeline: type, *, guidance_scale: float, tokens: int, fmt: str = "fp8_scaled"):
    """The ``fmt`` files of ``made`` converted, and ``pipeline``'s one-shot image on the converted folder as diffusers
    reads it (its fp8 weights cast up, their scales applied by ``apply_fp8_scales``): (model name, (seed, width,
    height, batch_size) -> IMAGE, image i from seed + i)."""
    names, _ = made[fmt]
    name, _ = jobs.model_from_comfy_files(**names)
    folder = model_folders.resolve(name).path
    pipe = pipeline.from_pretrained(folder, dtype=torch.float32)
    apply_fp8_scales(pipe.transformer, folder)
    return name, one_shot_images(pipe, guidance_scale=guidance_scale, max_sequence_length=tokens)


def one_shot_images(pipe, **settings) -> Callable[..., torch.Tensor]:
    """``pipe``'s one-shot IMAGE of ``PROMPT`` at ``(seed, width, height, batch_size=1)``, image i from seed + i, each
    made once: the reference a strategy's image must match."""
    pipe.set_progress_bar_config(disable=True)
    cache = {}

    def reference(seed: int, width: int, height: int, batch_size: int = 1) -> torch.Tensor:
        key = (seed, width, height, batch_size)
        if key not in cache:
            cache[key] = pipe(
                prompt=PROMPT,
                num_inference_steps=STEPS,
                width=width,
                height=height,
                num_images_per_prompt=batch_size,
                output_type="pt",
                generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(batch_size)],
                **settings,
            ).images.permute(0, 2, 3, 1)
        return cache[key]

    return reference


# -- check scripts on real ranks ---------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]


def run_ranks(script: Path, nproc: int, work: Path, *cases: str, timeout: float = 600) -> dict:
    """``script RESULTS_JSON CASE...`` on ``nproc`` CPU ranks under torchrun (gloo, a CPU-only view even on a GPU
    machine), and the results its rank 0 wrote there. torchrun's logs go into ``work``: by default it leaves a
    torchelastic_* folder in /tmp per launch."""
    results = work / "results.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "CUDA_VISIBLE_DEVICES": "",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--log-dir", str(work / "torchelastic"), str(script), str(results), *cases]  # fmt: skip
    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert process.returncode == 0, process.stderr[-4000:]
    return json.loads(results.read_text())


# -- waiting on events ---------------------------------------------------------------------------------------------


def wait_for(predicate: Callable[[], object], timeout: float, what: str, poll_s: float = 0.05) -> object:
    """Wait until ``predicate()`` is true and return its value; fail naming ``what`` once ``timeout`` s have passed.
    The way a test waits on an event it cannot be told about (a process state, a file, a log line)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(poll_s)
    return value


def at_step(step: int, action: Callable[..., object], *args: object) -> Callable[[int, int, object], None]:
    """An ``on_progress`` that calls ``action(*args)`` once, when a run reports step ``step``: a fault struck mid-run on
    a machine of any speed, where a timer could strike before the first step or after the last."""
    done: list[int] = []

    def on_progress(reached: int, _total: int, _preview: object) -> None:
        if reached >= step and not done:
            done.append(reached)
            action(*args)

    return on_progress


# -- Wan's clips (test_wan, test_wan_i2v, test_wan_ti2v and test_wan_comfyui) --------------------------------------
# A tiny clip: 5 frames (2 latent frames) of 48×32, CFG against a negative prompt, prompts padded to 16 tokens.
WAN_CLIP = {
    "prompt": "a photo of a cat",
    "negative_prompt": "a blue painting",
    "guidance_scale": 4.0,
    "width": 48,
    "height": 32,
    "num_frames": 5,
    "num_inference_steps": 2,
    "max_sequence_length": 16,
}
_WAN_PIPELINES: dict[str, object] = {}


def wan_start_image(shift: int = 0) -> torch.Tensor:
    """A clip's 56×40 start picture, an IMAGE [1, H, W, 3] of 8-bit values as LoadImage gives (the pipelines resize
    it to the clip's size)."""
    pixels = (torch.arange(40 * 56 * 3) * 7 + shift) % 251
    return (pixels.reshape(1, 40, 56, 3).float() / 255.0).contiguous()


_WAN_LATENT_PIPELINES: dict[tuple[str, str], object] = {}


def wan_latents(
    folder, pipeline: str, batch_size: int = 1, image: torch.Tensor | None = None, seed: int = 3, **overrides
) -> torch.Tensor:
    """diffusers' ``pipeline`` ("WanPipeline", "WanImageToVideoPipeline") on ``folder`` in one call on ``WAN_CLIP``
    (``overrides`` changed), its latents as ComfyUI's LATENT (un-normalised by the VAE's statistics): clip i from
    seed + i, one prompt per clip (with num_videos_per_prompt > 1 the I2V pipeline repeats Wan 2.1 I2V's image tokens
    per prompt, not per clip, and its transformer fails on the mismatch, diffusers 0.42.1), the start ``image`` as the
    PIL picture it was loaded from. A folder's pipeline of a class is loaded once."""
    import diffusers
    from PIL import Image

    from parallel_runtime.families.base import latent_statistics

    key = (str(folder), pipeline)
    if key not in _WAN_LATENT_PIPELINES:
        _WAN_LATENT_PIPELINES[key] = getattr(diffusers, pipeline).from_pretrained(folder, dtype=torch.float32)
        _WAN_LATENT_PIPELINES[key].set_progress_bar_config(disable=True)
    call = {**WAN_CLIP, **overrides}
    start = {} if image is None else {"image": Image.fromarray((image[0] * 255).round().to(torch.uint8).numpy())}
    latents = _WAN_LATENT_PIPELINES[key](
        **{**call, "prompt": [call["prompt"]] * batch_size, "negative_prompt": [call["negative_prompt"]] * batch_size},
        **start,
        generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(batch_size)],
        output_type="latent",
    ).frames
    mean, inverse_std = latent_statistics(diffusers.AutoencoderKLWan.load_config(folder, subfolder="vae"))
    return latents / inverse_std + mean


def wan_clip_prompt(spec, model: str):
    """``WAN_CLIP``'s prompt and negative prompt through EncodeOnBalancedGPUs' step, for ``model`` on ``spec``."""
    return jobs.encode_prompt(
        spec,
        model=model,
        prompt=WAN_CLIP["prompt"],
        negative_prompt=WAN_CLIP["negative_prompt"],
        max_sequence_length=WAN_CLIP["max_sequence_length"],
    )


def wan_clip_sample(handle, positive, guidance_scale_2: float = 0.0, **extra):
    """``WAN_CLIP``'s clip through ParallelSampler's step (uni_pc, seed 3, true CFG at its ``guidance_scale``), its
    LATENT; ``extra``: the step's other arguments (``on_result``, ``on_progress``) or other widgets than ``WAN_CLIP``'s
    (``steps``, ``batch_size``, ``image``, ...)."""
    settings = {
        "seed": 3,
        "steps": WAN_CLIP["num_inference_steps"],
        "guidance_scale": 1.0,
        "true_cfg_scale": WAN_CLIP["guidance_scale"],
        "width": WAN_CLIP["width"],
        "height": WAN_CLIP["height"],
        "sampler": "uni_pc",
        "length": WAN_CLIP["num_frames"],
        "guidance_scale_2": guidance_scale_2,
    }
    return jobs.sample(handle, positive, **{**settings, **extra})


def wan_clip_latent(
    spec, model: str, strategy: str, strategy_args: dict, max_sequence_length: int | None = None, **widgets
) -> torch.Tensor:
    """``WAN_CLIP``'s clip of ``model`` under ``strategy`` (``strategy_args``: LoadShardedTransformer's degrees) through
    the nodes' steps (EncodeOnBalancedGPUs, LoadShardedTransformer, ``wan_clip_sample``): its LATENT. ``widgets``
    change ParallelSampler's (``batch_size``, ``image``, ``guidance_scale_2``, ...)."""
    positive = jobs.encode_prompt(
        spec,
        model=model,
        prompt=WAN_CLIP["prompt"],
        negative_prompt=WAN_CLIP["negative_prompt"],
        max_sequence_length=max_sequence_length or WAN_CLIP["max_sequence_length"],
    )
    transformer = jobs.plan_transformer(spec, model=model, strategy=strategy, **strategy_args)
    return wan_clip_sample(transformer, positive, **widgets)


def wan_one_shot(folder, seed: int = 3, batch_size: int = 1, output_type: str = "pt", **overrides):
    """diffusers' WanPipeline (its own UniPC scheduler) in one call on ``WAN_CLIP``: its ``frames`` output, clip i from
    a generator seeded seed + i; the pipeline of a folder is loaded once."""
    from diffusers import WanPipeline

    if str(folder) not in _WAN_PIPELINES:
        _WAN_PIPELINES[str(folder)] = WanPipeline.from_pretrained(folder, dtype=torch.float32)
        _WAN_PIPELINES[str(folder)].set_progress_bar_config(disable=True)
    return _WAN_PIPELINES[str(folder)](
        **{**WAN_CLIP, **overrides},
        num_videos_per_prompt=batch_size,
        generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(batch_size)],
        output_type=output_type,
    ).frames
