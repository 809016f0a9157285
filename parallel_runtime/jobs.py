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
STRATEGIES = ("device_map", "context_parallel", "tensor_parallel", "data_parallel")
ATTENTION_BACKENDS = ("auto", "native", "_native_flash", "_native_cudnn", "flash", "sage")
# FLUX.1's T5 is trained on at most 512 tokens; the pipeline refuses more.
MAX_SEQUENCE_LENGTH = 512
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|KIB|MB|MIB|GB|GIB|TB|TIB)\s*$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Conditioning:
    """Encoded prompts of one model: ``prompt_embeds`` and ``pooled_prompt_embeds`` on the CPU."""

    model: str
    prompts: tuple[str, ...]
    tensors: dict[str, torch.Tensor] = dataclasses.field(compare=False)


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


def encode_prompt(spec: BackendSpec, *, model: str, prompt: str, prompt_2: str = "", max_sequence_length: int = 512,
                  max_memory: str = "", dtype: str = "auto", on_progress: ProgressFn | None = None,
                  should_cancel: Callable[[], bool] | None = None) -> Conditioning:
    """Encode ``prompt`` with the model's text encoders placed ``device_map="balanced"`` across the GPUs."""
    model_dir = model_folders.resolve(model)
    if not prompt.strip():
        raise InvalidInput("prompt", "the prompt is empty; describe the image to generate")
    if not 1 <= max_sequence_length <= MAX_SEQUENCE_LENGTH:
        raise InvalidInput("max_sequence_length", f"{max_sequence_length} is out of range; use 1..{MAX_SEQUENCE_LENGTH}")
    args = {"model": model, "model_dir": model_dir, "prompts": [prompt],
            "prompts_2": [prompt_2] if prompt_2.strip() else None, "max_sequence_length": max_sequence_length,
            "max_memory": parse_max_memory(max_memory), "dtype": resolve_dtype(dtype, spec), "memory_policy": spec.memory_policy}
    result = get_backend(spec).call("encode", args, on_progress=on_progress, should_cancel=should_cancel)
    return Conditioning(model=model, prompts=(prompt,), tensors=result.tensors)


def _parallel_plans(model_dir: str) -> tuple[str, bool, bool]:
    """(transformer class name, has a context-parallel plan, has a tensor-parallel plan)."""
    import diffusers

    name = model_folders.read_config(model_dir, "transformer")["_class_name"]
    cls = getattr(diffusers, name, None)
    return name, getattr(cls, "_cp_plan", None) is not None, getattr(cls, "_tp_plan", None) is not None


def _models_with_plan(attribute: str) -> str:
    import diffusers

    names = [n for n in dir(diffusers) if n.endswith("Transformer2DModel") and getattr(getattr(diffusers, n), attribute, None)]
    return ", ".join(sorted(names))


def load_transformer(spec: BackendSpec, *, model: str, strategy: str = "device_map", max_memory: str = "",
                     dtype: str = "auto", ring_degree: int = 1, ulysses_degree: int = 0, anything: bool = False,
                     attention_backend: str = "auto", tp_degree: int = 0) -> TransformerHandle:
    """Validate a transformer spec against the model's config and the backend's world size. Loads nothing.

    ``ulysses_degree`` 0 means every rank the ring does not use; ``tp_degree`` 0 means every rank.
    """
    model_dir = model_folders.resolve(model)
    if strategy not in STRATEGIES:
        raise InvalidInput("strategy", f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    budget = parse_max_memory(max_memory)
    config = model_folders.read_config(model_dir, "transformer")
    heads = config.get("num_attention_heads")
    world = spec.world_size
    plan: dict = {"kind": strategy}
    if strategy == "context_parallel":
        name, has_cp, _ = _parallel_plans(model_dir)
        if not has_cp:
            raise InvalidInput("strategy", f"{name} has no context-parallel plan (_cp_plan) in this diffusers; use "
                                           f"tensor_parallel or data_parallel, or a model that has one: "
                                           f"{_models_with_plan('_cp_plan')}")
        if ring_degree < 1:
            raise InvalidInput("ring_degree", f"{ring_degree} is not a degree; use 1 (no ring) or more")
        if ulysses_degree == 0:
            ulysses_degree = max(1, world // ring_degree)
        if ring_degree * ulysses_degree != world:
            raise InvalidInput("ulysses_degree", f"ring_degree × ulysses_degree = {ring_degree} × {ulysses_degree} "
                                                 f"= {ring_degree * ulysses_degree}, but the backend has {world} ranks; "
                                                 f"make the product {world} (ulysses_degree 0 fills the rest)")
        if ring_degree * ulysses_degree == 1:
            raise InvalidInput("ulysses_degree", "context parallelism needs 2 or more ranks; raise ranks on the "
                                                 "ParallelBackend node, or use device_map")
        if anything and ring_degree > 1 and ulysses_degree > 1:
            raise InvalidInput("anything", "Ulysses-anything and Ring-anything each work on one axis; set ring_degree "
                                           "or ulysses_degree to 1, or turn anything off")
        if heads and ulysses_degree > 1:
            if anything and heads < ulysses_degree:
                raise InvalidInput("ulysses_degree", f"Ulysses-anything needs at least as many attention heads as "
                                                     f"ranks: {heads} heads < ulysses_degree {ulysses_degree}")
            if not anything and heads % ulysses_degree:
                raise InvalidInput("ulysses_degree", f"{heads} attention heads do not split over ulysses_degree "
                                                     f"{ulysses_degree}; use a divisor of {heads} or turn anything on")
        if attention_backend not in ATTENTION_BACKENDS:
            raise InvalidInput("attention_backend", f"unknown backend {attention_backend!r}; choose one of "
                                                    f"{', '.join(ATTENTION_BACKENDS)}")
        plan.update(ring_degree=ring_degree, ulysses_degree=ulysses_degree, anything=bool(anything),
                    attention_backend=attention_backend)
    elif strategy == "tensor_parallel":
        name, _, has_tp = _parallel_plans(model_dir)
        if not has_tp:
            raise InvalidInput("strategy", f"{name} has no tensor-parallel plan (_tp_plan) in this diffusers; use "
                                           f"context_parallel or data_parallel. Models with one: "
                                           f"{_models_with_plan('_tp_plan')}")
        tp_degree = tp_degree or world
        if tp_degree != world:
            raise InvalidInput("tp_degree", f"tp_degree {tp_degree} must equal the backend's {world} ranks "
                                            "(0 uses them all)")
        if heads and heads % tp_degree:
            raise InvalidInput("tp_degree", f"{heads} attention heads do not split over tp_degree {tp_degree}; "
                                            f"use a divisor of {heads} (and as many ranks)")
        plan.update(tp_degree=tp_degree)
    return TransformerHandle(backend=spec, model=model, model_dir=model_dir, strategy=tuple(sorted(plan.items())),
                             max_memory=tuple(sorted(budget.items())) if budget else None,
                             dtype=resolve_dtype(dtype, spec), config=tuple(sorted(config.items(), key=lambda kv: kv[0])))


def _check_size(widget: str, value: int) -> None:
    if value < 16 or value % 16:
        lower, upper = max(16, value // 16 * 16), (value // 16 + 1) * 16
        raise InvalidInput(widget, f"{value} is not a multiple of 16 (the VAE downscales 8× and the transformer packs "
                                   f"2×2 patches); use {lower} or {upper}")


def validate_sample(handle: TransformerHandle, conditioning: Conditioning | None, *, steps: int, width: int,
                    height: int, batch_size: int) -> None:
    """Every check ParallelSampler can make before it runs."""
    if steps < 1:
        raise InvalidInput("steps", f"{steps} steps would not denoise anything; use at least 1")
    _check_size("width", width)
    _check_size("height", height)
    if batch_size < 1:
        raise InvalidInput("batch_size", f"{batch_size} makes no images; use at least 1")
    strategy = dict(handle.strategy)
    world = handle.backend.world_size
    if strategy["kind"] == "data_parallel" and batch_size < world:
        raise InvalidInput("batch_size", f"data_parallel gives each of the {world} ranks whole images, so it needs "
                                         f"batch_size ≥ {world}; raise batch_size, or use context_parallel or "
                                         "tensor_parallel to speed up a single image")
    if strategy["kind"] == "context_parallel" and not strategy["anything"]:
        degree = strategy["ring_degree"] * strategy["ulysses_degree"]
        # The transformer splits image tokens (one per 16×16 pixels) and text tokens separately across the ranks.
        image_tokens = (width // 16) * (height // 16)
        if image_tokens % degree:
            raise InvalidInput("width", f"{width}×{height} makes {image_tokens} image tokens, which do not split over "
                                        f"{degree} ranks; turn on anything (Ulysses/Ring-anything) on "
                                        "LoadShardedTransformer, or pick a size whose token count divides")
        if conditioning is not None and conditioning.tensors["prompt_embeds"].shape[1] % degree:
            raise InvalidInput("positive", f"{conditioning.tensors['prompt_embeds'].shape[1]} text tokens do not "
                                           f"split over {degree} ranks; set max_sequence_length to a multiple of "
                                           f"{degree}, or turn on anything")
    if conditioning is None:
        return
    config = dict(handle.config)
    embeds = conditioning.tensors["prompt_embeds"]
    if "joint_attention_dim" in config and embeds.shape[-1] != config["joint_attention_dim"]:
        raise InvalidInput("positive", f"was encoded with {conditioning.model} ({embeds.shape[-1]}-wide text embeddings) "
                                       f"but {handle.model}'s transformer expects {config['joint_attention_dim']}; "
                                       "encode with the same model as the transformer")


def sample(handle: TransformerHandle, conditioning: Conditioning, *, seed: int, steps: int, guidance_scale: float,
           width: int, height: int, batch_size: int = 1, on_progress: ProgressFn | None = None,
           should_cancel: Callable[[], bool] | None = None) -> torch.Tensor:
    """Denoise on the backend; ComfyUI LATENT samples ``[batch_size, C, height/8, width/8]``."""
    validate_sample(handle, conditioning, steps=steps, width=width, height=height, batch_size=batch_size)
    args = {"model": handle.model, "model_dir": handle.model_dir, "dtype": handle.dtype,
            "strategy": dict(handle.strategy), "max_memory": dict(handle.max_memory) if handle.max_memory else None,
            "seed": seed, "steps": steps,
            "guidance_scale": guidance_scale, "width": width, "height": height, "batch_size": batch_size,
            "memory_policy": handle.backend.memory_policy}
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
    vae = model_folders.read_config(model_dir, "vae")
    channels = vae.get("latent_channels")
    if samples.ndim != 4 or (channels and samples.shape[1] != channels):
        raise InvalidInput("samples", f"LATENT of shape {list(samples.shape)} does not fit {model}'s VAE "
                                      f"({channels} channels); decode it with the VAE of the model that made it")
    args = {"model": model, "model_dir": model_dir, "device": device, "dtype": resolve_dtype(dtype, spec),
            "memory_policy": spec.memory_policy}
    result = get_backend(spec).call("decode", args, {"samples": samples.float()}, on_progress=on_progress,
                                    should_cancel=should_cancel)
    return result.tensors["images"]
