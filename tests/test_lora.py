"""LoRAs through the nodes' steps (``jobs``) on real CPU ranks, against diffusers' own pipeline with
``load_lora_weights`` (and ``set_adapters`` for stacked LoRAs); every file layout against its diffusers twin; the
strength round trip and residency; every bad input.

The LoRAs are tiny, random and built in code (``families/tiny.py``, each family's ``tiny.py``): in diffusers' layout for
each family, and for FLUX.1 also in kohya's, ComfyUI's and xlabs' layouts, written from BFL's own layer names, never
with diffusers' converters, and each compared with the same deltas in diffusers' layout.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel_runtime import InvalidInput, OpFailed, default_spec, get_backend, jobs
from parallel_runtime.families import family
from parallel_runtime.families.base import pil_images
from parallel_runtime.families.flux.tiny import save_xlabs_flux_lora
from parallel_runtime.families.lora import LoraError, read_lora
from parallel_runtime.families.qwenimage.tiny import save_qwenimage_lora
from parallel_runtime.families.tiny import make_tiny_lora, make_tiny_model, save_bfl_lora, save_diffusers_lora
from parallel_runtime.wire import LoraMode

PROMPT = "a photo of a horse in the city"
STEPS = 2
# FLUX.1 Kontext's reference image: a random IMAGE as LoadImage makes it (8-bit pixels / 255), square, so that the
# pipeline runs it at 1024² (4096 tokens beside the output's 16).
KONTEXT_IMAGE = torch.randint(0, 256, (1, 64, 64, 3), generator=torch.Generator().manual_seed(12)).float() / 255
# Qwen-Image-Edit's picture, read by its text encoder (on EncodeOnBalancedGPUs) and its transformer (about 1024²).
EDIT_IMAGE = torch.randint(0, 256, (1, 40, 56, 3), generator=torch.Generator().manual_seed(13)).float() / 255
FAMILIES = {
    "flux": {
        "model": "tiny-flux",
        "encode": {"max_sequence_length": 32},
        "sample": {"guidance_scale": 3.5},
        "reference": {"max_sequence_length": 32, "guidance_scale": 3.5},
    },
    "flux2": {
        "model": "tiny-flux2",
        "encode": {"max_sequence_length": 48},
        "sample": {"guidance_scale": 4.0},
        "reference": {"max_sequence_length": 48, "guidance_scale": 4.0},
    },
    # Kontext's tiny transformer is FLUX.1's, weights included: FLUX.1's LoRAs fit it.
    "flux_kontext": {
        "model": "tiny-flux-kontext",
        "encode": {"max_sequence_length": 32},
        "sample": {"guidance_scale": 3.5, "image": KONTEXT_IMAGE},
        "reference": {
            "max_sequence_length": 32,
            "guidance_scale": 3.5,
            "image": pil_images(KONTEXT_IMAGE)[0],
            "max_area": 64 * 64,
        },
    },
    "flux2_klein": {
        "model": "tiny-flux2-klein",
        "encode": {"max_sequence_length": 48},
        "sample": {"guidance_scale": 4.0, "true_cfg_scale": 1.0},  # distilled: no CFG
        "reference": {"max_sequence_length": 48},
    },
    "qwenimage": {
        "model": "tiny-qwenimage",
        "encode": {"max_sequence_length": 8, "negative_prompt": "a blue painting"},
        "sample": {"guidance_scale": 3.5, "true_cfg_scale": 4.0},
        "reference": {"max_sequence_length": 8, "negative_prompt": "a blue painting", "true_cfg_scale": 4.0},
    },
    # Qwen-Image-Edit's tiny transformer has Qwen-Image's classes and shapes: Qwen-Image's LoRAs fit it.
    "qwenimage_edit": {
        "model": "tiny-qwen-image-edit",
        "encode": {"negative_prompt": "a blue painting", "image": EDIT_IMAGE},
        "sample": {"guidance_scale": 1.0, "true_cfg_scale": 4.0},
        "reference": {
            "negative_prompt": "a blue painting",
            "true_cfg_scale": 4.0,
            "image": pil_images(EDIT_IMAGE)[0],
        },
    },
}
# Layers of a FLUX.1 LoRA in BFL's layout: every diffusers layer a BFL layer fuses (q/k/v), AdaLN modulations, the
# embedders and the final layer (which diffusers 0.42.1 converts without its prefix and alpha; families/flux.py).
# Not the single blocks' linear1: diffusers' kohya converter splits it at FLUX.1-dev's widths only.
FLUX_BFL_LAYERS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_k",
    "transformer_blocks.0.attn.to_v",
    "transformer_blocks.0.attn.to_out.0",
    "transformer_blocks.1.attn.add_q_proj",
    "transformer_blocks.1.attn.add_k_proj",
    "transformer_blocks.1.attn.add_v_proj",
    "transformer_blocks.1.attn.to_add_out",
    "transformer_blocks.0.ff.net.0.proj",
    "transformer_blocks.1.ff_context.net.2",
    "transformer_blocks.0.norm1.linear",
    "transformer_blocks.1.norm1_context.linear",
    "single_transformer_blocks.0.proj_out",
    "single_transformer_blocks.1.norm.linear",
    "x_embedder",
    "time_text_embed.guidance_embedder.linear_1",
    "proj_out",
    "norm_out.linear",
)
FLUX_XLABS_LAYERS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_k",
    "transformer_blocks.0.attn.to_v",
    "transformer_blocks.0.attn.to_out.0",
    "transformer_blocks.1.attn.add_q_proj",
    "transformer_blocks.1.attn.add_k_proj",
    "transformer_blocks.1.attn.add_v_proj",
    "transformer_blocks.1.attn.to_add_out",
    "single_transformer_blocks.0.attn.to_q",
    "single_transformer_blocks.0.attn.to_k",
    "single_transformer_blocks.0.attn.to_v",
    "single_transformer_blocks.1.proj_out",
)
FLUX2_BFL_LAYERS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_k",
    "transformer_blocks.0.attn.to_v",
    "transformer_blocks.0.attn.to_out.0",
    "transformer_blocks.0.ff.linear_in",
    "transformer_blocks.0.ff_context.linear_out",
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
    "single_transformer_blocks.1.attn.to_out",
    "x_embedder",
    "proj_out",
    "norm_out.linear",
)


@pytest.fixture(scope="module")
def models_dir(models_root):
    for key, settings in FAMILIES.items():
        make_tiny_model(key, str(models_root / settings["model"]))
    return models_root


@pytest.fixture(scope="module")
def loras(models_dir, loras_dir) -> dict:
    """Every LoRA file of the module: name -> the TinyLora it holds (a converted layout: the same deltas as its
    ``twin_<name>`` file in diffusers' layout)."""
    flux, flux2 = models_dir / "tiny-flux", models_dir / "tiny-flux2"
    made = {}

    def diffusers_file(name: str, lora, key: str) -> None:
        save_diffusers_lora(lora, loras_dir / name, key)
        made[name] = lora

    # Ranks and alphas differ between layers (rank / alpha patterns), and no alpha equals its rank.
    diffusers_file(
        "flux_a.safetensors",
        make_tiny_lora(flux, "flux", ranks={"transformer_blocks.0.attn.to_out.0": 2, "proj_out": 3}, seed=1),
        "flux",
    )
    diffusers_file(
        "flux_b.safetensors",
        make_tiny_lora(flux, "flux", layers=FLUX_XLABS_LAYERS, rank=3, alpha=None, seed=2),
        "flux",
    )
    diffusers_file("flux2_a.safetensors", make_tiny_lora(flux2, "flux2", ranks={"proj_out": 2}, seed=3), "flux2")
    klein = make_tiny_lora(models_dir / "tiny-flux2-klein", "flux2_klein", ranks={"proj_out": 2}, seed=9)
    diffusers_file("flux2_klein_a.safetensors", klein, "flux2_klein")
    diffusers_file(
        "qwenimage_a.safetensors",
        make_tiny_lora(models_dir / "tiny-qwenimage", "qwenimage", ranks={"img_in": 2}, seed=4),
        "qwenimage",
    )
    # A second Qwen-Image LoRA, to stack on the first: other ranks, no alpha, in ComfyUI's layout.
    qwen_b = make_tiny_lora(models_dir / "tiny-qwenimage", "qwenimage", rank=3, alpha=None, seed=10)
    made["qwenimage_b.safetensors"] = qwen_b
    save_qwenimage_lora(qwen_b, loras_dir / "qwenimage_b.safetensors", layout="comfyui")
    bfl = make_tiny_lora(flux, "flux", layers=FLUX_BFL_LAYERS, ranks={"transformer_blocks.0.attn.to_out.0": 2}, seed=5)
    for layout in ("kohya", "comfyui"):
        made[f"flux_{layout}.safetensors"] = bfl
        save_bfl_lora(bfl, loras_dir / f"flux_{layout}.safetensors", flux, "flux", layout=layout)
    shared = [FLUX_XLABS_LAYERS[0:3], FLUX_XLABS_LAYERS[4:7], FLUX_XLABS_LAYERS[8:11]]
    xlabs = make_tiny_lora(flux, "flux", layers=FLUX_XLABS_LAYERS, alpha=None, seed=6, share_a=shared)
    made["flux_xlabs.safetensors"] = xlabs
    save_xlabs_flux_lora(xlabs, loras_dir / "flux_xlabs.safetensors")
    flux2_bfl = make_tiny_lora(flux2, "flux2", layers=FLUX2_BFL_LAYERS, seed=7, share_a=[FLUX2_BFL_LAYERS[0:3]])
    made["flux2_ai-toolkit.safetensors"] = flux2_bfl
    save_bfl_lora(flux2_bfl, loras_dir / "flux2_ai-toolkit.safetensors", flux2, "flux2", layout="ai-toolkit")
    qwen = made["qwenimage_a.safetensors"]
    for layout in ("kohya", "comfyui"):
        made[f"qwenimage_{layout}.safetensors"] = qwen
        save_qwenimage_lora(qwen, loras_dir / f"qwenimage_{layout}.safetensors", layout=layout)
    for name, lora in list(made.items()):
        key = name.split("_")[0]
        twin = loras_dir / "twins" / name
        twin.parent.mkdir(exist_ok=True)
        save_diffusers_lora(lora, twin, key)
    return made


def backend(ranks: int = 2):
    # resident: the text encoders never evict the transformer, so load counts show only what LoRAs do
    return default_spec(ranks=ranks, device="cpu", memory_policy="resident")


@pytest.fixture(scope="module")
def conditioning(models_dir):
    made = {}

    def encoded(spec, key: str) -> jobs.Conditioning:
        if (spec, key) not in made:
            settings = FAMILIES[key]
            made[spec, key] = jobs.encode_prompt(spec, model=settings["model"], prompt=PROMPT, **settings["encode"])
        return made[spec, key]

    return encoded


def handle(spec, key: str, strategy: str, stack=(), mode: LoraMode = LoraMode.AUTO, **strategy_args):
    made = jobs.plan_transformer(spec, model=FAMILIES[key]["model"], strategy=strategy, **strategy_args)
    for name, strength in stack:
        made, _ = jobs.add_lora(made, lora_name=name, strength=strength)
    return dataclasses.replace(made, spec=dataclasses.replace(made.spec, lora_mode=mode))


def generate(spec, conditioning, key, strategy, stack=(), *, mode=LoraMode.AUTO, size=(64, 64), batch_size=1, **args):
    transformer = handle(spec, key, strategy, stack, mode, **args)
    width, height = size
    latent = jobs.sample(
        transformer,
        conditioning(spec, key),
        seed=3,
        steps=STEPS,
        width=width,
        height=height,
        batch_size=batch_size,
        **FAMILIES[key]["sample"],
    )
    return jobs.decode(spec, model=FAMILIES[key]["model"], samples=latent)


@pytest.fixture(scope="module")
def one_shot(models_dir, loras, loras_dir):
    """diffusers' pipeline with ``load_lora_weights`` of each (file, strength) of a stack and ``set_adapters`` with
    their strengths; a converted layout is loaded as its diffusers twin."""
    import diffusers

    pipes, cache = {}, {}

    def reference(key: str, stack, *, size=(64, 64), batch_size=1) -> torch.Tensor:
        cache_key = (key, tuple(stack), size, batch_size)
        if cache_key in cache:
            return cache[cache_key]
        if key not in pipes:
            pipeline = getattr(diffusers, family(key).pipeline)
            pipes[key] = pipeline.from_pretrained(models_dir / FAMILIES[key]["model"])
            pipes[key].set_progress_bar_config(disable=True)
        pipe, names = pipes[key], []
        for i, (name, _) in enumerate(stack):
            # a file in diffusers' layout itself; a converted layout as its twin
            diffusers_layout = name.endswith("_a.safetensors") or name == "flux_b.safetensors"
            pipe.load_lora_weights(
                str(loras_dir / ("" if diffusers_layout else "twins") / name), adapter_name=f"lora{i}"
            )
            names.append(f"lora{i}")
        if names:
            pipe.set_adapters(names, [strength for _, strength in stack])
        width, height = size
        cache[cache_key] = pipe(
            prompt=PROMPT,
            num_inference_steps=STEPS,
            width=width,
            height=height,
            num_images_per_prompt=batch_size,
            generator=[torch.Generator("cpu").manual_seed(3 + i) for i in range(batch_size)],
            output_type="pt",
            **FAMILIES[key]["reference"],
        ).images.permute(0, 2, 3, 1)
        if names:
            pipe.unload_lora_weights()
        return cache[cache_key]

    return reference


# -- every layout, in process: the deltas diffusers' reading gives equal the twin's ----------------------------------
@pytest.mark.parametrize(
    "name",
    [
        "flux_kohya.safetensors",
        "flux_comfyui.safetensors",
        "flux_xlabs.safetensors",
        "flux2_ai-toolkit.safetensors",
        "qwenimage_kohya.safetensors",
        "qwenimage_comfyui.safetensors",
        "flux_a.safetensors",
        "flux2_a.safetensors",
        "qwenimage_a.safetensors",
    ],
)
def test_each_layout_reads_as_its_diffusers_twin(models_dir, loras, loras_dir, name):
    key = name.split("_")[0]
    config = json.loads((models_dir / FAMILIES[key]["model"] / "transformer" / "config.json").read_text())
    weights = read_lora(family(key), str(loras_dir / name), config)
    lora = loras[name]
    assert set(weights.modules) == set(lora.layers)
    for module in weights.modules:
        a, b = weights.factors(module)
        delta = weights.scales[module] * (b.double() @ a.double())
        assert (delta.float() - lora.delta(module)).abs().max() <= 1e-6, module


def test_layouts_diffusers_cannot_read_for_flux2_are_named(models_dir, loras_dir):
    """diffusers 0.42.1 reads FLUX.2's kohya files without their AdaLN modulation layers (it logs them as
    unsupported; the node's text shows that), and ComfyUI's lora_down / lora_up layout for FLUX.2 not at all."""
    flux2 = models_dir / "tiny-flux2"
    config = json.loads((flux2 / "transformer" / "config.json").read_text())
    lora = make_tiny_lora(flux2, "flux2", layers=FLUX2_BFL_LAYERS, seed=8)
    kohya = save_bfl_lora(lora, loras_dir / "flux2_kohya.safetensors", flux2, "flux2", layout="kohya")
    weights = read_lora(family("flux2"), kohya, config)
    assert "norm_out.linear" not in weights.modules and "Unsupported keys" in weights.notes[0]
    check = jobs.LoraCheck(len(weights.modules), 0, weights.notes)
    assert "not applied (diffusers: Unsupported keys" in check.describe("flux2_kohya.safetensors", 1.0)
    comfyui = save_bfl_lora(lora, loras_dir / "flux2_comfyui.safetensors", flux2, "flux2", layout="comfyui")
    with pytest.raises(LoraError, match=r"a layout diffusers cannot read for FLUX\.2"):
        read_lora(family("flux2"), comfyui, config)


# -- every strategy, 2 ranks ----------------------------------------------------------------------------------------
STACK = (("flux_a.safetensors", 0.8), ("flux_b.safetensors", -0.5))
ODD = (48, 80)  # 15 image tokens: an uneven split over 2 ranks (anything), and tensor parallel on a non-square size


def case(name, key, strategy, args=None, stack=STACK, size=(64, 64), batch_size=1, tolerance=1e-4, marks=()):
    return pytest.param(key, strategy, args or {}, stack, size, batch_size, tolerance, id=name, marks=marks)


def only(key: str, layout: str = "a", strength: float = 1.0) -> tuple:
    return ((f"{key}_{layout}.safetensors", strength),)


QWEN_STACK = (("qwenimage_a.safetensors", 0.8), ("qwenimage_b.safetensors", -0.6))
ULYSSES, RING = {"ulysses_degree": 2}, {"ring_degree": 2, "ulysses_degree": 1}
SLOW = pytest.mark.slow
DP = {"batch_size": 2, "tolerance": 1e-5}  # not bit-exact: CPU GEMM kernels block differently for another batch size
CASES = [
    case("device_map", "flux", "device_map"),
    case("ulysses", "flux", "context_parallel", ULYSSES),
    case("ring", "flux", "context_parallel", RING),
    case("ulysses_anything", "flux", "context_parallel", {**ULYSSES, "anything": True}, size=ODD),
    case("ring_anything", "flux", "context_parallel", {**RING, "anything": True}, size=ODD),
    case("tp", "flux", "tensor_parallel", size=ODD),
    case("data_parallel", "flux", "data_parallel", **DP),
    case("tp_kohya", "flux", "tensor_parallel", stack=only("flux", "kohya", 0.7)),
    case("flux2_ulysses", "flux2", "context_parallel", ULYSSES, stack=only("flux2")),
    case("flux2_tp", "flux2", "tensor_parallel", stack=only("flux2")),
    case("qwenimage_ulysses", "qwenimage", "context_parallel", ULYSSES, stack=only("qwenimage")),
    case("qwenimage_tp", "qwenimage", "tensor_parallel", stack=only("qwenimage")),
    # The conditional pass on one rank, the unconditional on the other: each rank applies the LoRA to its own model.
    case("qwenimage_cfg_parallel", "qwenimage", "cfg_parallel", stack=only("qwenimage")),
    # Extra coverage, left out of CI: the other families' Ring-anything and data parallel (data parallel is the fused
    # path of device_map and context parallel: whole weights), the other layouts under more strategies.
    case(
        "flux2_ring_anything", "flux2", "context_parallel", {**RING, "anything": True}, only("flux2"), ODD, marks=SLOW
    ),
    case(
        "qwenimage_ring_anything",
        "qwenimage",
        "context_parallel",
        {**RING, "anything": True},
        only("qwenimage"),
        ODD,
        marks=SLOW,
    ),
    # An edit model: the stacked LoRAs on its transformer, the reference image's 4096 tokens in its sequence (slow:
    # that sequence and the 1024² reference's VAE encode, on the ranks and in the one-shot pipeline).
    case("kontext_ulysses", "flux_kontext", "context_parallel", ULYSSES, marks=SLOW),
    # Qwen-Image-Edit: two stacked Qwen-Image LoRAs (diffusers' and ComfyUI's layouts) on its transformer, beside the
    # picture's tokens (slow for the same reasons).
    case("qwenimage_edit_tp", "qwenimage_edit", "tensor_parallel", stack=QWEN_STACK, marks=SLOW),
    case("flux2_data_parallel", "flux2", "data_parallel", stack=only("flux2"), **DP, marks=SLOW),
    case("flux2_klein_ulysses", "flux2_klein", "context_parallel", ULYSSES, stack=only("flux2_klein"), marks=SLOW),
    case("qwenimage_data_parallel", "qwenimage", "data_parallel", stack=only("qwenimage"), **DP, marks=SLOW),
    case("ulysses_xlabs", "flux", "context_parallel", ULYSSES, stack=only("flux", "xlabs"), marks=SLOW),
    case("ring_comfyui", "flux", "context_parallel", RING, stack=only("flux", "comfyui"), marks=SLOW),
    case("flux2_tp_ai-toolkit", "flux2", "tensor_parallel", stack=only("flux2", "ai-toolkit"), marks=SLOW),
    case("qwenimage_tp_kohya", "qwenimage", "tensor_parallel", stack=only("qwenimage", "kohya"), marks=SLOW),
]


@pytest.mark.multirank
@pytest.mark.parametrize("key, strategy, args, stack, size, batch_size, tolerance", CASES)
def test_strategy_with_loras_equals_diffusers(
    models_dir, loras, conditioning, one_shot, key, strategy, args, stack, size, batch_size, tolerance
):
    image = generate(backend(), conditioning, key, strategy, stack, size=size, batch_size=batch_size, **args)
    expected = one_shot(key, stack, size=size, batch_size=batch_size)
    without = one_shot(key, (), size=size, batch_size=batch_size)
    diff = (image - expected).abs().max().item()
    print(
        f"{key} {strategy} {args}: max |diff| vs diffusers with the LoRAs {diff:.3g}; the LoRAs moved the image by ",
        end="",
    )
    print(f"{(expected - without).abs().max().item():.3g}")
    assert diff <= tolerance
    assert (expected - without).abs().max() > 100 * tolerance  # the LoRAs do something the test would see


@pytest.mark.multirank
@pytest.mark.parametrize(
    "strategy, args, batch_size", [("data_parallel", {}, 2), ("device_map", {}, 1)], ids=["data_parallel", "device_map"]
)
def test_peft_adapters_give_the_same_image(models_dir, loras, conditioning, one_shot, strategy, args, batch_size):
    """The unfused mode the benchmark compares with (LoraMode.PEFT); switching modes on the same transformer."""
    spec = backend()
    image = generate(spec, conditioning, "flux", strategy, STACK, mode=LoraMode.PEFT, batch_size=batch_size, **args)
    assert (image - one_shot("flux", STACK, batch_size=batch_size)).abs().max() <= 1e-5
    again = generate(spec, conditioning, "flux", strategy, STACK, mode=LoraMode.FUSED, batch_size=batch_size, **args)
    assert (again - image).abs().max() <= 1e-5


@pytest.mark.multirank
def test_peft_adapters_are_refused_where_they_cannot_work(models_dir, loras, conditioning):
    spec = backend()
    with pytest.raises(OpFailed, match="diffusers refuses PEFT adapters on a tensor-parallel"):
        generate(spec, conditioning, "flux", "tensor_parallel", STACK, mode=LoraMode.PEFT)
    # flux_a changes proj_out, where context parallelism gathers the sequence
    with pytest.raises(OpFailed, match="changes proj_out, which context parallelism hooks"):
        generate(spec, conditioning, "flux", "context_parallel", STACK, mode=LoraMode.PEFT, ulysses_degree=2)


# -- residency and exactness -----------------------------------------------------------------------------------------
def _latent(spec, conditioning, transformer):
    return jobs.sample(
        transformer, conditioning(spec, "flux"), seed=3, steps=STEPS, width=48, height=80, guidance_scale=3.5
    )


@pytest.mark.multirank
def test_strength_round_trip_is_exact_and_loads_nothing(models_dir, loras, conditioning):
    """bfloat16, tensor parallel: adding, re-weighting and removing LoRAs never reloads the transformer, and the same
    LoRAs and strengths give the same latent bit for bit (no drift from repeated fusing); strength 0 and no LoRA are
    the untouched transformer."""
    spec = backend()
    base = handle(spec, "flux", "tensor_parallel", dtype="bfloat16")
    none = _latent(spec, conditioning, base)
    counts = get_backend(spec).status().ranks[0].load_counts

    def with_loras(*stack):
        return _latent(spec, conditioning, handle(spec, "flux", "tensor_parallel", stack, dtype="bfloat16"))

    full = with_loras(("flux_a.safetensors", 1.0))
    half = with_loras(("flux_a.safetensors", 0.5))
    stacked = with_loras(("flux_a.safetensors", 1.0), ("flux_b.safetensors", 0.5))
    assert torch.equal(with_loras(("flux_a.safetensors", 1.0)), full)
    assert torch.equal(with_loras(("flux_a.safetensors", 0.5)), half) and not torch.equal(half, full)
    assert torch.equal(with_loras(("flux_a.safetensors", 1.0), ("flux_b.safetensors", 0.5)), stacked)
    # one LoRA chained twice is that LoRA at the sum of the strengths
    assert torch.equal(with_loras(("flux_a.safetensors", 0.5), ("flux_a.safetensors", 0.5)), full)
    assert torch.equal(with_loras(("flux_a.safetensors", 0.0)), none)
    assert torch.equal(_latent(spec, conditioning, base), none)
    assert get_backend(spec).status().ranks[0].load_counts == counts


# -- bad input -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_loras(models_dir, loras, loras_dir) -> None:
    good = (loras_dir / "flux_a.safetensors").read_bytes()
    (loras_dir / "cut_short.safetensors").write_bytes(good[: len(good) // 2])
    (loras_dir / "not_a_lora.safetensors").write_bytes(b"\x00" * 64)
    torch.save({"x": torch.zeros(1)}, loras_dir / "pickled.pt")
    lora = loras["flux_a.safetensors"]
    a, b, _ = lora.layers["transformer_blocks.0.attn.to_q"]
    save_file(
        {
            "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": a,
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(b.shape[0], a.shape[0] + 1),
        },
        loras_dir / "rank_mismatch.safetensors",
    )
    save_file(
        {
            "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": a,
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": b,
            "transformer.transformer_blocks.0.attn.to_q.lora_B.bias": torch.zeros(b.shape[0] + 1),
        },
        loras_dir / "with_bias.safetensors",
    )
    save_file(
        {
            "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 128),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(128, 4),
        },
        loras_dir / "wider_model.safetensors",
    )
    save_file(
        {
            "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": torch.zeros(4, 32),
            "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": torch.zeros(32, 4),
        },
        loras_dir / "text_encoder_only.safetensors",
    )
    # A kohya FLUX.1 file with a text-encoder part: loads, and says the part is not applied.
    kohya = load_file(loras_dir / "flux_kohya.safetensors")
    kohya["lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"] = torch.zeros(4, 32)
    kohya["lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight"] = torch.zeros(32, 4)
    save_file(kohya, loras_dir / "with_text_encoder.safetensors")
    # diffusers' kohya converter loops forever on a negative alpha; a huge one overflows the weights into NaN
    for name, alpha in (("negative_alpha", -1.0), ("huge_alpha", 1e30), ("nan_alpha", math.nan)):
        tensors = load_file(loras_dir / "flux_kohya.safetensors")
        tensors["lora_unet_double_blocks_0_img_attn_proj.alpha"] = torch.tensor(alpha)
        save_file(tensors, loras_dir / f"{name}.safetensors")
    negative = make_tiny_lora(models_dir / "tiny-flux", "flux", alpha=-2.0, seed=9)
    save_diffusers_lora(negative, loras_dir / "negative_lora_alpha.safetensors", "flux")


@pytest.mark.parametrize(
    "key, widget, value, hint",
    [
        ("flux", "lora_name", "missing.safetensors", "unknown LoRA 'missing.safetensors'"),
        ("flux", "lora_name", "../flux_a.safetensors", "is not a LoRA name"),
        ("flux", "lora_name", "/etc/passwd", "is not a LoRA name"),
        ("flux", "lora_name", "", "no LoRA selected"),
        ("flux", "lora_name", "pickled.pt", "only .safetensors LoRAs are loaded, because .pt files are Python pickles"),
        ("flux", "lora_name", "cut_short.safetensors", "not a readable safetensors file .* download it again"),
        ("flux", "lora_name", "not_a_lora.safetensors", "not a readable safetensors file"),
        ("flux", "lora_name", "rank_mismatch.safetensors", "rank mismatch in transformer_blocks.0.attn.to_q"),
        ("flux", "lora_name", "wider_model.safetensors", r"is for another model: .* is 64×64 in this transformer"),
        ("flux", "lora_name", "text_encoder_only.safetensors", "only text-encoder weights"),
        ("flux", "lora_name", "with_bias.safetensors", r"a bias change of shape \[65\] for .*has 64 outputs"),
        (
            "flux",
            "lora_name",
            "negative_alpha.safetensors",
            r"negative_alpha\.safetensors has the alpha lora_unet_double_blocks_0_img_attn_proj\.alpha = -1; an alpha "
            "must be positive .* set the loader's strength negative instead",
        ),
        (
            "flux",
            "lora_name",
            "huge_alpha.safetensors",
            r"the alpha lora_unet_double_blocks_0_img_attn_proj\.alpha = 1e\+30, more than 1000 × its rank \(2\)",
        ),
        ("flux", "lora_name", "nan_alpha.safetensors", r"the alpha lora_unet_\S+\.alpha = nan, which is not a finite"),
        (
            "flux",
            "lora_name",
            "negative_lora_alpha.safetensors",
            r"the alpha transformer\.lora_alpha \(adapter metadata\) = -2",
        ),
        ("qwenimage", "lora_name", "flux_a.safetensors", r"another model.*\(checked against tiny-qwenimage"),
        ("flux2", "lora_name", "qwenimage_a.safetensors", "another model"),
        ("flux", "strength", math.nan, "not a number the sampler can use"),
        ("flux", "strength", 10.5, "out of range; use -10..10"),
    ],
)
def test_bad_lora_input_is_refused_before_anything_runs(models_dir, bad_loras, key, widget, value, hint):
    transformer = jobs.plan_transformer(backend(), model=FAMILIES[key]["model"], strategy="data_parallel")
    args = {"lora_name": "flux_a.safetensors", "strength": 1.0, widget: value}
    with pytest.raises(InvalidInput, match=hint) as info:
        jobs.add_lora(transformer, **args)
    assert info.value.widget == widget
    assert str(info.value).startswith(f"{widget}: ")


def test_a_lora_check_that_runs_away_is_refused_at_its_deadline(models_dir, loras_dir, monkeypatch):
    """ComfyUI validates on its event loop: a reading that never ends (as diffusers' did on a negative alpha) is a
    refusal naming the file at the deadline, and its outcome, once it has one, is what the next prompt gets."""
    from parallel_runtime.jobs import lora as lora_step

    release = threading.Event()

    def stuck(*args, **kwargs):
        release.wait(60)
        raise LoraError("was read at last")

    save_diffusers_lora(
        make_tiny_lora(models_dir / "tiny-flux", "flux", seed=13), loras_dir / "stuck.safetensors", "flux"
    )
    monkeypatch.setattr(lora_step, "read_lora", stuck)  # the reading stands still; the deadline is what is tested
    monkeypatch.setattr(lora_step, "CHECK_SECONDS", 0.5)
    transformer = jobs.plan_transformer(backend(), model="tiny-flux", strategy="data_parallel")
    with pytest.raises(InvalidInput, match=r"stuck\.safetensors took more than 0\.5 s to check") as info:
        jobs.add_lora(transformer, lora_name="stuck.safetensors")
    assert info.value.widget == "lora_name"
    release.set()
    deadline = time.monotonic() + 30
    while True:
        with pytest.raises(InvalidInput) as info:
            jobs.add_lora(transformer, lora_name="stuck.safetensors")
        if "was read at last" in str(info.value) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert "stuck.safetensors was read at last" in str(info.value)


def test_fusing_is_refused_when_the_kept_originals_would_not_fit_host_memory():
    """The check the ranks make before copying originals: all ranks of a machine copy at once."""
    from parallel_runtime.worker.lora import check_host_memory
    from parallel_runtime.worker.ops import WidgetError

    check_host_memory(4 << 30, 2, "style.safetensors", available=10 << 30, host="h")
    check_host_memory(0, 8, "style.safetensors", available=0, host="h")  # nothing new to keep
    hint = r"merging style\.safetensors .* 6\.0 GiB more on each of the 2 ranks of h, but 10\.0 GiB are free"
    with pytest.raises(WidgetError, match=hint) as info:
        check_host_memory(6 << 30, 2, "style.safetensors", available=10 << 30, host="h")
    assert info.value.widget == "lora_name"


def test_a_file_replaced_under_its_name_is_a_new_input_to_comfyui(nodes, models_dir, loras, loras_dir):
    """The node's fingerprint (V3's IS_CHANGED) follows the file, so ComfyUI does not reuse the handle of the file
    that was."""
    loader = nodes["ParallelLoraLoader"]
    target = loras_dir / "replaced.safetensors"
    shutil.copy(loras_dir / "flux_a.safetensors", target)
    before = loader.fingerprint_inputs(lora_name="replaced.safetensors", strength=1.0)
    shutil.copy(loras_dir / "flux_b.safetensors", target)
    assert loader.fingerprint_inputs(lora_name="replaced.safetensors", strength=1.0) != before
    assert loader.fingerprint_inputs(lora_name="no-such.safetensors", strength=1.0) is None


def test_text_encoder_parts_are_named_as_not_applied(models_dir, bad_loras):
    transformer = jobs.plan_transformer(backend(), model="tiny-flux", strategy="data_parallel")
    made, check = jobs.add_lora(transformer, lora_name="with_text_encoder.safetensors", strength=1.0)
    assert check.text_encoder_keys == 2 and check.layers == len(FLUX_BFL_LAYERS)
    text = check.describe("with_text_encoder.safetensors", 1.0)
    assert "2 text-encoder weights (lora_te…) are not applied" in text and "LoraLoaderModelOnly" in text
    assert [ref.name for ref in made.spec.loras] == ["with_text_encoder.safetensors"]


@pytest.mark.multirank
def test_a_lora_that_fails_on_the_ranks_leaves_the_backend_and_its_transformer_up(
    models_dir, loras, loras_dir, conditioning, one_shot
):
    """A file replaced after it was checked by another of the same size (its content differs, nothing else) fails on
    every rank before denoising, none applying it; the backend stays up with its transformer resident (no reload), and
    the next prompt without that LoRA runs."""
    spec = backend()
    generate(spec, conditioning, "flux", "tensor_parallel")
    pids, counts = get_backend(spec).worker_pids, get_backend(spec).status().ranks[0].load_counts
    changing = loras_dir / "changing.safetensors"
    shutil.copy(loras_dir / "flux_a.safetensors", changing)
    checked = handle(spec, "flux", "tensor_parallel", (("changing.safetensors", 1.0),))
    ranks = {"transformer_blocks.0.attn.to_out.0": 2, "proj_out": 3}  # flux_a's, with other values
    save_diffusers_lora(make_tiny_lora(models_dir / "tiny-flux", "flux", ranks=ranks, seed=14), changing, "flux")
    assert changing.stat().st_size == (loras_dir / "flux_a.safetensors").stat().st_size
    with pytest.raises(InvalidInput, match=r"changing\.safetensors on .* changed since it was checked"):
        jobs.sample(checked, conditioning(spec, "flux"), seed=3, steps=STEPS, width=64, height=64, guidance_scale=3.5)
    image = generate(spec, conditioning, "flux", "tensor_parallel")
    assert get_backend(spec).worker_pids == pids
    assert get_backend(spec).status().ranks[0].load_counts == counts
    assert (image - one_shot("flux", ())).abs().max() <= 1e-4


# -- 4 ranks (last: the module's 2-rank backend is replaced) ---------------------------------------------------------
@pytest.mark.multirank
@pytest.mark.four_ranks
def test_tp_cp_and_unified_with_stacked_loras_on_four_ranks(models_dir, loras, conditioning, one_shot):
    spec = backend(4)
    expected = one_shot("flux", STACK)
    for strategy, args in (
        ("tp_cp", {"tp_degree": 2, "ulysses_degree": 2}),
        ("context_parallel", {"ring_degree": 2, "ulysses_degree": 2}),
    ):
        image = generate(spec, conditioning, "flux", strategy, STACK, **args)
        diff = (image - expected).abs().max().item()
        print(f"{strategy} {args}: max |diff| vs diffusers with the LoRAs {diff:.3g}")
        assert diff <= 1e-4, strategy


# -- in a real ComfyUI: refused with a 400 before anything runs -------------------------------------------------------
@pytest.mark.comfyui
def test_a_bad_lora_is_a_400_that_names_lora_name(comfyui_server, comfyui_models_dir, comfyui_loras_dir):
    """POST /prompt of the LoRA example: a pickle is refused by the file check, a LoRA of another model by the check of
    its content against the transformer the loader is chained to (validation computes it: both load nothing), and the
    sampler still checks its size against the strategy of the handle that comes through the loader."""
    from comfyui_host import REPO_ROOT, PromptRejected
    from comfyui_workflows import tiny_flux

    model = tiny_flux(comfyui_models_dir)
    torch.save({"x": torch.zeros(1)}, comfyui_loras_dir / "pickled-e2e.pt")
    qwen_like = {
        "transformer.transformer_blocks.0.img_mod.1.lora_A.weight": torch.zeros(4, 64),
        "transformer.transformer_blocks.0.img_mod.1.lora_B.weight": torch.zeros(384, 4),
    }
    save_file(qwen_like, comfyui_loras_dir / "other-model-e2e.safetensors")
    save_diffusers_lora(make_tiny_lora(model, "flux", seed=12), comfyui_loras_dir / "good-e2e.safetensors", "flux")
    kohya = comfyui_loras_dir / "negative-alpha-e2e.safetensors"
    save_bfl_lora(make_tiny_lora(model, "flux", layers=FLUX_BFL_LAYERS, seed=15), kohya, model, "flux", layout="kohya")
    tensors = load_file(kohya)
    tensors["lora_unet_double_blocks_0_img_attn_proj.alpha"] = torch.tensor(-1.0)
    save_file(tensors, kohya)
    workflow = json.loads((REPO_ROOT / "example_workflows/api/flux1_lora_context_parallel_api.json").read_text())
    for node in workflow.values():
        if "model" in node["inputs"]:
            node["inputs"]["model"] = model.name
    workflow["1"]["inputs"].update(ranks=2, device="cpu")
    workflow["4"]["inputs"].update(steps=2)
    cases = [
        ("pickled-e2e.pt", 64, "7", "lora_name: pickled-e2e.pt is a .pt file; only .safetensors LoRAs are loaded"),
        ("other-model-e2e.safetensors", 64, "7", "lora_name: other-model-e2e.safetensors changes transformer_blocks"),
        # diffusers' kohya converter looped forever on it, on ComfyUI's event loop: the whole server hung
        (
            "negative-alpha-e2e.safetensors",
            64,
            "7",
            "lora_name: negative-alpha-e2e.safetensors has the alpha lora_unet_double_blocks_0_img_attn_proj.alpha "
            "= -1",
        ),
        # a good LoRA, and a size Ulysses cannot split: the sampler checks the handle computed through the loader
        ("good-e2e.safetensors", 48, "4", "width: 48×48 makes 9 image tokens, which do not split over 2 ranks"),
    ]
    for lora, size, node, hint in cases:
        workflow["7"]["inputs"]["lora_name"] = lora
        workflow["4"]["inputs"].update(width=size, height=size)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            posted = pool.submit(_post, comfyui_server, workflow)
            while not posted.done():  # the server answers others while it checks the LoRA
                assert comfyui_server.system_stats()["system"], lora
                time.sleep(0.05)
        with pytest.raises(PromptRejected) as rejected:
            raise posted.result()
        assert rejected.value.status == 400
        assert list(rejected.value.node_errors) == [node], rejected.value.node_errors
        (error,) = rejected.value.node_errors[node]["errors"]
        assert error["type"] == "custom_validation_failed" and hint in error["details"], error


def _post(server, workflow: dict) -> Exception:
    """What POST /prompt raised (a PromptRejected, or the request's own error when the server did not answer)."""
    try:
        server.post_prompt(workflow)
    except Exception as e:
        return e
    return AssertionError("the prompt was accepted")
