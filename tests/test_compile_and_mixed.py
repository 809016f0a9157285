"""Regional compilation (LoadShardedTransformer's ``compile``) against eager, and unequal ranks (data parallelism's
split by speed, the pace note of lock-step strategies), on one 2-rank CPU backend whose rank 1 is slowed on purpose.

The ranks compile with ``aot_eager`` (``COMPILE_BACKEND_ENV``): inductor runs on this machine (gcc is present) but
takes ~50 s per block class per rank here; aot_eager traces the same graphs through dynamo and AOTAutograd, which is
what the hooks, DTensors, LoRA merges and recompiles meet, without inductor's code generation. bench/compile.py
measures inductor."""

from __future__ import annotations

import pytest
from helpers import PROMPT, TOKENS

from parallel_runtime import InvalidInput, default_spec, get_backend, jobs, shutdown_backend
from parallel_runtime.families.tiny import make_tiny_lora, make_tiny_model, save_diffusers_lora
from parallel_runtime.wire import COMPILE_BACKEND_ENV, RANK_SPEEDS_ENV
from parallel_runtime.worker import speeds

MODEL, STEPS = "tiny-flux", 2
WAN22 = "tiny-wan22"
SLOW_SECONDS = 0.5  # rank 1's sleep per denoising step: a slower GPU
# aot_eager runs the eager ops through the traced graph: the same kernels, so the same bits; the tolerance leaves room
# for a backend that fuses (inductor differs from eager by ~5e-7 on this model).
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def models_dir(models_root):
    make_tiny_model("flux", str(models_root / MODEL))
    return models_root


@pytest.fixture(scope="module")
def wan22(models_dir):
    """A tiny Wan 2.2 A14B (two experts) beside the FLUX.1."""
    from parallel_runtime.families.wan.tiny import make_tiny_model as make_tiny_wan

    make_tiny_wan(str(models_dir / WAN22), 0, two_experts=True)
    return models_dir / WAN22


@pytest.fixture(scope="module")
def lora(models_dir, tmp_path_factory):
    """A LoRA that changes a layer inside the compiled blocks, in the folder the steps see."""
    root = tmp_path_factory.mktemp("loras")
    made = make_tiny_lora(models_dir / MODEL, "flux", ranks={"transformer_blocks.0.attn.to_out.0": 2}, seed=1)
    save_diffusers_lora(made, root / "block.safetensors", "flux")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("COMFY_PARALLEL_LORAS", str(root))
        yield "block.safetensors"


@pytest.fixture(scope="module")
def spec(models_dir):
    """A 2-rank backend started with the module's switches: aot_eager, rank 1 slowed. Shut down at the end, so no
    other module's backend ever sees them."""
    shutdown_backend()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(COMPILE_BACKEND_ENV, "aot_eager")
        env.setenv(speeds.SLOW_RANK_ENV, f"1:{SLOW_SECONDS}")
        yield default_spec(ranks=2, device="cpu", memory_policy="staged")
        shutdown_backend()


@pytest.fixture(scope="module")
def positive(spec):
    """The prompt encoded once: encoding again would free the transformer under ``staged``, and each test's runs
    must find the one they compiled."""
    return jobs.encode_prompt(spec, model=MODEL, prompt=PROMPT, max_sequence_length=TOKENS)


def _sample(positive, handle, size: int = 64, batch_size: int = 1):
    """The latent and the denoise's result."""
    results = []
    latent = jobs.sample(
        handle,
        positive,
        seed=3,
        steps=STEPS,
        guidance_scale=3.5,
        width=size,
        height=size,
        batch_size=batch_size,
        on_result=results.append,
    )
    return latent, results[0]


CASES = [
    pytest.param("context_parallel", {"ulysses_degree": 2}, id="ulysses"),
    pytest.param("tensor_parallel", {"tp_degree": 2}, id="tp", marks=pytest.mark.slow),
]


@pytest.mark.multirank
@pytest.mark.parametrize("strategy, args", CASES)
def test_regional_compile_equals_eager_through_a_lora_change_and_recompiles_for_a_size(
    spec, positive, lora, strategy, args
):
    def handle(compile: str, strength: float):
        planned = jobs.plan_transformer(spec, model=MODEL, strategy=strategy, compile=compile, **args)
        return jobs.add_lora(planned, lora_name=lora, strength=strength)[0]

    eager = {s: _sample(positive, handle("off", s))[0] for s in (1.0, 0.5)}
    full, first = _sample(positive, handle("regional", 1.0))
    assert first.compile.first and first.compile.graphs > 0
    assert (full - eager[1.0]).abs().max() <= TOLERANCE

    # A strength change merges new weights into the compiled blocks' parameters: the image is eager's at 0.5, with no
    # recompile, and not the image of the weights the blocks were compiled with.
    half, changed = _sample(positive, handle("regional", 0.5))
    assert not changed.compile.first and changed.compile.graphs == 0, changed.compile
    assert (half - eager[0.5]).abs().max() <= TOLERANCE
    assert (half - full).abs().max() > 100 * TOLERANCE
    assert "no recompile" in changed.compile.describe()

    bigger, resized = _sample(positive, handle("regional", 0.5), size=96)
    assert resized.compile.graphs > 0 and any("size mismatch" in r for r in resized.compile.reasons), resized.compile
    assert "recompiled" in resized.compile.describe()
    eager_bigger, _ = _sample(positive, handle("off", 0.5), size=96)
    assert (bigger - eager_bigger).abs().max() <= TOLERANCE

    # Lock-step ranks on unequal devices: the node says the slowest sets the pace.
    assert resized.devices == ("cpu", "cpu (slowed for a test)")
    assert any("slowest" in note for note in resized.notes())


def test_compile_with_a_step_cache_is_refused_by_name(models_dir):
    with pytest.raises(InvalidInput, match="compile") as refused:
        jobs.plan_transformer(default_spec(ranks=2, device="cpu"), model=MODEL, cache="taylorseer", compile="regional")
    assert refused.value.widget == "compile"
    with pytest.raises(InvalidInput, match="compile"):
        jobs.plan_transformer(default_spec(ranks=2, device="cpu"), model=MODEL, compile="inductor")


@pytest.mark.multirank
def test_data_parallel_follows_the_measured_speeds_and_keeps_every_image(spec, positive):
    handle = jobs.plan_transformer(spec, model=MODEL, strategy="data_parallel")
    even, first = _sample(positive, handle, batch_size=4)
    assert first.split.source == "even" and first.split.images == (2, 2)

    by_speed, second = _sample(positive, handle, batch_size=4)
    split = second.split
    assert split.source == "measured" and len(split.speeds) == 2
    # Rank 1 sleeps at every step: it measured itself slower, and the split follows the speeds the ranks reported.
    assert split.speeds[1] < split.speeds[0]
    assert split.images == tuple(speeds.shares(4, list(split.speeds))) and split.images != (2, 2)
    assert "images by speed" in split.describe()
    # Image i is seed + i wherever it is made; not bit-exact, as a batch of another size blocks its GEMMs otherwise.
    assert (by_speed - even).abs().max() <= 1e-5


def test_shares_follow_speeds_and_give_every_rank_an_image():
    assert speeds.shares(4, [1.0, 3.0]) == [1, 3]
    assert speeds.shares(6, [2.0, 1.0]) == [4, 2]
    assert speeds.shares(2, [100.0, 1.0]) == [1, 1]  # every rank runs the steps' collectives: none goes empty
    assert speeds.shares(7, [1.0, 1.0, 1.0]) == [3, 2, 2]
    assert sum(speeds.shares(9, [0.3, 1.7, 2.9])) == 9


def test_declared_speeds_name_the_variable(monkeypatch):
    monkeypatch.setenv(RANK_SPEEDS_ENV, "1,0.5")
    assert speeds._declared(2) == [1.0, 0.5]
    monkeypatch.setenv(RANK_SPEEDS_ENV, "1,fast")
    with pytest.raises(Exception, match=RANK_SPEEDS_ENV):
        speeds._declared(2)
    monkeypatch.delenv(RANK_SPEEDS_ENV)
    assert speeds._declared(2) == []


def test_device_map_budget_names_the_gpu_that_limits_the_split():
    from parallel_runtime.worker import memory

    free = [20 << 30, 70 << 30]  # a busy or smaller first GPU beside a larger one
    budget = memory.default_budget(free, reserve_first=2 << 30, activations=1 << 30, host_free=64 << 30)
    assert budget[0] < budget[1]  # each GPU's own free memory
    note = memory.describe_budget(budget)
    assert "GPU 0 has the least room" in note and "GPU 1" in note
    assert memory.describe_budget({"cpu": 1 << 30}) == ""


@pytest.mark.multirank
@pytest.mark.slow
def test_regional_compile_covers_both_experts_of_wan22(spec, wan22):
    """Wan 2.2 A14B under Ulysses: both experts' blocks run compiled (read back from the ranks' models), and the clip
    is WanPipeline's. Last in the module: its encode frees the FLUX.1 transformer the tests above compiled."""
    import json

    from helpers import WAN_CLIP, wan_clip_prompt, wan_one_shot

    positive = wan_clip_prompt(spec, WAN22)
    handle = jobs.plan_transformer(spec, model=WAN22, strategy="context_parallel", ulysses_degree=2, compile="regional")
    latent = jobs.sample(
        handle, positive, seed=3, steps=WAN_CLIP["num_inference_steps"], guidance_scale=1.0,
        true_cfg_scale=WAN_CLIP["guidance_scale"], width=WAN_CLIP["width"], height=WAN_CLIP["height"],
        sampler="uni_pc", length=WAN_CLIP["num_frames"], guidance_scale_2=3.0,
    )  # fmt: skip
    frames = jobs.decode(spec, model=WAN22, samples=latent)
    expected = wan_one_shot(wan22, guidance_scale_2=3.0).permute(0, 1, 3, 4, 2).flatten(0, 1)
    assert (frames - expected).abs().max().item() <= 1e-4
    layers = json.loads((wan22 / "transformer" / "config.json").read_text())["num_layers"]
    for rank in get_backend(spec).status().ranks:
        (transformer,) = [m for m in rank.resident if m.component == "transformer"]
        assert transformer.parallelism.get("compiled_blocks") == 2 * layers  # each expert's blocks
