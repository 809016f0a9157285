"""The ``auto`` memory policy on a 2-rank CPU backend, a tiny FLUX.1 and context parallelism (the transformer on every
rank): a prompt edit reloads nothing while the memory holds every model, and the image equals ``staged``'s; with a
memory cap (``COMFY_PARALLEL_MEMORY_CAP_GB``) under which the text encoders and the transformer do not fit together,
``auto`` frees the least recently used model first and behaves as ``staged``, and the node text says so."""

from __future__ import annotations

import pytest
import torch

from parallel_runtime import BackendSpec, default_spec, get_backend, jobs, shutdown_backend
from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux
from parallel_runtime.wire import Sampling
from parallel_runtime.worker import memory
from parallel_runtime.worker.models import ModelKey, ResidentModels

MODEL = "tiny-flux"
PROMPTS = ("a red cat on a blue sky", "a green tree at night")  # the prompt edit
SIZE, STEPS, SEED = 64, 2, 5
TRANSFORMER, TEXT_ENCODERS, VAE = (f"{c}:{MODEL}" for c in ("transformer", "text_encoders", "vae"))


@pytest.fixture(scope="module")
def models_dir(models_root):
    make_tiny_flux(str(models_root / MODEL))
    return models_root


def spec_of(policy: str) -> BackendSpec:
    return default_spec(ranks=2, device="cpu", memory_policy=policy)


def load_counts(spec: BackendSpec) -> list[dict[str, int]]:
    return [r.load_counts for r in get_backend(spec).status().ranks]


def resident(spec: BackendSpec) -> set[str]:
    return {f"{m.component}:{m.model}" for m in get_backend(spec).status().ranks[0].resident}


def prompt_edits(spec: BackendSpec) -> tuple[list[torch.Tensor], list[str], list]:
    """The whole graph once per prompt (what ComfyUI re-runs after a prompt edit): the images, the stages' closing
    texts on their nodes, and the positive conditioning of the last prompt."""
    texts: list[str] = []

    def on_progress(step: int, total: int, text: str | None) -> None:
        if text and step == total:
            texts.append(text)

    transformer = jobs.plan_transformer(spec, model=MODEL, strategy="context_parallel")
    images = []
    for prompt in PROMPTS:
        positive = jobs.encode_prompt(spec, model=MODEL, prompt=prompt, on_progress=on_progress)
        latent = jobs.sample(
            transformer, positive, seed=SEED, steps=STEPS, guidance_scale=3.5, width=SIZE, height=SIZE,
            on_progress=on_progress,
        )  # fmt: skip
        images.append(jobs.decode(spec, model=MODEL, samples=latent, on_progress=on_progress))
    return images, texts, positive


@pytest.fixture(scope="module")
def staged(models_dir):
    spec = spec_of("staged")
    images, _, positive = prompt_edits(spec)
    counts = load_counts(spec)
    shutdown_backend()
    return images, counts, positive


@pytest.mark.multirank
def test_auto_keeps_every_model_across_a_prompt_edit(staged):
    spec = spec_of("auto")
    images, texts, _ = prompt_edits(spec)
    assert resident(spec) == {TRANSFORMER, TEXT_ENCODERS, VAE}
    assert [c.get(TRANSFORMER) for c in load_counts(spec)] == [1, 1]  # staged loaded it once per prompt
    assert load_counts(spec)[0][TEXT_ENCODERS] == 1
    assert [c.get(TRANSFORMER) for c in staged[1]] == [2, 2]
    for mine, theirs in zip(images, staged[0]):
        assert torch.equal(mine, theirs)
    assert not any("freed" in t for t in texts)
    assert texts[-1].startswith("decoded — memory_policy auto: resident: ")
    shutdown_backend()


@pytest.mark.multirank
def test_auto_under_a_memory_cap_frees_the_least_recently_used_and_behaves_as_staged(staged, models_dir, monkeypatch):
    images, counts, positive = staged
    handle = jobs.plan_transformer(spec_of("auto"), model=MODEL, strategy="context_parallel")
    sampling = Sampling(seed=SEED, steps=STEPS, guidance_scale=3.5, width=SIZE, height=SIZE)
    text_tokens = positive.tensors["prompt_embeds"].shape[1]
    folder = str(models_dir / MODEL)
    cap = memory.cap_without_room_for_encoders(handle.family, folder, handle.plan, sampling, text_tokens, torch.float32)
    monkeypatch.setenv(memory.CAP_ENV, cap)
    spec = spec_of("auto")
    mine, texts, _ = prompt_edits(spec)
    # As staged: the encoders and the transformer load once per prompt, on every rank. (The tiny VAE, larger than the
    # tiny text encoders, may go too when they alone do not make room; a real VAE is a few percent of them.)
    for rank, theirs in zip(load_counts(spec), counts):
        assert (rank.get(TRANSFORMER), rank.get(TEXT_ENCODERS)) == (theirs.get(TRANSFORMER), theirs.get(TEXT_ENCODERS))
    for a, b in zip(mine, images):
        assert torch.equal(a, b)
    assert resident(spec) == {TRANSFORMER, VAE}
    encoded = [t for t in texts if t.startswith("encoded")]
    freed = [t.split("freed ")[1].split(" (least recently used) to fit ") for t in texts if t.startswith("denoised")]
    assert f"freed {TRANSFORMER} (least recently used) to fit {TEXT_ENCODERS}" in encoded[1]
    assert all(TEXT_ENCODERS in went and fit.startswith(TRANSFORMER) for went, fit in freed)
    shutdown_backend()


def test_auto_frees_the_least_recently_used_first_and_nothing_it_does_not_need():
    models = ResidentModels(torch.device("cpu"), "auto")

    def use(component: str, width: int) -> None:
        models.get(ModelKey("m", component, "cpu", "float32"), lambda: torch.nn.Linear(width, width, bias=False))

    encoders, vae = 100 * 100 * 4, 10 * 10 * 4
    use("text_encoders", 100)
    use("vae", 10)
    transformer = ModelKey("m", "transformer", "cpu", "float32")
    assert models.to_free(transformer, 0) == []
    assert models.to_free(transformer, vae) == ["text_encoders"]  # the least recently used covers it
    use("text_encoders", 100)  # now the VAE was used longest ago, yet alone it is too small: it stays
    assert models.to_free(transformer, vae + 1) == ["text_encoders"]
    assert sorted(models.to_free(transformer, encoders + 1)) == ["text_encoders", "vae"]
    assert models.to_free(transformer, encoders + vae + 1) == ["vae", "text_encoders"]  # all, when even that is short


@pytest.mark.parametrize("gpus, fits", [(4, True), (2, False)])
def test_device_map_counts_every_gpu_its_weights_spread_over(tmp_path, monkeypatch, gpus, fits):
    """device_map on GPUs spreads the transformer over every GPU (and the host what does not fit them): its memory
    check counts all of them, so a model larger than one GPU is not refused for the first GPU's size, and a model
    larger than them all is, by name. The GPUs' free memory is the only thing set here (this machine has none)."""
    import json

    from parallel_runtime.families import family, tp_plan
    from parallel_runtime.strategy import StrategyPlan, TransformerFacts
    from parallel_runtime.wire import Memory
    from parallel_runtime.worker.ops import WidgetError

    folder = make_tiny_flux(str(tmp_path / MODEL))
    with open(f"{folder}/transformer/config.json") as f:
        config = json.load(f)
    plan = StrategyPlan.from_widgets(TransformerFacts.from_config(config, tp_plan(config["_class_name"])), 1,
                                     strategy="device_map")  # fmt: skip
    sampling = Sampling(seed=SEED, steps=STEPS, guidance_scale=3.5, width=SIZE, height=SIZE)
    args = (family("flux"), folder, plan, sampling, 8, torch.float32, torch.device("cuda", 0))
    common = dict(local_ranks=1, loads_weights=True, freed_by_load=0)
    weights = memory.weight_bytes_in(f"{folder}/transformer", torch.float32, False)
    activations = memory.step_activations(family("flux"), folder, plan, sampling, 8, torch.float32)
    assert activations < weights / 3
    # Each GPU has room for the step and a third of the weights: one is short, two are too, four are not.
    gpu = int((activations + weights / 3) / memory.HEADROOM) + 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (gpu, gpu))
    monkeypatch.setattr(
        memory,
        "memory_of",
        lambda device: Memory(kind=device.type, total_bytes=gpu, free_bytes=gpu if device.type == "cuda" else 0),
    )
    if fits:
        assert memory.check_denoise(*args, **common).weights == weights
        return
    with pytest.raises(WidgetError, match=r"the GPUs and the host's memory .* have"):
        memory.check_denoise(*args, **common)
