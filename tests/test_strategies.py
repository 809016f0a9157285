"""Context, tensor and data parallelism through the nodes' steps (``jobs``), on real CPU ranks, against diffusers'
one-shot pipeline."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline
from helpers import (
    MODEL,
    NEW_FAMILIES,
    PROMPT,
    STEPS,
    TOKENS,
    family_reference,
    generate,
    generate_family,
    one_shot_images,
)

from parallel_runtime import InvalidInput, default_spec, get_backend, jobs


@pytest.fixture(scope="module")
def one_shot(models_dir):
    return one_shot_images(
        FluxPipeline.from_pretrained(models_dir / MODEL), guidance_scale=3.5, max_sequence_length=TOKENS
    )


def backend(ranks: int):
    return default_spec(ranks=ranks, device="cpu", memory_policy="staged")


CASES_2_RANKS = [
    ("ring", "context_parallel", {"ring_degree": 2, "ulysses_degree": 1}, (64, 64)),
    ("ulysses", "context_parallel", {"ulysses_degree": 2}, (64, 64)),
    ("ulysses_anything_odd", "context_parallel", {"ulysses_degree": 2, "anything": True}, (48, 80)),
    ("ring_anything_odd", "context_parallel", {"ring_degree": 2, "ulysses_degree": 1, "anything": True}, (48, 80)),
    ("tp", "tensor_parallel", {"tp_degree": 2}, (48, 80)),
]


@pytest.mark.multirank
@pytest.mark.parametrize("name, strategy, args, size", CASES_2_RANKS, ids=[c[0] for c in CASES_2_RANKS])
def test_two_rank_strategy_matches_one_process(models_dir, one_shot, name, strategy, args, size):
    width, height = size
    image = generate(backend(2), strategy, width=width, height=height, **args)
    assert (image - one_shot(3, width, height)).abs().max() <= 1e-4


@pytest.mark.multirank
def test_data_parallel_splits_the_batch_and_keeps_every_image(models_dir, one_shot):
    image = generate(backend(2), "data_parallel", batch_size=3)
    reference = one_shot(3, 64, 64, batch_size=3)
    assert image.shape[0] == 3
    # Rank 0 made images 0-1, rank 1 image 2, each from its own seed (seed + i). Not bit-exact: CPU GEMM
    # kernels block differently for another batch size and thread count, which moves the last float32 bits.
    for i in range(3):
        assert (image[i] - reference[i]).abs().max() <= 1e-5, i


PROMPTS = ["a photo of a horse in the city", "a red fox in the snow at night", "a lighthouse"]


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["flux", "qwenimage"])
def test_data_parallel_over_a_list_of_prompts(models_dir, name):
    """Three prompts × 2 images = 6 images over 2 ranks: rank 0 makes prompt 0's two and prompt 1's first, rank 1
    the rest, so a rank's slice spans prompts. Image i (prompt i // 2) uses seed + i, as the one-shot pipeline does
    with num_images_per_prompt=2 and a list of generators."""
    family = (
        {
            "model": MODEL,
            "pipeline": FluxPipeline,
            "max_sequence_length": TOKENS,
            "encode": {},
            "sample": {},
            "reference": {"guidance_scale": 3.5},
        }
        if name == "flux"
        else NEW_FAMILIES[name]
    )
    # Qwen-Image keeps each prompt's own length: 64 tokens keep them different, so rows are padded and masked.
    max_sequence_length = 64 if name == "qwenimage" else family["max_sequence_length"]
    spec = backend(2)
    positive = jobs.encode_prompt(
        spec,
        model=family["model"],
        prompt="\n".join(PROMPTS) + "\n",
        one_prompt_per_line=True,
        max_sequence_length=max_sequence_length,
        **family["encode"],
    )
    transformer = jobs.plan_transformer(spec, model=family["model"], strategy="data_parallel")
    latent = jobs.sample(
        transformer,
        positive,
        seed=3,
        steps=STEPS,
        width=64,
        height=64,
        batch_size=2,
        **{"guidance_scale": 3.5, **family["sample"]},
    )
    images = jobs.decode(spec, model=family["model"], samples=latent)

    pipe = family["pipeline"].from_pretrained(models_dir / family["model"])
    pipe.set_progress_bar_config(disable=True)
    # One call per prompt: diffusers 0.42.1's QwenImagePipeline mis-orders the attention mask of a batched call with
    # prompts of different lengths and num_images_per_prompt > 1 (see test_examples_comfyui.reference_images).
    expected = torch.cat(
        [
            pipe(
                prompt=prompt,
                num_images_per_prompt=2,
                num_inference_steps=STEPS,
                width=64,
                height=64,
                max_sequence_length=max_sequence_length,
                output_type="pt",
                generator=[torch.Generator("cpu").manual_seed(3 + 2 * p + i) for i in range(2)],
                **family["reference"],
            ).images
            for p, prompt in enumerate(PROMPTS)
        ]
    ).permute(0, 2, 3, 1)
    assert images.shape[0] == 6
    diffs = (images[:, None] - expected[None]).abs().flatten(2).amax(-1)  # [made, expected]
    print(f"{name} data parallel over 3 prompts: max |diff| per image {diffs.diagonal().tolist()}")
    # Each image matches its own (prompt, seed) to float rounding and no other: nothing is swapped or repeated.
    # Not bit-exact: CPU GEMM kernels block differently for another batch size and thread count.
    assert diffs.diagonal().max() <= 1e-5
    assert (diffs + torch.eye(6) * 1e9).amin() > 1e-3


@pytest.mark.multirank
def test_tensor_parallel_holds_a_slice_per_rank(models_dir):
    spec = backend(2)
    generate(spec, "tensor_parallel", width=48, height=80)
    sharded = _transformer_on_each_rank(spec)
    generate(spec, "data_parallel", batch_size=2)  # a full replica per rank, for comparison
    full = _transformer_on_each_rank(spec)[0]
    shares = [m.parameter_bytes / full.parameter_bytes for m in sharded]
    print(f"tensor parallel, 2 ranks: parameter share per rank {[round(s, 3) for s in shares]}")
    assert all(s <= 0.75 for s in shares)


@pytest.mark.multirank
def test_switching_strategy_reloads_only_the_transformer(models_dir, one_shot):
    spec = backend(2)
    generate(spec, "context_parallel", ulysses_degree=2)
    pids = get_backend(spec).worker_pids
    counts = get_backend(spec).status().ranks[0].load_counts
    image = generate(spec, "tensor_parallel", width=64, height=64)
    image2 = generate(spec, "context_parallel", ring_degree=2, ulysses_degree=1)
    after = get_backend(spec).status().ranks[0].load_counts
    assert get_backend(spec).worker_pids == pids  # no restart
    assert after["transformer:tiny-flux"] == counts["transformer:tiny-flux"] + 2
    assert after["vae:tiny-flux"] == counts["vae:tiny-flux"]
    assert (image - one_shot(3, 64, 64)).abs().max() <= 1e-4 and (image2 - one_shot(3, 64, 64)).abs().max() <= 1e-4


def _transformer_on_each_rank(spec) -> list:
    return [next(m for m in r.resident if m.component == "transformer") for r in get_backend(spec).status().ranks]


FOUR_RANK_CASES = [
    ("unified", "context_parallel", {"ring_degree": 2, "ulysses_degree": 2}, {"ring_degree": 2, "ulysses_degree": 2}),
    (
        "tp_cp_ulysses",
        "tp_cp",
        {"tp_degree": 2, "ulysses_degree": 2},
        {"tp_degree": 2, "ring_degree": 1, "ulysses_degree": 2},
    ),
    (
        "tp_cp_ring",
        "tp_cp",
        {"tp_degree": 2, "ring_degree": 2, "ulysses_degree": 1},
        {"tp_degree": 2, "ring_degree": 2, "ulysses_degree": 1},
    ),
]


@pytest.mark.multirank
@pytest.mark.four_ranks
def test_tp_cp_and_unified_attention_on_four_ranks(models_dir, one_shot):
    """TP 2 inside, Ulysses 2 across: each rank holds half of every planned weight and a quarter of the work. Then
    Unified attention (ring 2 × Ulysses 2), a full replica per rank, on the same backend."""
    spec = backend(4)
    image = generate(spec, "tp_cp", tp_degree=2, ulysses_degree=2)
    assert (image - one_shot(3, 64, 64)).abs().max() <= 1e-4
    sharded = _transformer_on_each_rank(spec)
    # What diffusers applied, read back from each rank's model: the test fails if either half silently fell away.
    assert all(m.parallelism == {"tp_degree": 2, "ring_degree": 1, "ulysses_degree": 2} for m in sharded)
    image = generate(spec, "context_parallel", ring_degree=2, ulysses_degree=2)
    assert (image - one_shot(3, 64, 64)).abs().max() <= 1e-4
    replicas = _transformer_on_each_rank(spec)
    assert all(m.parallelism == {"ring_degree": 2, "ulysses_degree": 2} for m in replicas)
    full = replicas[0].parameter_bytes
    shares = [m.parameter_bytes / full for m in sharded]
    print(f"tp_cp tp2 x ulysses2, 4 ranks: parameter share per rank {[round(s, 3) for s in shares]}")
    assert all(s <= 0.75 for s in shares)


@pytest.mark.multirank
@pytest.mark.four_ranks
@pytest.mark.parametrize("name", sorted(NEW_FAMILIES))
def test_new_family_four_rank_meshes(models_dir, family_one_shot, name):
    """Unified attention and both tp_cp layouts for FLUX.2 and Qwen-Image, on one 4-rank backend."""
    spec = backend(4)
    reference = family_one_shot(name, 3)
    for case, strategy, args, applied in FOUR_RANK_CASES:
        _, image = generate_family(spec, name, strategy, **args)
        diff = (image - reference).abs().max().item()
        print(f"{name} {case}: max |diff| vs one-shot {diff:.3g}")
        assert diff <= 1e-4, case
        assert all(m.parallelism == applied for m in _transformer_on_each_rank(spec)), case


@pytest.mark.parametrize(
    "widget, args, hint",
    [
        (
            "ulysses_degree",
            {"strategy": "context_parallel", "ring_degree": 2, "ulysses_degree": 2},
            "backend has 2 ranks",
        ),
        ("ulysses_degree", {"strategy": "context_parallel", "ulysses_degree": 1, "ranks": 1}, "2 or more ranks"),
        ("tp_degree", {"strategy": "tensor_parallel", "tp_degree": 3}, "must equal"),
        (
            "anything",
            {"strategy": "context_parallel", "ring_degree": 2, "ulysses_degree": 2, "anything": True, "ranks": 4},
            "one axis",
        ),
        ("ulysses_degree", {"strategy": "context_parallel", "ulysses_degree": 3, "ranks": 3}, "divisor of 4"),
        (
            "ulysses_degree",
            {"strategy": "context_parallel", "ulysses_degree": 8, "anything": True, "ranks": 8},
            "at least as many attention heads",
        ),
        ("tp_degree", {"strategy": "tensor_parallel", "ranks": 8}, "4 attention heads do not split"),
        ("attention_backend", {"strategy": "context_parallel", "attention_backend": "magic"}, "unknown backend"),
        ("tp_degree", {"strategy": "tp_cp", "tp_degree": 2}, "leaving ≥ 2 for context parallelism"),
        ("tp_degree", {"strategy": "tp_cp", "tp_degree": 3, "ranks": 6}, "4 attention heads do not split"),
        (
            "ulysses_degree",
            {"strategy": "tp_cp", "tp_degree": 2, "ulysses_degree": 3, "ranks": 8},
            "tp_degree 2 leaves 4 ranks",
        ),
        # 4 heads over tp 2 leave 2 per rank: Ulysses 4 has nothing to split, even with anything.
        (
            "ulysses_degree",
            {"strategy": "tp_cp", "tp_degree": 2, "ulysses_degree": 4, "anything": True, "ranks": 8},
            "2 attention heads per TP rank < ulysses_degree 4",
        ),
    ],
)
def test_strategy_validation_names_the_widget(models_dir, widget, args, hint):
    args = dict(args)
    spec = backend(args.pop("ranks", 2))
    with pytest.raises(InvalidInput, match=hint) as info:
        jobs.plan_transformer(spec, model=MODEL, **args)
    assert info.value.widget == widget


@pytest.mark.parametrize(
    "widget, strategy, sampler, hint",
    [
        (
            "width",
            {"strategy": "context_parallel", "ulysses_degree": 2},
            {"width": 48, "height": 80},
            "turn on anything",
        ),
        (
            "width",
            {"strategy": "tp_cp", "tp_degree": 2, "ulysses_degree": 2, "ranks": 4},
            {"width": 48, "height": 80},
            "15 image tokens, which do not split over 2 ranks",
        ),
        ("batch_size", {"strategy": "data_parallel"}, {"batch_size": 1}, "needs at least 2 images"),
    ],
)
def test_sampler_revalidates_against_the_size(models_dir, widget, strategy, sampler, hint):
    strategy = dict(strategy)
    spec = backend(strategy.pop("ranks", 2))
    transformer = jobs.plan_transformer(spec, model=MODEL, **strategy)
    args = {"steps": 1, "width": 64, "height": 64, "batch_size": 2, **sampler}
    with pytest.raises(InvalidInput, match=hint) as info:
        jobs.validate_sample(transformer, None, **args)
    assert info.value.widget == widget


@pytest.fixture(scope="module")
def family_one_shot(models_dir):
    """(family, seed, batch_size) -> the one-shot pipeline's IMAGE at 64x64, image i from seed + i."""
    cache = {}

    def reference(
        name: str, seed: int, batch_size: int = 1, width: int = 64, height: int = 64, **overrides
    ) -> torch.Tensor:
        key = (name, seed, batch_size, width, height, tuple(sorted(overrides.items())))
        if key not in cache:
            folder = models_dir / NEW_FAMILIES[name]["model"]
            cache[key] = family_reference(folder, name, seed, batch_size, width, height, **overrides)
        return cache[key]

    return reference


FAMILY_CASES = [
    ("ulysses", "context_parallel", {"ulysses_degree": 2}, 1, 1e-4, (64, 64)),
    ("ring", "context_parallel", {"ring_degree": 2, "ulysses_degree": 1}, 1, 1e-4, (64, 64)),
    # 48x80: 15 image tokens (FLUX.2's 16x-patched latent: 3x5) that do not split evenly over 2 ranks.
    ("ulysses_anything_odd", "context_parallel", {"ulysses_degree": 2, "anything": True}, 1, 1e-4, (48, 80)),
    (
        "ring_anything_odd",
        "context_parallel",
        {"ring_degree": 2, "ulysses_degree": 1, "anything": True},
        1,
        1e-4,
        (48, 80),
    ),
    ("tp", "tensor_parallel", {"tp_degree": 2}, 1, 1e-4, (64, 64)),
    # Not bit-exact: CPU GEMM kernels block differently for another batch size and thread count.
    ("data_parallel", "data_parallel", {}, 2, 1e-5, (64, 64)),
]


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(NEW_FAMILIES))
@pytest.mark.parametrize(
    "case, strategy, args, batch_size, tolerance, size", FAMILY_CASES, ids=[c[0] for c in FAMILY_CASES]
)
def test_new_family_strategy_matches_one_shot(
    models_dir, family_one_shot, name, case, strategy, args, batch_size, tolerance, size
):
    width, height = size
    latent, image = generate_family(
        backend(2), name, strategy, batch_size=batch_size, width=width, height=height, **args
    )
    h, w = (height // 16, width // 16) if name == "flux2" else (height // 8, width // 8)
    assert latent.shape == ((batch_size, 128, h, w) if name == "flux2" else (batch_size, 16, 1, h, w))
    diff = (image - family_one_shot(name, 3, batch_size, width=width, height=height)).abs().max().item()
    print(f"{name} {case}: max |diff| vs one-shot {diff:.3g}")
    assert diff <= tolerance


def _sample_args(**overrides):
    return {"seed": 0, "steps": STEPS, "guidance_scale": 3.5, "width": 64, "height": 64, "batch_size": 1, **overrides}


def _validate_qwenimage(spec, **overrides):
    transformer = jobs.plan_transformer(spec, model="tiny-qwenimage", strategy="device_map")
    args = {k: v for k, v in _sample_args(**overrides).items() if k != "seed"}
    jobs.validate_sample(transformer, None, **args)


@pytest.mark.parametrize(
    "widget, call, hint",
    [
        ("steps", lambda spec: _validate_qwenimage(spec, steps=1), "shift_terminal"),
        ("true_cfg_scale", lambda spec: _validate_qwenimage(spec, true_cfg_scale=0.5), "use 1"),
        (
            "prompt_2",
            lambda spec: jobs.encode_prompt(spec, model="tiny-flux2", prompt=PROMPT, prompt_2="a dog"),
            "one text encoder",
        ),
        (
            "max_sequence_length",
            lambda spec: jobs.encode_prompt(spec, model="tiny-flux2", prompt=PROMPT, max_sequence_length=1024),
            "1..512",
        ),
        (
            "samples",
            lambda spec: jobs.decode(spec, model="tiny-flux2", samples=torch.zeros(1, 32, 8, 8)),
            "128 channels",
        ),
        (
            "samples",
            lambda spec: jobs.decode(spec, model="tiny-qwenimage", samples=torch.zeros(1, 16, 2, 8, 8)),
            "one frame",
        ),
    ],
)
def test_new_family_widgets_fail_before_anything_runs(models_dir, widget, call, hint):
    with pytest.raises(InvalidInput, match=hint) as info:
        call(backend(2))
    assert info.value.widget == widget


@pytest.mark.multirank
def test_qwenimage_text_tokens_must_split_for_plain_context_parallel(models_dir):
    """Qwen-Image does not pad prompts: the sampler checks the prompt's and the negative prompt's own lengths."""
    spec = backend(2)
    # 8 and 5 tokens (an empty negative prompt is the chat template's 5-token tail).
    positive = jobs.encode_prompt(spec, model="tiny-qwenimage", prompt=PROMPT, max_sequence_length=8)
    transformer = jobs.plan_transformer(spec, model="tiny-qwenimage", strategy="context_parallel", ulysses_degree=2)
    with pytest.raises(InvalidInput, match=r"negative prompt is 5 text tokens.*turn on anything") as info:
        jobs.sample(transformer, positive, **_sample_args())
    assert info.value.widget == "positive"
    # With true CFG off the negative prompt is not used, so its length does not matter.
    jobs.sample(transformer, positive, **_sample_args(true_cfg_scale=1.0))
    # A FLUX.2 conditioning does not fit a Qwen-Image transformer.
    flux2_positive = jobs.encode_prompt(spec, model="tiny-flux2", prompt=PROMPT, max_sequence_length=48)
    with pytest.raises(InvalidInput, match=r"FLUX\.2.*Qwen-Image") as info:
        jobs.sample(transformer, flux2_positive, **_sample_args())
    assert info.value.widget == "positive"


@pytest.mark.multirank
def test_qwenimage_ulysses_anything_takes_unpadded_prompts(models_dir, family_one_shot):
    """What the sampler tells Qwen-Image users to do about odd token counts: 15 image tokens (48x80), a 13-token
    prompt and the empty negative prompt's 5 tokens, all split unevenly over 2 ranks."""
    _, image = generate_family(
        backend(2),
        "qwenimage",
        "context_parallel",
        width=48,
        height=80,
        ulysses_degree=2,
        anything=True,
        encode={"max_sequence_length": 64, "negative_prompt": ""},
    )
    reference = family_one_shot("qwenimage", 3, width=48, height=80, max_sequence_length=64, negative_prompt="")
    assert (image - reference).abs().max() <= 1e-4
