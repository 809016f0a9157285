"""ComfyUI's FLUX.2 [klein] files (``families/flux2_klein/files.py``, ``comfy_files``): the converted folder against the
same model's diffusers folder (as black-forest-labs/FLUX.2-klein-4B lays it out: Qwen3ForCausalLM) tensor for tensor
and prompt embedding for prompt embedding, a ``-base-`` file's folder guiding with CFG, refusals that name the input,
and Ulysses and tensor parallel on real CPU ranks from the converted model equal to diffusers' one-shot pipeline on
the diffusers folder (``-m slow``; the transformer's moves against diffusers' converter at [klein]'s widths are in
test_comfy_files_flux2.py).

The tiny files come from ``parallel_runtime.families.flux2_klein.tiny.make_tiny_klein_files`` (FLUX.2's inverse key
mappings, Qwen3 in transformers' names without its head, ComfyUI's own Qwen tokenizer).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers import PROMPT, STEPS, apply_fp8_scales, comfy_files_listed, component_tensors, fp8_meaning, one_shot_images
from safetensors.torch import load_file, save_file

from parallel_runtime import InvalidInput, comfy_files, default_spec, jobs, model_folders, shutdown_backend
from parallel_runtime.families.flux2_klein import files as klein_files

TOKENS = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny [klein] as ComfyUI's files (bf16 and scaled fp8 transformers) with their reference diffusers folders,
    listed for the module (COMFY_PARALLEL_COMFY_MODELS) and converted below a folder of its own."""
    comfy_dir = comfy_files.comfy_package_dir()
    if comfy_dir is None:
        pytest.skip("needs ComfyUI's tokenizers: set COMFYUI_DIR (.ci/install-comfyui.sh makes one)")
    from parallel_runtime.families.flux2_klein.tiny import make_tiny_klein_files

    base = tmp_path_factory.mktemp("comfy-files-klein")
    models = base / "models"
    made = make_tiny_klein_files(str(models), str(base / "reference"), comfy_dir, formats=("bf16", "fp8_scaled"))
    with comfy_files_listed(models, base / "converted"):
        yield base, models, made


@pytest.mark.parametrize("fmt", ["bf16", "fp8_scaled"])
def test_klein_converted_folder_is_the_diffusers_folder(tiny, fmt):
    """The transformer and the VAE bit for bit as the diffusers folder (fp8 as it means), the text encoder's file
    linked, model_index naming Flux2KleinPipeline with a Qwen3Model, distilled (the file's name has no -base-)."""
    base, _, made = tiny
    names, reference = made[fmt]
    plan = jobs.validate_comfy_files(**names)
    assert (plan.family, plan.variant) == ("flux2_klein", "FLUX.2 [klein]")
    name, _ = jobs.model_from_comfy_files(**names)
    folder = os.path.join(base, "converted", name)
    for component in ("transformer", "vae"):
        ours, theirs = component_tensors(folder, component), component_tensors(reference, component)
        if component == "transformer":
            ours = fp8_meaning(ours)
        assert set(ours) == set(theirs), component
        for key, value in theirs.items():
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), f"{component}: {key}"
    assert os.path.islink(os.path.join(folder, "text_encoder", "model.safetensors"))
    with open(os.path.join(folder, "tokenizer", "tokenizer_config.json")) as f:
        assert json.load(f)["chat_template"] == klein_files.CHAT_TEMPLATE  # Qwen3's, over ComfyUI's Qwen2.5 one
    with open(os.path.join(folder, "model_index.json")) as f:
        index = json.load(f)
    assert index["_class_name"] == "Flux2KleinPipeline" and index["is_distilled"] is True
    assert index["text_encoder"] == ["transformers", "Qwen3Model"]
    assert model_folders.resolve(name).family == "flux2_klein"


@pytest.mark.slow  # loading ComfyUI's 151k-token tokenizer twice; the converted folder's test reads its template
def test_klein_text_encoder_gives_the_published_models_embeddings(tiny):
    """The converted Qwen3Model with ComfyUI's tokenizer and Qwen3's chat template gives exactly the prompt embeddings
    of the diffusers folder's Qwen3ForCausalLM (hidden states 9, 18 and 27), for the prompt and for an empty one."""
    from diffusers import Flux2KleinPipeline

    _, _, made = tiny
    names, reference = made["bf16"]
    name, _ = jobs.model_from_comfy_files(**names)
    ours = Flux2KleinPipeline.from_pretrained(model_folders.resolve(name).path, transformer=None, vae=None)
    theirs = Flux2KleinPipeline.from_pretrained(reference, transformer=None, vae=None)
    for prompt in (PROMPT, ""):
        embeds = [p.encode_prompt(prompt, max_sequence_length=TOKENS)[0] for p in (ours, theirs)]
        assert embeds[0].shape == (1, TOKENS, 48) and torch.equal(embeds[0], embeds[1])


def test_klein_base_file_is_told_by_its_name(tiny):
    """The same weights under a ``-base-`` name: the base model, whose folder guides with CFG (is_distilled off)."""
    base, models, made = tiny
    names, _ = made["bf16"]
    renamed = "tiny-flux-2-klein-base-4b.safetensors"
    shutil.copyfile(models / "diffusion_models" / names["diffusion_model"], models / "diffusion_models" / renamed)
    plan = jobs.validate_comfy_files(**{**names, "diffusion_model": renamed})
    assert plan.variant == "FLUX.2 [klein] base"
    name, _ = jobs.model_from_comfy_files(**{**names, "diffusion_model": renamed})
    with open(os.path.join(base, "converted", name, "model_index.json")) as f:
        assert json.load(f)["is_distilled"] is False


def _write(path, tensors):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def test_klein_refusals_name_the_input(tiny):
    """Each file that does not fit is refused at validation, naming its widget and what to pick instead."""
    _, models, made = tiny
    names, _ = made["bf16"]
    text = load_file(os.path.join(models, "text_encoders", names["text_encoder"]))
    short = {k: v for k, v in text.items() if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= 27)}
    _write(str(models / "text_encoders" / "short_qwen3.safetensors"), short)
    narrow = {k: v[..., :8] if v.ndim == 2 and v.shape[-1] == 16 else v for k, v in text.items()}
    narrow["model.embed_tokens.weight"] = text["model.embed_tokens.weight"][:, :8]
    _write(str(models / "text_encoders" / "narrow_qwen3.safetensors"), narrow)
    vae = load_file(os.path.join(models, "vae", names["vae"]))
    _write(str(models / "vae" / "no-bn.safetensors"), {k: v for k, v in vae.items() if not k.startswith("bn.")})
    cases = [
        ("text_encoder", "short_qwen3.safetensors", r"has 27 layers, but FLUX.2 \[klein\] reads the hidden state"),
        (
            "text_encoder",
            "narrow_qwen3.safetensors",
            r"does not fit this transformer .* the Qwen3 of FLUX.2 \[klein\] .*for 9B",
        ),
        ("text_encoder_2", names["text_encoder"], r"FLUX.2 \[klein\] takes one text encoder, in text_encoder"),
        ("vae", "no-bn.safetensors", r"not FLUX.2's VAE"),
    ]
    for widget, value, message in cases:
        with pytest.raises(InvalidInput, match=message) as e:
            jobs.validate_comfy_files(**{**names, widget: value})
        assert e.value.widget == widget and str(e.value).startswith(f"{widget}: "), (widget, value, e.value)


# -- strategies on real CPU ranks (slow: test_flux2_klein.py runs [klein] under Ulysses by default) --------------------
@pytest.mark.slow
@pytest.mark.multirank
def test_klein_ulysses_and_tensor_parallel_on_the_converted_model(tiny):
    """One 2-rank backend: Ulysses and tensor parallel from the converted scaled-fp8 [klein], each image equal to the
    one-shot pipeline on the diffusers folder."""
    from diffusers import Flux2KleinPipeline

    names, _ = tiny[2]["fp8_scaled"]
    name, _ = jobs.model_from_comfy_files(**names)
    folder = model_folders.resolve(name).path
    pipe = Flux2KleinPipeline.from_pretrained(folder, dtype=torch.float32)
    apply_fp8_scales(pipe.transformer, folder)
    one_shot = one_shot_images(pipe, max_sequence_length=TOKENS)
    spec = default_spec(ranks=2, device="cpu", memory_policy="staged")
    try:
        positive = jobs.encode_prompt(spec, model=name, prompt=PROMPT, max_sequence_length=TOKENS)
        for strategy, args in (("context_parallel", {"ulysses_degree": 2}), ("tensor_parallel", {"tp_degree": 2})):
            transformer = jobs.plan_transformer(spec, model=name, strategy=strategy, **args)
            latent = jobs.sample(
                transformer, positive, seed=3, steps=STEPS, guidance_scale=1.0, true_cfg_scale=1.0, width=64, height=64
            )
            image = jobs.decode(spec, model=name, samples=latent)
            assert (image - one_shot(3, 64, 64)).abs().max() <= 1e-4, strategy
    finally:
        shutdown_backend()
