"""The generation steps as the nodes ask for them: validate the widgets, then call the backend.

Each function checks everything that can be checked without weights first (raising ``InvalidInput`` that
names the widget and the fix), then runs one op. What travels between steps are plain values: the
``Conditioning`` (embeddings, on the CPU), a ``TransformerHandle`` (a validated spec; nothing loaded yet),
LATENT samples and IMAGE tensors in ComfyUI's conventions.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch

from . import model_folders
from .client import ProgressFn, get_backend
from .errors import InvalidInput
from .spec import BackendSpec, cuda_device_count

DTYPES = ("auto", "bfloat16", "float16", "float32")
STRATEGIES = ("device_map", "context_parallel", "tensor_parallel", "tp_cp", "data_parallel")
ATTENTION_BACKENDS = ("auto", "native", "_native_flash", "_native_cudnn", "flash", "sage")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|KIB|MB|MIB|GB|GIB|TB|TIB)\s*$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class FamilyRules:
    """What differs between model families where the client validates widgets (before any weights load)."""

    name: str  # the family's name for users
    max_sequence_length: int  # the longest text the pipeline takes
    pads_text: bool  # text is padded to max_sequence_length; otherwise it keeps the prompt's own length
    text_encoders: int  # with 2, prompt_2 feeds the second one
    true_cfg: bool  # a negative prompt and true_cfg_scale: two transformer passes per step
    min_steps: int
    # LATENT layout, read against the VAE's config: accepted tensor ranks, the config key of the VAE's channels and
    # how many of them one LATENT channel group holds (2x2 patches: 4).
    latent_ndims: tuple[int, ...]
    vae_channels_key: str
    latent_channels_per_vae_channel: int = 1
    # Pixels per image token along each side. The denoise stage runs the pipeline with vae=None, which assumes an 8x
    # VAE, and every family packs 2x2 latent patches into one token: 16.
    pixels_per_token: int = 16


# Keyed by the family adapter's module name (model_folders.PIPELINES).
FAMILIES = {
    # T5 is trained on at most 512 tokens and FluxPipeline refuses more; CLIP + T5.
    "flux": FamilyRules("FLUX.1", max_sequence_length=512, pads_text=True, text_encoders=2, true_cfg=False,
                        min_steps=1, latent_ndims=(4,), vae_channels_key="latent_channels"),
    # Flux2Pipeline's tokenizer_max_length, system message included. ComfyUI's FLUX.2 LATENT is the VAE's latent in
    # 2x2 patches (128 channels at 16x for the real 32-channel VAE).
    "flux2": FamilyRules("FLUX.2", max_sequence_length=512, pads_text=True, text_encoders=1, true_cfg=False,
                         min_steps=1, latent_ndims=(4,), vae_channels_key="latent_channels",
                         latent_channels_per_vae_channel=4),
    # QwenImagePipeline refuses more than 1024 tokens and does not pad. Its scheduler's shift_terminal stretch
    # divides by zero on a one-step schedule (NaN image). The LATENT is a one-frame video latent [B, C, 1, h, w]
    # (ComfyUI's Wan 2.1 format); a 4-D one is taken as that frame.
    "qwenimage": FamilyRules("Qwen-Image", max_sequence_length=1024, pads_text=False, text_encoders=1, true_cfg=True,
                             min_steps=2, latent_ndims=(5, 4), vae_channels_key="z_dim"),
}
# The widget's limit: the longest any family takes (each family checks its own).
MAX_SEQUENCE_LENGTH = max(rules.max_sequence_length for rules in FAMILIES.values())


def family_of(model_dir: str) -> str:
    """The family adapter's name of a resolved model folder (``model_folders.resolve`` checked it is supported)."""
    return model_folders.PIPELINES[model_folders.pipeline_class(model_dir)][0]


@dataclasses.dataclass(frozen=True)
class Conditioning:
    """Encoded prompts of one model, on the CPU: ``prompt_embeds`` and what the family adds (FLUX.1:
    ``pooled_prompt_embeds``; Qwen-Image: ``prompt_embeds_mask`` and the negative prompt's
    ``negative_prompt_embeds`` / ``negative_prompt_embeds_mask``)."""

    model: str
    prompts: tuple[str, ...]
    tensors: dict[str, torch.Tensor] = dataclasses.field(compare=False)
    family: str = "flux"  # a key of FAMILIES
    negative_prompts: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class TransformerHandle:
    """A validated transformer spec. The backend loads it on first use, so text encoders and transformer are
    never forced to be resident at the same time."""

    backend: BackendSpec
    model: str
    model_dir: str
    strategy: tuple[tuple[str, object], ...]  # the worker's strategy dict, frozen
    max_memory: tuple[tuple[str, str], ...] | None
    dtype: str
    config: tuple[tuple[str, object], ...]  # the transformer's config.json, for validation
    family: str = "flux"  # a key of FAMILIES


def resolve_dtype(dtype: str, spec: BackendSpec, widget: str = "dtype") -> str:
    if dtype not in DTYPES:
        raise InvalidInput(widget, f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if dtype == "auto":
        # bf16 is what FLUX and Qwen-Image ship in; on CPU float32 is the fast and exact choice.
        return "bfloat16" if spec.device == "cuda" else "float32"
    return dtype


def parse_max_memory(text: str, widget: str = "max_memory") -> dict[str, str] | None:
    """``"0:16GB,1:16GB,cpu:64GB"`` -> ``{"0": "16GB", "1": "16GB", "cpu": "64GB"}``; empty -> None (no limit)."""
    if not text or not text.strip():
        return None
    budget = {}
    for part in text.split(","):
        device, sep, size = part.partition(":")
        device = device.strip().lower()
        if not sep or not (device.isdigit() or device == "cpu") or not _SIZE.match(size):
            raise InvalidInput(widget, f"could not read {part.strip()!r}; write device:size pairs such as "
                                       "0:16GB,1:16GB (GPU index or cpu, size in MB/GB/GiB), or leave it empty")
        if device in budget:
            raise InvalidInput(widget, f"device {device} is listed twice; give each device one size")
        budget[device] = size.strip().upper().replace("IB", "iB")
    gpus = [int(d) for d in budget if d.isdigit()]
    if gpus and max(gpus) >= max(cuda_device_count(), 1) and cuda_device_count() > 0:
        raise InvalidInput(widget, f"GPU {max(gpus)} does not exist; this machine has {cuda_device_count()} GPUs "
                                   f"(0..{cuda_device_count() - 1})")
    return budget


def _prompt_list(text: str, one_per_line: bool) -> list[str]:
    """The prompts a widget holds: the whole text, or each non-empty line of it."""
    if not one_per_line:
        return [text]
    return [line.strip() for line in text.splitlines() if line.strip()]


def count_prompts(prompt: str, one_prompt_per_line: bool) -> int:
    """How many prompts EncodeOnBalancedGPUs makes of its ``prompt`` widget."""
    return len(_prompt_list(prompt, one_prompt_per_line))


@dataclasses.dataclass(frozen=True)
class EncodeRequest:
    """EncodeOnBalancedGPUs' widgets, checked: what the encode op needs, minus the backend."""

    model_dir: str
    family: str
    prompts: list[str]
    prompts_2: list[str] | None
    max_memory: dict[str, str] | None


def validate_encode(*, model: str, prompt: str, prompt_2: str = "", max_sequence_length: int = 512,
                    max_memory: str = "", one_prompt_per_line: bool = False) -> EncodeRequest:
    """Every check EncodeOnBalancedGPUs can make before it runs (also its VALIDATE_INPUTS)."""
    model_dir = model_folders.resolve(model)
    family = family_of(model_dir)
    rules = FAMILIES[family]
    prompts = _prompt_list(prompt, one_prompt_per_line)
    if not prompt.strip():
        raise InvalidInput("prompt", "the prompt is empty; describe the image to generate")
    if prompt_2.strip() and rules.text_encoders < 2:
        raise InvalidInput("prompt_2", f"{rules.name} has one text encoder, so prompt_2 has nothing to feed; leave it "
                                       "empty and put everything in prompt")
    prompts_2 = _prompt_list(prompt_2, one_prompt_per_line) if prompt_2.strip() else None
    if prompts_2 is not None and len(prompts_2) != len(prompts):
        raise InvalidInput("prompt_2", f"one_prompt_per_line is on: prompt has {len(prompts)} lines but prompt_2 has "
                                       f"{len(prompts_2)}; give prompt_2 one line per prompt, or leave it empty")
    if not 1 <= max_sequence_length <= rules.max_sequence_length:
        raise InvalidInput("max_sequence_length", f"{max_sequence_length} is out of range for {rules.name}; use "
                                                  f"1..{rules.max_sequence_length}")
    return EncodeRequest(model_dir, family, prompts, prompts_2, parse_max_memory(max_memory))


def encode_prompt(spec: BackendSpec, *, model: str, prompt: str, prompt_2: str = "", negative_prompt: str = "",
                  max_sequence_length: int = 512, max_memory: str = "", dtype: str = "auto",
                  one_prompt_per_line: bool = False, on_progress: ProgressFn | None = None,
                  should_cancel: Callable[[], bool] | None = None) -> Conditioning:
    """Encode ``prompt`` with the model's text encoders placed ``device_map="balanced"`` across the GPUs.

    With ``one_prompt_per_line`` every non-empty line is a prompt of its own (one embedding row each; the sampler
    makes ``batch_size`` images of each, and data parallelism spreads them over the ranks); ``prompt_2`` then holds
    one line per prompt too, or nothing. Families with true CFG (Qwen-Image) also encode ``negative_prompt``, the same
    for every prompt, empty or not, as ComfyUI encodes an empty negative: whether it is used is the sampler's
    ``true_cfg_scale``. Other families ignore it.
    """
    request = validate_encode(model=model, prompt=prompt, prompt_2=prompt_2, max_sequence_length=max_sequence_length,
                              max_memory=max_memory, one_prompt_per_line=one_prompt_per_line)
    prompts, family = request.prompts, request.family
    args = {"model": model, "model_dir": request.model_dir, "prompts": prompts, "prompts_2": request.prompts_2,
            "max_sequence_length": max_sequence_length, "max_memory": request.max_memory,
            "dtype": resolve_dtype(dtype, spec), "memory_policy": spec.memory_policy}
    negative_prompts = (negative_prompt,) * len(prompts) if FAMILIES[family].true_cfg else ()
    if negative_prompts:
        args["negative_prompt"] = list(negative_prompts)
    result = get_backend(spec).call("encode", args, on_progress=on_progress, should_cancel=should_cancel)
    return Conditioning(model=model, prompts=tuple(prompts), tensors=result.tensors, family=family,
                        negative_prompts=negative_prompts)


def _parallel_plans(config: dict) -> tuple[str, bool, bool]:
    """(transformer class name, has a context-parallel plan, has a tensor-parallel plan) of a transformer config."""
    import diffusers

    name = config["_class_name"]
    cls = getattr(diffusers, name, None)
    return name, getattr(cls, "_cp_plan", None) is not None, getattr(cls, "_tp_plan", None) is not None


def _models_with_plan(attribute: str) -> str:
    import diffusers

    names = [n for n in dir(diffusers) if n.endswith("Transformer2DModel") and getattr(getattr(diffusers, n), attribute, None)]
    return ", ".join(sorted(names))


def _context_parallel_plan(config: dict, *, cp_ranks: int, ring_degree: int,
                           ulysses_degree: int, anything: bool, attention_backend: str, tp_degree: int = 1) -> dict:
    """Validated context-parallel settings over ``cp_ranks`` ranks (the whole backend, or one TP slice's worth under
    tp_cp, where each rank holds ``heads / tp_degree`` heads for Ulysses to split)."""
    name, has_cp, _ = _parallel_plans(config)
    heads = config.get("num_attention_heads")
    if not has_cp:
        raise InvalidInput("strategy", f"{name} has no context-parallel plan (_cp_plan) in this diffusers; use "
                                       f"tensor_parallel or data_parallel, or a model that has one: "
                                       f"{_models_with_plan('_cp_plan')}")
    if ring_degree < 1:
        raise InvalidInput("ring_degree", f"{ring_degree} is not a degree; use 1 (no ring) or more")
    if ulysses_degree == 0:
        ulysses_degree = max(1, cp_ranks // ring_degree)
    if ring_degree * ulysses_degree != cp_ranks:
        across = "the backend has" if tp_degree == 1 else f"tp_degree {tp_degree} leaves"
        raise InvalidInput("ulysses_degree", f"ring_degree × ulysses_degree = {ring_degree} × {ulysses_degree} "
                                             f"= {ring_degree * ulysses_degree}, but {across} {cp_ranks} ranks; "
                                             f"make the product {cp_ranks} (ulysses_degree 0 fills the rest)")
    if ring_degree * ulysses_degree == 1:
        raise InvalidInput("ulysses_degree", "context parallelism needs 2 or more ranks; raise ranks on the "
                                             "ParallelBackend node, or use device_map")
    if anything and ring_degree > 1 and ulysses_degree > 1:
        raise InvalidInput("anything", "Ulysses-anything and Ring-anything each work on one axis; set ring_degree "
                                       "or ulysses_degree to 1, or turn anything off")
    if heads and ulysses_degree > 1:
        local = heads // tp_degree
        held = f"{heads} attention heads" if tp_degree == 1 else f"{local} attention heads per TP rank"
        if anything and local < ulysses_degree:
            raise InvalidInput("ulysses_degree", f"Ulysses-anything needs at least as many attention heads as "
                                                 f"ranks: {held} < ulysses_degree {ulysses_degree}")
        if not anything and local % ulysses_degree:
            raise InvalidInput("ulysses_degree", f"{held} do not split over ulysses_degree {ulysses_degree}; use a "
                                                 f"divisor of {local}, or turn anything on")
    if attention_backend not in ATTENTION_BACKENDS:
        raise InvalidInput("attention_backend", f"unknown backend {attention_backend!r}; choose one of "
                                                f"{', '.join(ATTENTION_BACKENDS)}")
    return {"ring_degree": ring_degree, "ulysses_degree": ulysses_degree, "anything": bool(anything),
            "attention_backend": attention_backend}


def _tensor_parallel_degree(config: dict, *, tp_degree: int) -> int:
    """A validated TP degree (the caller checks how it fits the backend's ranks)."""
    name, _, has_tp = _parallel_plans(config)
    heads = config.get("num_attention_heads")
    if not has_tp:
        raise InvalidInput("strategy", f"{name} has no tensor-parallel plan (_tp_plan) in this diffusers; use "
                                       f"context_parallel or data_parallel. Models with one: "
                                       f"{_models_with_plan('_tp_plan')}")
    if heads and heads % tp_degree:
        raise InvalidInput("tp_degree", f"{heads} attention heads do not split over tp_degree {tp_degree}; "
                                        f"use a divisor of {heads} (and as many ranks)")
    return tp_degree


def load_transformer(spec: BackendSpec, *, model: str, strategy: str = "device_map", max_memory: str = "",
                     dtype: str = "auto", ring_degree: int = 1, ulysses_degree: int = 0, anything: bool = False,
                     attention_backend: str = "auto", tp_degree: int = 0) -> TransformerHandle:
    """Validate a transformer spec against the model's config and the backend's world size. Loads nothing.

    ``ulysses_degree`` 0 means every rank the ring (and, under tp_cp, the TP degree) does not use; ``tp_degree`` 0
    means every rank under tensor_parallel.
    """
    model_dir = model_folders.resolve(model)
    if strategy not in STRATEGIES:
        raise InvalidInput("strategy", f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    budget = parse_max_memory(max_memory)
    config = model_folders.read_config(model_dir, "transformer")
    world = spec.world_size
    plan: dict = {"kind": strategy}
    cp_args = {"ring_degree": ring_degree, "ulysses_degree": ulysses_degree, "anything": anything,
               "attention_backend": attention_backend}
    if strategy == "context_parallel":
        plan.update(_context_parallel_plan(config, cp_ranks=world, **cp_args))
    elif strategy == "tensor_parallel":
        tp_degree = tp_degree or world
        if tp_degree != world:
            raise InvalidInput("tp_degree", f"tp_degree {tp_degree} must equal the backend's {world} ranks "
                                            "(0 uses them all; tp_cp combines TP with context parallelism)")
        plan.update(tp_degree=_tensor_parallel_degree(config, tp_degree=tp_degree))
    elif strategy == "tp_cp":
        if tp_degree < 2 or world % tp_degree or world // tp_degree < 2:
            raise InvalidInput("tp_degree", f"tp_cp needs tp_degree ≥ 2 dividing the backend's {world} ranks and "
                                            f"leaving ≥ 2 for context parallelism (e.g. tp_degree 2 on 4 ranks); got "
                                            f"{tp_degree}. With fewer ranks use tensor_parallel or context_parallel")
        plan.update(tp_degree=_tensor_parallel_degree(config, tp_degree=tp_degree))
        plan.update(_context_parallel_plan(config, cp_ranks=world // tp_degree, tp_degree=tp_degree, **cp_args))
    return TransformerHandle(backend=spec, model=model, model_dir=model_dir, strategy=tuple(sorted(plan.items())),
                             max_memory=tuple(sorted(budget.items())) if budget else None,
                             dtype=resolve_dtype(dtype, spec), config=tuple(sorted(config.items(), key=lambda kv: kv[0])),
                             family=family_of(model_dir))


def _check_size(widget: str, value: int, multiple: int) -> None:
    if value < multiple or value % multiple:
        lower, upper = max(multiple, value // multiple * multiple), (value // multiple + 1) * multiple
        raise InvalidInput(widget, f"{value} is not a multiple of {multiple} (the VAE downscales 8× and the transformer "
                                   f"packs 2×2 patches); use {lower} or {upper}")


def _text_streams(rules: FamilyRules, conditioning: Conditioning, true_cfg_scale: float) -> dict[str, torch.Tensor]:
    """The text embeddings the transformer will see, by the prompt they come from."""
    streams = {"prompt": conditioning.tensors["prompt_embeds"]}
    if rules.true_cfg and true_cfg_scale > 1:
        streams["negative prompt"] = conditioning.tensors["negative_prompt_embeds"]
    return streams


def validate_sample(handle: TransformerHandle, conditioning: Conditioning | None, *, steps: int, width: int,
                    height: int, batch_size: int, true_cfg_scale: float = 1.0, prompts: int | None = 1) -> None:
    """Every check ParallelSampler can make before it runs. Without a ``conditioning`` (at validation), ``prompts``
    says how many prompts it will hold; None skips the checks that need to know."""
    rules = FAMILIES[handle.family]
    if steps < rules.min_steps:
        reason = ("would not denoise anything" if rules.min_steps == 1 else
                  f"are too few for {rules.name}: its scheduler's shift_terminal divides by zero on a one-step "
                  "schedule and the image comes out NaN")
        raise InvalidInput("steps", f"{steps} steps {reason}; use at least {rules.min_steps}")
    _check_size("width", width, rules.pixels_per_token)
    _check_size("height", height, rules.pixels_per_token)
    if batch_size < 1:
        raise InvalidInput("batch_size", f"{batch_size} makes no images; use at least 1")
    if rules.true_cfg and true_cfg_scale < 1:
        raise InvalidInput("true_cfg_scale", f"{true_cfg_scale} is below 1; use 1 (true CFG off: one transformer pass "
                                             "per step) or more (guided by the negative prompt: two passes per step)")
    if conditioning is not None and conditioning.family != handle.family:
        raise InvalidInput("positive", f"was encoded with {conditioning.model} ({FAMILIES[conditioning.family].name}) "
                                       f"but the transformer is {handle.model} ({rules.name}); encode with the same "
                                       "model as the transformer")
    if (conditioning is not None and rules.true_cfg and true_cfg_scale > 1
            and "negative_prompt_embeds" not in conditioning.tensors):
        raise InvalidInput("positive", f"has no negative prompt for true CFG; re-encode it with {handle.model}, or set "
                                       "true_cfg_scale to 1")
    strategy = dict(handle.strategy)
    world = handle.backend.world_size
    prompts = len(conditioning.prompts) if conditioning is not None else prompts
    if strategy["kind"] == "data_parallel" and prompts is not None and batch_size * prompts < world:
        made = f"batch_size {batch_size} × {prompts} prompts" if prompts > 1 else f"batch_size {batch_size}"
        raise InvalidInput("batch_size", f"data_parallel gives each of the {world} ranks whole images, so it needs at "
                                         f"least {world} images ({made} makes {batch_size * prompts}); raise "
                                         "batch_size, give more prompts (one_prompt_per_line), or use "
                                         "context_parallel or tensor_parallel to speed up a single image")
    if strategy["kind"] in ("context_parallel", "tp_cp") and not strategy["anything"]:
        degree = strategy["ring_degree"] * strategy["ulysses_degree"]
        # The transformer splits image tokens and text tokens separately across the ranks.
        image_tokens = (width // rules.pixels_per_token) * (height // rules.pixels_per_token)
        if image_tokens % degree:
            raise InvalidInput("width", f"{width}×{height} makes {image_tokens} image tokens, which do not split over "
                                        f"{degree} ranks; turn on anything (Ulysses/Ring-anything) on "
                                        "LoadShardedTransformer, or pick a size whose token count divides")
        for source, embeds in (_text_streams(rules, conditioning, true_cfg_scale) if conditioning else {}).items():
            tokens = embeds.shape[1]
            if not tokens % degree:
                continue
            if rules.pads_text:
                fix = f"set max_sequence_length to a multiple of {degree}, or turn on anything"
            else:
                fix = (f"{rules.name} keeps each prompt's own length, so turn on anything on LoadShardedTransformer, "
                       "or make that prompt a word longer or shorter")
            raise InvalidInput("positive", f"the {source} is {tokens} text tokens, which do not split over {degree} "
                                           f"ranks; {fix}")
    if conditioning is None:
        return
    config = dict(handle.config)
    embeds = conditioning.tensors["prompt_embeds"]
    if "joint_attention_dim" in config and embeds.shape[-1] != config["joint_attention_dim"]:
        raise InvalidInput("positive", f"was encoded with {conditioning.model} ({embeds.shape[-1]}-wide text embeddings) "
                                       f"but {handle.model}'s transformer expects {config['joint_attention_dim']}; "
                                       "encode with the same model as the transformer")


def sample(handle: TransformerHandle, conditioning: Conditioning, *, seed: int, steps: int, guidance_scale: float,
           width: int, height: int, batch_size: int = 1, true_cfg_scale: float = 4.0,
           on_progress: ProgressFn | None = None, should_cancel: Callable[[], bool] | None = None) -> torch.Tensor:
    """Denoise on the backend; ComfyUI LATENT samples in the family's layout (FLUX.1 ``[B, 16, H/8, W/8]``, FLUX.2
    ``[B, 128, H/16, W/16]``, Qwen-Image ``[B, 16, 1, H/8, W/8]``). ``true_cfg_scale`` reaches only families with
    true CFG (Qwen-Image; 1 turns it off); ``guidance_scale`` is the distilled guidance of FLUX.1 / FLUX.2.
    ``batch_size`` images are made of each of the conditioning's prompts, prompt by prompt; image i of the whole
    batch uses ``seed + i``, as diffusers' pipelines do with a list of generators."""
    validate_sample(handle, conditioning, steps=steps, width=width, height=height, batch_size=batch_size,
                    true_cfg_scale=true_cfg_scale)
    args = {"model": handle.model, "model_dir": handle.model_dir, "dtype": handle.dtype,
            "strategy": dict(handle.strategy), "max_memory": dict(handle.max_memory) if handle.max_memory else None,
            "seed": seed, "steps": steps,
            "guidance_scale": guidance_scale, "width": width, "height": height,
            "batch_size": batch_size * len(conditioning.prompts),  # the backend counts images, prompt by prompt
            "memory_policy": handle.backend.memory_policy}
    if FAMILIES[handle.family].true_cfg:
        args["true_cfg_scale"] = true_cfg_scale
    result = get_backend(handle.backend).call("denoise", args, conditioning.tensors, on_progress=on_progress,
                                              should_cancel=should_cancel)
    return result.tensors["samples"]


def decode_device_choices() -> list[str]:
    return ["auto", "cpu"] + [f"cuda:{i}" for i in range(cuda_device_count())]


def decode(spec: BackendSpec, *, model: str, samples: torch.Tensor, device: str = "auto", dtype: str = "auto",
           on_progress: ProgressFn | None = None, should_cancel: Callable[[], bool] | None = None) -> torch.Tensor:
    """Decode LATENT samples with the model's VAE on one device; IMAGE ``[B, H, W, 3]`` float32 in 0..1."""
    model_dir = model_folders.resolve(model)
    if device not in decode_device_choices():
        raise InvalidInput("device", f"{device!r} is not available here; choose one of {', '.join(decode_device_choices())}")
    if device == "auto":
        device = "cuda:0" if spec.device == "cuda" else "cpu"
    rules = FAMILIES[family_of(model_dir)]
    vae = model_folders.read_config(model_dir, "vae")
    channels = vae.get(rules.vae_channels_key)
    channels = channels and channels * rules.latent_channels_per_vae_channel
    frames = samples.shape[2] if samples.ndim == 5 else 1  # video-VAE latents: [B, C, T, h, w]
    if samples.ndim not in rules.latent_ndims or (channels and samples.shape[1] != channels) or frames != 1:
        expected = " or ".join(f"{n}-D" for n in rules.latent_ndims)
        raise InvalidInput("samples", f"LATENT of shape {list(samples.shape)} does not fit {model}'s VAE "
                                      f"({rules.name}: {expected}, {channels} channels, one frame); decode it with the "
                                      "VAE of the model that made it")
    args = {"model": model, "model_dir": model_dir, "device": device, "dtype": resolve_dtype(dtype, spec),
            "memory_policy": spec.memory_policy}
    result = get_backend(spec).call("decode", args, {"samples": samples.float()}, on_progress=on_progress,
                                    should_cancel=should_cancel)
    return result.tensors["images"]
