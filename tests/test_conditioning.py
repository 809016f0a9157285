"""ParallelSampler's ``positive`` and ``negative`` with ComfyUI's CONDITIONING (``jobs/conditioning.py``): each family's
entries turned into its diffusers inputs, FluxGuidance's guidance over guidance_scale, the negative input over the
encoder's negative prompt; another family's or shape's conditioning refused by name before the backend is asked; and
on 2 CPU ranks (Ulysses), ComfyUI's form of the pack's own embeddings denoises to the same latents as the pack's
Conditioning (the host test, tests/test_comfyui_conditioning.py, runs ComfyUI's own text encoders)."""

from __future__ import annotations

import pytest
import torch
from helpers import MODEL, NEW_FAMILIES, PROMPT, STEPS

from parallel_runtime import InvalidInput, default_spec, jobs
from parallel_runtime.jobs.conditioning import read_positive, with_negative

QWEN = NEW_FAMILIES["qwenimage"]


def spec():
    return default_spec(ranks=2, device="cpu", memory_policy="resident")


def handle(model: str):
    return jobs.plan_transformer(spec(), model=model, strategy="context_parallel", ulysses_degree=2)


def comfy(embeds: torch.Tensor, **extras) -> list:
    """A CONDITIONING as ComfyUI's text-encode nodes make it."""
    return [[embeds, extras]]


def test_comfyuis_conditioning_becomes_the_familys_inputs(models_dir):
    flux, qwen = handle(MODEL), handle(QWEN["model"])
    width, pooled = flux.config["joint_attention_dim"], flux.config["pooled_projection_dim"]
    embeds = torch.randn(1, 6, width)
    read = read_positive(flux, comfy(embeds, pooled_output=torch.ones(1, pooled), guidance=2.5))
    assert set(read.tensors) == {"prompt_embeds", "pooled_prompt_embeds"} and read.guidance == 2.5
    assert torch.equal(read.tensors["prompt_embeds"], embeds) and read.model is None and read.count == 1
    assert "ComfyUI's CONDITIONING (6 tokens" in read.source and "guidance 2.5" in read.source

    # Qwen-Image: ComfyUI drops a mask that masks nothing; the pipeline gets all ones then.
    qwen_width = qwen.config["joint_attention_dim"]
    read = read_positive(qwen, comfy(torch.randn(1, 5, qwen_width), pooled_output=None))
    assert torch.equal(read.tensors["prompt_embeds_mask"], torch.ones(1, 5, dtype=torch.int64))
    negative = torch.randn(1, 3, qwen_width)
    merged, said = with_negative(qwen, read, comfy(negative, attention_mask=torch.tensor([[1, 1, 0]])))
    assert torch.equal(merged.tensors["negative_prompt_embeds"], negative)
    assert merged.tensors["negative_prompt_embeds_mask"].tolist() == [[1, 1, 0]]
    assert said.startswith("negative: ComfyUI's CONDITIONING (3 tokens")
    # FLUX.2: the embeddings alone (Mistral's stacked hidden states); FluxGuidance's guidance as for FLUX.1.
    flux2 = handle(NEW_FAMILIES["flux2"]["model"])
    read = read_positive(flux2, comfy(torch.randn(1, 7, flux2.config["joint_attention_dim"]), guidance=4.0))
    assert set(read.tensors) == {"prompt_embeds"} and read.guidance == 4.0
    # FLUX.1 has no true CFG: a negative is ignored, and said to be.
    flux_read = read_positive(flux, comfy(embeds, pooled_output=torch.ones(1, pooled)))
    assert with_negative(flux, flux_read, comfy(embeds))[1] == "negative: ignored (FLUX.1 has no true CFG)"


@pytest.mark.parametrize(
    "make, hint",
    [
        (lambda w, p: comfy(torch.randn(1, 4, w + 8), pooled_output=torch.ones(1, p)), "holds 40-wide text embeddings"),
        (lambda w, p: comfy(torch.randn(1, 4, w)), "has no pooled_output, but tiny-flux's transformer (FLUX.1)"),
        (lambda w, p: comfy(torch.randn(1, 4, w), pooled_output=torch.ones(1, p + 1)), "pooled_output of shape"),
        (lambda w, p: comfy(torch.randn(1, 4, w), pooled_output=torch.ones(1, p), area=(8, 8, 0, 0)), "carries area"),
        (lambda w, p: comfy(torch.randn(1, 4, w)) * 2, "holds 2 conditionings"),
        (lambda w, p: comfy(torch.full((1, 4, w), float("nan")), pooled_output=torch.ones(1, p)), "NaN"),
        (lambda w, p: comfy(torch.randn(1, 4, w), pooled_output=torch.ones(1, p), guidance="x"), "has a guidance"),
        (lambda w, p: "a cat", "is neither ComfyUI's CONDITIONING"),
    ],
)
def test_a_conditioning_that_does_not_fit_is_refused_by_name(models_dir, make, hint):
    flux = handle(MODEL)
    with pytest.raises(InvalidInput, match="positive") as refused:
        read_positive(flux, make(flux.config["joint_attention_dim"], flux.config["pooled_projection_dim"]))
    assert hint in str(refused.value), refused.value
    if "another model" in str(refused.value):  # the fix names the family's own ComfyUI text encoder
        assert "DualCLIPLoader (type flux) into CLIPTextEncode" in str(refused.value)


def test_true_cfg_without_a_negative_is_refused_before_the_backend(models_dir):
    qwen = handle(QWEN["model"])
    positive = comfy(torch.randn(1, 4, qwen.config["joint_attention_dim"]))
    with pytest.raises(InvalidInput, match=r"negative: true_cfg_scale 4\.0 guides against a negative prompt"):
        jobs.sample(qwen, positive, seed=0, steps=2, guidance_scale=1.0, width=64, height=64, true_cfg_scale=4.0)
    # A FLUX.1 conditioning on Qwen-Image: its pooled output gives it away.
    flux = handle(MODEL)
    pooled = comfy(torch.randn(1, 4, qwen.config["joint_attention_dim"]), pooled_output=torch.ones(1, 3))
    with pytest.raises(InvalidInput, match=r"has a pooled_output .* CLIPLoader \(type qwen_image\)"):
        read_positive(qwen, pooled)
    assert flux.family.pooled_text and not qwen.family.pooled_text


@pytest.mark.slow  # CI's budget: the host test (test_comfyui_conditioning) runs ComfyUI's CONDITIONING on real ranks
@pytest.mark.multirank
def test_comfyuis_form_denoises_as_the_packs_own(models_dir):
    """Qwen-Image (the host test covers FLUX.1 with ComfyUI's own encoders): the pack's encoder's tensors handed in as
    ComfyUI hands a CONDITIONING (the mask dropped where it masks nothing, the negative on its own input) denoise to
    the same latents as the pack's Conditioning, with true CFG: the conversion loses and adds nothing."""
    backend = spec()
    encode = {"max_sequence_length": QWEN["max_sequence_length"], **QWEN["encode"]}
    ours = jobs.encode_prompt(backend, model=QWEN["model"], prompt=PROMPT, **encode)
    transformer = handle(QWEN["model"])
    common = {"seed": 3, "steps": STEPS, "width": 64, "height": 64, "guidance_scale": 1.0, "true_cfg_scale": 4.0}
    expected = jobs.sample(transformer, ours, **common)
    tensors, seen = ours.tensors, []
    assert tensors["prompt_embeds_mask"].all() and tensors["negative_prompt_embeds_mask"].all()
    positive, negative = comfy(tensors["prompt_embeds"]), comfy(tensors["negative_prompt_embeds"])
    got = jobs.sample(transformer, positive, negative=negative, on_conditioning=seen.append, **common)
    print(f"Qwen-Image, ComfyUI's form vs the pack's: max |diff| {(got - expected).abs().max().item():.3g}")
    assert (got - expected).abs().max().item() <= 1e-5
    assert seen == [
        "positive: ComfyUI's CONDITIONING (8 tokens × 32); negative: ComfyUI's CONDITIONING (8 tokens × 32)"
    ]
    # The pack's own negative: the negative input wins over the encoder's negative_prompt, and says so.
    _merged, said = with_negative(transformer, ours, negative)
    assert said.endswith("(instead of EncodeOnBalancedGPUs' negative_prompt)")
