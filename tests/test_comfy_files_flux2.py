"""ComfyUI's FLUX.2 files (``families/flux2/files.py``, ``comfy_files``): the transformer's moves against diffusers'
own converter at FLUX.2-dev's widths, the converted folder bit for bit against the same model's diffusers folder (as
black-forest-labs/FLUX.2-dev lays it out: the whole Mistral3ForConditionalGeneration) in every weight format, the cut
30-layer text encoder giving the whole model's hidden states, refusals that name the input, and tensor parallel and
Ulysses on real CPU ranks from the converted model equal to diffusers' one-shot pipeline on the diffusers folder.

The tiny files come from ``parallel_runtime.families.flux2.tiny.make_tiny_flux2_files`` (the inverse of the key
mapping, the tokenizer as a tekken vocabulary inside the text encoder file, as ComfyUI's).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import comfy_files_listed, component_tensors, converted_and_one_shot, fp8_meaning, generate
from safetensors.torch import load_file, save_file

from parallel_runtime import InvalidInput, comfy_files, default_spec, jobs
from parallel_runtime.families.flux2 import files as flux2_files

PROMPT = "a photo of a horse in the city"
STEPS, TOKENS = 2, 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny FLUX.2-dev as ComfyUI's files (every transformer format) with their reference diffusers folders, listed
    for the module (COMFY_PARALLEL_COMFY_MODELS) and converted below a folder of its own."""
    from parallel_runtime.families.flux2.tiny import make_tiny_flux2_files

    base = tmp_path_factory.mktemp("comfy-files-flux2")
    models = base / "models"
    made = make_tiny_flux2_files(str(models), str(base / "reference"))
    with comfy_files_listed(models, base / "converted"):
        yield base, models, made


def _bfl_at_flux2_width(inner: int = 6144, guidance: bool = True) -> dict[str, torch.Tensor]:
    """A BFL-layout FLUX.2 state dict with FLUX.2-dev's output widths (6144, 48 heads of 128, an 18 432-wide SwiGLU MLP;
    or [klein]'s ``inner``, without the guidance embedding) and narrow inputs: the conversion moves rows, so every row
    count is the real one while the tensors stay small."""
    g = torch.Generator().manual_seed(0)
    mlp, narrow = 3 * inner, 3

    def t(*shape):
        return torch.randn(*shape, generator=g)

    sd = {"img_in.weight": t(inner, 128), "txt_in.weight": t(inner, narrow)}
    for name in ("time_in", "guidance_in") if guidance else ("time_in",):
        sd |= {f"{name}.in_layer.weight": t(inner, 256), f"{name}.out_layer.weight": t(inner, narrow)}
    sd |= {
        "double_stream_modulation_img.lin.weight": t(6 * inner, narrow),
        "double_stream_modulation_txt.lin.weight": t(6 * inner, narrow),
        "single_stream_modulation.lin.weight": t(3 * inner, narrow),
    }
    for i in range(2):
        b = f"double_blocks.{i}"
        for stream in ("img", "txt"):
            sd |= {f"{b}.{stream}_attn.qkv.weight": t(3 * inner, narrow)}
            sd |= {f"{b}.{stream}_attn.norm.query_norm.scale": t(128), f"{b}.{stream}_attn.norm.key_norm.scale": t(128)}
            sd |= {f"{b}.{stream}_attn.proj.weight": t(inner, narrow)}
            sd |= {f"{b}.{stream}_mlp.0.weight": t(2 * mlp, narrow), f"{b}.{stream}_mlp.2.weight": t(inner, narrow)}
    for i in range(2):
        b = f"single_blocks.{i}"
        sd |= {f"{b}.linear1.weight": t(3 * inner + 2 * mlp, narrow), f"{b}.linear2.weight": t(inner, narrow)}
        sd |= {f"{b}.norm.query_norm.scale": t(128), f"{b}.norm.key_norm.scale": t(128)}
    sd |= {"final_layer.linear.weight": t(128, narrow), "final_layer.adaLN_modulation.1.weight": t(2 * inner, narrow)}
    return sd


@pytest.mark.parametrize(
    "inner, guidance, heads",
    [(6144, True, 48), (3072, False, 24), (4096, False, 32)],
    ids=["dev", "klein-4b", "klein-9b"],
)
def test_flux2_moves_match_diffusers_converter(inner, guidance, heads):
    """At FLUX.2-dev's real widths, and FLUX.2 [klein] 4B's and 9B's (no guidance embedding): the same keys and tensors
    as diffusers' own converter, and the keys and row counts of Flux2Transformer2DModel built (on the meta device) from
    the config the shapes give."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    sd = _bfl_at_flux2_width(inner, guidance)
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    config = flux2_files.transformer_config(shapes)
    assert config["guidance_embeds"] == guidance
    assert (config["num_attention_heads"], config["attention_head_dim"], config["mlp_ratio"]) == (heads, 128, 3.0)
    assert (config["timestep_guidance_channels"], config["in_channels"], config["out_channels"]) == (256, 128, 128)
    moves = flux2_files.transformer_moves(config)
    ours = dict(comfy_files.apply_moves(comfy_files.group_moves(moves), iter(sd.items())))
    theirs = convert_flux2_transformer_checkpoint_to_diffusers(dict(sd))
    assert set(ours) == set(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    with torch.device("meta"):
        model = Flux2Transformer2DModel(**{k: v for k, v in config.items() if not k.startswith("_")})
    assert {k: v.shape[0] for k, v in model.state_dict().items()} == {k: v.shape[0] for k, v in ours.items()}


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_scaled"])
def test_flux2_converted_folder_is_the_diffusers_folder(tiny, fmt):
    """The transformer and the VAE bit for bit and in the same dtype as the diffusers folder of the same model (the
    transformer's fp8 weights kept fp8 with their scales: as they mean), their configs the reference's; the text
    encoder's file linked, not copied, beside the one zero layer and the norm; model_index names the pipeline's
    classes."""
    base, _, made = tiny
    names, reference = made[fmt]
    plan = jobs.validate_comfy_files(**names)
    assert (plan.family, plan.variant) == ("flux2", "FLUX.2-dev")
    name, _ = jobs.model_from_comfy_files(**names)
    folder = os.path.join(base, "converted", name)
    for component in ("transformer", "vae"):
        ours, theirs = component_tensors(folder, component), component_tensors(reference, component)
        if component == "transformer":
            assert any(v.dtype == torch.float8_e4m3fn for v in ours.values()) == (fmt != "bf16"), "kept fp8"
            ours = fp8_meaning(ours)
        assert set(ours) == set(theirs), component
        for key, value in theirs.items():
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), f"{component}: {key}"
        with open(os.path.join(folder, component, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(reference, component, "config.json")) as f:
            expected = json.load(f)
        if expected.get("out_channels", 0) is None:  # diffusers' default: as many as in
            expected["out_channels"] = expected["in_channels"]
        assert {k: config[k] for k in config if not k.startswith("_")} == {
            k: expected[k] for k in config if not k.startswith("_")
        }, component
    text = os.path.join(folder, "text_encoder")
    with open(os.path.join(text, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    assert os.path.islink(os.path.join(text, shards[0])) and not os.path.islink(os.path.join(text, shards[1]))
    filled = load_file(os.path.join(text, shards[1]))
    assert all(not v.any() for k, v in filled.items() if k.startswith("model.layers.30."))
    assert torch.equal(filled["model.norm.weight"], torch.ones_like(filled["model.norm.weight"]))
    with open(os.path.join(folder, "model_index.json")) as f:
        index = json.load(f)
    assert index["_class_name"] == "Flux2Pipeline" and index["text_encoder"] == ["transformers", "MistralModel"]


# ComfyUI distributes the cut file; the whole 40 layers (which ComfyUI reads too) under `pytest -m slow`.
@pytest.mark.parametrize(
    "whole", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["cut-30-layers", "whole-40-layers"]
)
def test_flux2_text_encoder_gives_the_whole_models_embeddings(tiny, whole):
    """The converted text encoder and tokenizer (ComfyUI's cut 30 layers and one zero layer, or the whole 40) give
    exactly the prompt embeddings of the whole Mistral3ForConditionalGeneration with its PixtralProcessor: the same
    token ids, left-padded, and hidden states 10, 20 and 30, the 30th unnormalised."""
    from diffusers import Flux2Pipeline

    from parallel_runtime.families.flux2.tiny import WHOLE_MISTRAL

    base, _, made = tiny
    names, reference = made["bf16"]
    if whole:
        names = {**names, "text_encoder": WHOLE_MISTRAL}
    name, plan = jobs.model_from_comfy_files(**names)
    assert plan.configs["text_encoder"]["num_hidden_layers"] == (40 if whole else 31)
    ours = Flux2Pipeline.from_pretrained(os.path.join(base, "converted", name), transformer=None, vae=None)
    theirs = Flux2Pipeline.from_pretrained(reference, transformer=None, vae=None)
    conversation = [[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]]
    ids = [
        torch.as_tensor(p.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True,
                        padding="max_length", max_length=24, truncation=True)["input_ids"]).tolist()
        for p in (ours, theirs)
    ]  # fmt: skip
    assert ids[0] == ids[1] and ids[0][0][0] == 11 and 1 in ids[0][0]  # <pad> first, then <s>: padded on the left
    embeds = [p.encode_prompt(PROMPT, max_sequence_length=TOKENS)[0] for p in (ours, theirs)]
    assert embeds[0].shape == (1, TOKENS, 48) and torch.equal(embeds[0], embeds[1])


def _write(path, tensors, metadata=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, path, metadata=metadata)


def test_flux2_refusals_name_the_input(tiny):
    """Each file that does not fit is refused at validation, naming its widget and what to pick instead."""
    _, models, made = tiny
    names, _ = made["bf16"]
    transformer = load_file(os.path.join(models, "diffusion_models", names["diffusion_model"]))
    text = load_file(os.path.join(models, "text_encoders", names["text_encoder"]))
    klein = {k: v for k, v in transformer.items() if not k.startswith("guidance_in.")}
    _write(str(models / "diffusion_models" / "klein.safetensors"), klein)
    qwen3 = {**text, "model.layers.0.self_attn.q_norm.weight": torch.zeros(128, dtype=torch.bfloat16)}
    _write(str(models / "text_encoders" / "qwen3.safetensors"), qwen3)
    short = {k: v for k, v in text.items() if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= 20)}
    _write(str(models / "text_encoders" / "short.safetensors"), short)
    untokenized = {k: v for k, v in text.items() if k != flux2_files.TEKKEN_KEY}
    _write(str(models / "text_encoders" / "untokenized.safetensors"), untokenized)
    narrow = {k: v[..., :8] if v.ndim == 2 and v.shape[-1] == 16 else v for k, v in text.items()}
    narrow["model.embed_tokens.weight"] = text["model.embed_tokens.weight"][:, :8].contiguous()
    _write(str(models / "text_encoders" / "narrow.safetensors"), {k: v.contiguous() for k, v in narrow.items()})
    bad_tekken = {**text, flux2_files.TEKKEN_KEY: torch.frombuffer(bytearray(b"not json"), dtype=torch.uint8)}
    _write(str(models / "text_encoders" / "bad_tekken.safetensors"), bad_tekken)
    vae = load_file(os.path.join(models, "vae", names["vae"]))
    _write(str(models / "vae" / "no-bn.safetensors"), {k: v for k, v in vae.items() if not k.startswith("bn.")})
    cases = [
        ("text_encoder", "qwen3.safetensors", r"Qwen3 text encoder .* mistral_3_small_flux2_bf16"),
        ("text_encoder", "short.safetensors", r"has 20 layers, but FLUX.2 reads the hidden state after layer 30"),
        ("text_encoder", "untokenized.safetensors", r"does not carry its tokenizer"),
        ("text_encoder", "narrow.safetensors", r"does not fit this transformer"),
        ("text_encoder_2", names["text_encoder"], r"FLUX.2 takes one text encoder, in text_encoder; set "),
        ("text_encoder", "none", r"FLUX.2 takes 1 text encoder \(its files"),
        ("vae", "no-bn.safetensors", r"not FLUX.2's VAE"),
    ]
    for widget, value, message in cases:
        with pytest.raises(InvalidInput, match=message) as e:
            jobs.validate_comfy_files(**{**names, widget: value})
        assert e.value.widget == widget and str(e.value).startswith(f"{widget}: "), (widget, value, e.value)
    # A transformer without the guidance embedding is FLUX.2 [klein]'s (flux2_klein/files.py), which takes Qwen3.
    with pytest.raises(InvalidInput, match=r"is not Qwen3's language model; FLUX.2 \[klein\] takes qwen_3_4b") as e:
        jobs.validate_comfy_files(**{**names, "diffusion_model": "klein.safetensors"})
    assert e.value.widget == "text_encoder"
    # A tokenizer that cannot be read shows at conversion, naming the text encoder; nothing is left behind.
    plan = jobs.validate_comfy_files(**{**names, "text_encoder": "bad_tekken.safetensors"})
    with pytest.raises(InvalidInput, match=r"text_encoder: .* carries no readable tokenizer in 'tekken_model'"):
        comfy_files.convert(plan)
    assert not [p for p in os.listdir(os.path.dirname(plan.folder)) if p.startswith(os.path.basename(plan.folder))]


# -- strategies on real CPU ranks ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tiny):
    """The scaled-fp8 model converted, and diffusers' one-shot pipeline on the converted folder, scales applied."""
    from diffusers import Flux2Pipeline

    return converted_and_one_shot(tiny[2], Flux2Pipeline, guidance_scale=4.0, tokens=TOKENS)


def _generate(spec, model, strategy, **kwargs):
    return generate(spec, strategy, model=model, guidance_scale=4.0, tokens=TOKENS, **kwargs)


@pytest.mark.multirank
def test_flux2_tensor_parallel_and_ulysses_on_the_converted_model(converted):
    """One 2-rank backend: tensor parallel and Ulysses from the converted scaled-fp8 FLUX.2, each image equal to the
    one-shot pipeline on the diffusers folder within test_strategies' tolerances."""
    name, one_shot = converted
    spec = default_spec(ranks=2, device="cpu", memory_policy="staged")
    for strategy, args in (("tensor_parallel", {"tp_degree": 2}), ("context_parallel", {"ulysses_degree": 2})):
        image = _generate(spec, name, strategy, **args)
        assert (image - one_shot(3, 64, 64)).abs().max() <= 1e-4, strategy


MORE_STRATEGIES = [
    ("device_map", "device_map", {}, 1),
    ("ring", "context_parallel", {"ring_degree": 2, "ulysses_degree": 1}, 1),
    ("data_parallel", "data_parallel", {}, 2),
]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("label, strategy, args, batch", MORE_STRATEGIES, ids=[c[0] for c in MORE_STRATEGIES])
def test_flux2_other_strategies_on_the_converted_model(converted, label, strategy, args, batch):
    name, one_shot = converted
    spec = default_spec(ranks=2, device="cpu", memory_policy="staged")
    image = _generate(spec, name, strategy, batch_size=batch, **args)
    assert image.shape[0] == batch
    assert (image - one_shot(3, 64, 64, batch)).abs().max() <= 1e-4


def test_flux2_fp8_text_encoder_stays_fp8_beside_its_zero_layer(tiny):
    """An fp8 Mistral file (as mistral_3_small_flux2_fp8.safetensors): linked as it is (its fp8 weights stay fp8,
    the ranks hold them so), the zero layer and the norm added beside it, the tekken data left out of the index;
    transformers loads it with nothing missing, each weight the file's cast up."""
    from transformers import MistralModel

    base, models, made = tiny
    names, _ = made["bf16"]
    text = load_file(os.path.join(models, "text_encoders", names["text_encoder"]))
    fp8 = {k: v.to(torch.float8_e4m3fn) if v.ndim == 2 else v for k, v in text.items()}
    _write(str(models / "text_encoders" / "mistral_fp8.safetensors"), fp8)
    name, _ = jobs.model_from_comfy_files(**{**names, "text_encoder": "mistral_fp8.safetensors"})
    folder = os.path.join(base, "converted", name, "text_encoder")
    linked = [f for f in os.listdir(folder) if os.path.islink(os.path.join(folder, f))]
    assert len(linked) == 1 and load_file(os.path.join(folder, linked[0]))[
        "model.layers.0.mlp.up_proj.weight"
    ].dtype == (torch.float8_e4m3fn)
    model, info = MistralModel.from_pretrained(folder, dtype=torch.bfloat16, output_loading_info=True)
    # The linked file still carries the tokenizer data, which transformers reads past (it names it, and leaves it).
    assert not info["missing_keys"] and set(info["unexpected_keys"]) <= {flux2_files.TEKKEN_KEY}
    state = model.state_dict()
    for key, value in fp8.items():
        if key != flux2_files.TEKKEN_KEY:
            assert torch.equal(state[key.removeprefix("model.")], value.to(torch.bfloat16)), key
    assert len(model.layers) == 31 and not any(v.any() for v in model.layers[30].state_dict().values())
