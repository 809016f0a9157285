"""LoRAs on Wan: its layouts (diffusers / PEFT, musubi-tuner's kohya ``lora_unet_…``, ComfyUI's ``diffusion_model.…``
and the step-distillation LoRAs' zero ``diff`` / ``diff_b`` keys) read as their diffusers twins, non-zero ``diff`` keys
refused by name, ParallelLoraLoader's ``expert`` refused on one transformer; and on real CPU ranks, stacked LoRAs
through the nodes' steps equal diffusers' ``WanPipeline`` with the same adapters (fp32, ≤ 1e-4): Ulysses on Wan 2.1 in
the default run; Wan 2.2 A14B's two experts (a LoRA on both, another on the low-noise expert only, loaded there with
``load_into_transformer_2``) and tensor parallelism (the pack's Wan plan: the deltas sliced as the weights) slow.

The LoRA files are written by ``families/wan/tiny.py``'s ``save_wan_lora`` from the original model's names, never
with diffusers' converters, and each is compared with the same deltas saved by ``WanPipeline.save_lora_weights``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import WAN_CLIP, wan_clip_prompt, wan_clip_sample
from safetensors.torch import load_file, save_file

from parallel_runtime import InvalidInput, default_spec, jobs
from parallel_runtime.families import family
from parallel_runtime.families.lora import LoraError, read_lora
from parallel_runtime.families.tiny import make_tiny_lora, save_diffusers_lora
from parallel_runtime.families.wan.tiny import BLOCK_LORA_LAYERS, make_tiny_model, save_wan_lora

WAN21, WAN22 = "tiny-wan21-lora", "tiny-wan22-lora"
TOLERANCE = 1e-4
CFG_2 = 3.0
# name -> (model, layers, layout, zero diffs); the file's twin in diffusers' layout is twins/<name>
LORAS = {
    "wan_comfyui.safetensors": (WAN21, None, "comfyui", False),
    "wan_kohya.safetensors": (WAN21, BLOCK_LORA_LAYERS, "kohya", False),
    "wan_lightx2v.safetensors": (WAN21, None, "comfyui", True),
    "wan22_both.safetensors": (WAN22, None, "comfyui", False),
    "wan22_low.safetensors": (WAN22, BLOCK_LORA_LAYERS, "kohya", False),
}
# Two layouts and a step-distillation LoRA's bias changes (diff_b) beside its pairs.
STACK = (("wan_comfyui.safetensors", 0.8), ("wan_kohya.safetensors", -0.5), ("wan_lightx2v.safetensors", 0.6))


@pytest.fixture(scope="module")
def models_dir(models_root):
    make_tiny_model(str(models_root / WAN21), 0)
    make_tiny_model(str(models_root / WAN22), 0, two_experts=True)
    return models_root


@pytest.fixture(scope="module")
def loras(models_dir, loras_dir) -> dict:
    """name -> the TinyLora its file holds; each file's twin in diffusers' layout in twins/."""
    (loras_dir / "twins").mkdir()
    made = {}
    for seed, (name, (model, layers, layout, zero_diffs)) in enumerate(LORAS.items()):
        lora = make_tiny_lora(models_dir / model, "wan", layers=layers, ranks={"proj_out": 2}, seed=seed + 1)
        if zero_diffs:  # lightx2v's: a bias change beside every pair (but one, whose diff_b is zero)
            generator = torch.Generator().manual_seed(seed)
            biases = {m: 0.3 * torch.randn(b.shape[0], generator=generator) for m, (_, b, _) in lora.layers.items()}
            lora = dataclasses.replace(lora, biases={m: bias for m, bias in biases.items() if m != "proj_out"})
        save_wan_lora(lora, loras_dir / name, layout=layout, zero_diffs=zero_diffs)
        save_diffusers_lora(lora, loras_dir / "twins" / name, "wan")
        made[name] = lora
    return made


def _config(models_dir, model: str) -> dict:
    return json.loads((models_dir / model / "transformer" / "config.json").read_text())


# -- the layouts, in process -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["wan_comfyui.safetensors", "wan_kohya.safetensors", "wan_lightx2v.safetensors"])
def test_each_layout_reads_as_its_diffusers_twin(models_dir, loras, loras_dir, name):
    config = _config(models_dir, WAN21)
    lora = loras[name]
    for path in (loras_dir / name, loras_dir / "twins" / name):
        weights = read_lora(family("wan"), str(path), config)
        assert set(weights.modules) == set(lora.layers), path
        for module in weights.modules:
            a, b = weights.factors(module)
            delta = weights.scales[module] * (b.double() @ a.double())
            assert (delta.float() - lora.delta(module)).abs().max() <= 1e-6, (path, module)
            bias = weights.bias(module)
            if module in lora.biases:
                assert (weights.scales[module] * bias - lora.biases[module]).abs().max() <= 1e-6, (path, module)
            else:
                assert bias is None or not bias.count_nonzero(), (path, module)


def test_a_step_distillation_lora_with_changes_diffusers_drops_is_refused_by_name(models_dir, loras, loras_dir):
    """A ``diff`` (a weight change) or ``diff_b`` (a bias change) diffusers leaves out (a norm's, the patch
    embedding's), which ComfyUI would add: where it is not zero, the LoRA is refused, the key named."""
    config = _config(models_dir, WAN21)
    tensors = load_file(loras_dir / "wan_lightx2v.safetensors")
    for key, width in (("diffusion_model.blocks.0.norm3.diff", None), ("diffusion_model.patch_embedding.diff_b", 32)):
        changed = dict(tensors)
        changed[key] = torch.full_like(tensors[key], 0.01) if width is None else torch.full((width,), 0.01)
        path = loras_dir / "lightx2v_changed.safetensors"
        save_file(changed, path)
        with pytest.raises(LoraError, match=rf"1 weight or bias changes that diffusers leaves out \({key}: diff"):
            read_lora(family("wan"), str(path), config)


def backend(ranks: int = 2):
    return default_spec(ranks=ranks, device="cpu", memory_policy="resident")


@pytest.mark.parametrize(
    "model, expert, hint",
    [
        (WAN21, "low_noise", "picks one of two experts .* has one transformer; set both"),
        (WAN22, "medium_noise", "unknown expert 'medium_noise'; choose one of both, high_noise, low_noise"),
    ],
    ids=["one_transformer", "unknown"],
)
def test_the_expert_widget_is_refused_before_anything_runs(models_dir, loras, model, expert, hint):
    transformer = jobs.plan_transformer(backend(), model=model, strategy="data_parallel")
    with pytest.raises(InvalidInput, match=hint) as info:
        jobs.add_lora(transformer, lora_name="wan_comfyui.safetensors", expert=expert)
    assert info.value.widget == "expert"


# -- on real ranks -----------------------------------------------------------------------------------------------------
def generate(model: str, strategy: str, stack, ranks: int = 2, **strategy_args) -> torch.Tensor:
    """The clip's frames through the nodes' steps, ``stack`` = ((file, strength[, expert]), ...)."""
    spec = backend(ranks)
    positive = wan_clip_prompt(spec, model)
    transformer = jobs.plan_transformer(spec, model=model, strategy=strategy, **strategy_args)
    for name, strength, *expert in stack:
        transformer, _ = jobs.add_lora(transformer, lora_name=name, strength=strength, expert=(expert or ["both"])[0])
    latent = wan_clip_sample(transformer, positive, CFG_2 if model == WAN22 else 0.0)
    return jobs.decode(spec, model=model, samples=latent)


@pytest.fixture(scope="module")
def one_shot(models_dir, loras, loras_dir):
    """diffusers' WanPipeline with each LoRA of a stack loaded (as its diffusers twin) into the experts it changes
    (``load_into_transformer_2`` for the second) and ``set_adapters`` with the strengths, per transformer."""
    from diffusers import WanPipeline

    pipes = {}

    def reference(model: str, stack) -> torch.Tensor:
        if model not in pipes:
            pipes[model] = WanPipeline.from_pretrained(models_dir / model, dtype=torch.float32)
            pipes[model].set_progress_bar_config(disable=True)
        pipe = pipes[model]
        transformers = [pipe.transformer] + ([pipe.transformer_2] if pipe.transformer_2 is not None else [])
        adapters = [([], []) for _ in transformers]
        for i, (name, strength, *expert) in enumerate(stack):
            for index, (names, strengths) in enumerate(adapters):
                if (expert or ["both"])[0] not in ("both", ("high_noise", "low_noise")[index]):
                    continue
                pipe.load_lora_weights(
                    str(loras_dir / "twins" / name), adapter_name=f"lora{i}", load_into_transformer_2=index == 1
                )
                names.append(f"lora{i}")
                strengths.append(strength)
        for transformer, (names, strengths) in zip(transformers, adapters):
            if names:
                transformer.set_adapters(names, strengths)
        second = {"guidance_scale_2": CFG_2} if model == WAN22 else {}
        frames = pipe(**WAN_CLIP, **second, generator=torch.Generator("cpu").manual_seed(3), output_type="pt").frames
        for transformer, (names, _) in zip(transformers, adapters):
            if names:
                transformer.unload_lora()
        return frames.permute(0, 1, 3, 4, 2).flatten(0, 1)

    return reference


def check(one_shot, model: str, strategy: str, stack, ranks: int = 2, **args) -> None:
    frames = generate(model, strategy, stack, ranks=ranks, **args)
    expected, without = one_shot(model, stack), one_shot(model, ())
    diff = (frames - expected).abs().max().item()
    moved = (expected - without).abs().max().item()
    print(f"{model} {strategy} {args}: max |diff| vs WanPipeline with the LoRAs {diff:.3g}; they moved it {moved:.3g}")
    assert diff <= TOLERANCE
    assert moved > 100 * TOLERANCE  # the LoRAs do something the test would see


@pytest.mark.multirank
def test_stacked_loras_under_ulysses_equal_wan_pipeline(loras, one_shot):
    check(one_shot, WAN21, "context_parallel", STACK, ulysses_degree=2)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("strategy, args", [("context_parallel", {"ulysses_degree": 2}), ("device_map", {})])
def test_loras_per_expert_equal_wan_pipeline(loras, one_shot, strategy, args):
    """One LoRA on both experts, another on the low-noise expert only; then that one on the high-noise expert:
    the LoRAs move between the experts without a reload."""
    stack = (("wan22_both.safetensors", 0.7), ("wan22_low.safetensors", 1.0, "low_noise"))
    check(one_shot, WAN22, strategy, stack, **args)
    check(one_shot, WAN22, strategy, (stack[0], ("wan22_low.safetensors", 1.0, "high_noise")), **args)


@pytest.mark.multirank
@pytest.mark.slow
def test_stacked_loras_under_tensor_parallel_equal_wan_pipeline(loras, one_shot):
    """The pack's Wan plan: each rank merges its slice of every delta (colwise rows, rowwise columns) and of every
    bias change (colwise: its outputs; rowwise: whole, added once)."""
    check(one_shot, WAN21, "tensor_parallel", STACK)
