"""ComfyUI's Wan files (``families/wan/files.py``, ``comfy_files``): the inverse layout (``families/wan/comfy_tiny.py``)
against diffusers' own converter and the conversion's moves against the same converter, the converted folder bit for
bit against the diffusers folder of the same model in every weight format, the tokenizer made from the file's
SentencePiece model giving ComfyUI's token ids, ``WanPipeline`` on the converted folder equal to the diffusers folder's
(Wan 2.1, Wan 2.2 A14B's two experts from two files, Wan 2.2 TI2V-5B with Wan 2.2's VAE, whose layout is checked
against ComfyUI's own module), Wan 2.1 I2V with its CLIP vision file in either layout ComfyUI reads (checked against
ComfyUI's own reading of it, in a process of its own: tests/_comfy_clip_vision_check.py), and refusals that name the
input.

The tiny files come from ``parallel_runtime.families.wan.comfy_tiny.make_tiny_wan_files``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import apply_fp8_scales, fp8_meaning
from safetensors.torch import load_file, save_file

from parallel_runtime import InvalidInput, jobs
from parallel_runtime.comfy_files import apply_moves, group_moves
from parallel_runtime.families.wan import files as wan_files

PROMPT = "a photo of a cat on a red house"
POSITION_IDS = "vision_model.embeddings.position_ids"


def _environment(models, converted):
    saved = {k: os.environ.get(k) for k in ("COMFY_PARALLEL_COMFY_MODELS", "COMFY_PARALLEL_CONVERTED")}
    os.environ["COMFY_PARALLEL_COMFY_MODELS"] = str(models)
    os.environ["COMFY_PARALLEL_CONVERTED"] = str(converted)
    return saved


def _restore(saved):
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Wan 2.1 T2V (every transformer format) and a tiny Wan 2.2 A14B T2V (two experts) as ComfyUI's files in
    one models folder, with their reference diffusers folders, listed for the module and converted below a folder of
    its own."""
    from parallel_runtime.families.wan.comfy_tiny import make_tiny_wan_files

    base = tmp_path_factory.mktemp("comfy-files-wan")
    models = base / "models"
    made = make_tiny_wan_files(str(models), str(base / "reference"))
    experts = make_tiny_wan_files(str(models), str(base / "reference"), seed=1, formats=("bf16",), experts=True)
    saved = _environment(models, base / "converted")
    yield base, models, made, experts["bf16"]
    _restore(saved)


@pytest.fixture(scope="module")
def tiny_i2v(tiny):
    """A tiny Wan 2.1 I2V as ComfyUI's files beside the module's others (its CLIP vision file in transformers' names,
    as clip_vision_h; and again in open_clip's), with its reference diffusers folder."""
    from parallel_runtime.families.wan.comfy_tiny import make_tiny_wan_files, open_clip_vision

    base, models, _, _ = tiny
    names, reference = make_tiny_wan_files(str(models), str(base / "reference"), seed=3, formats=("bf16",), i2v=True)[
        "bf16"
    ]
    source = load_file(os.path.join(models, "clip_vision", names["clip_vision"]))
    open_clip = _write(models, "clip_vision", "tiny_open_clip_vit_h.safetensors", open_clip_vision(source))
    return names, reference, open_clip


def _transformer_sd(image: bool) -> dict[str, torch.Tensor]:
    from parallel_runtime.families.wan.comfy_tiny import _transformer

    torch.manual_seed(0)
    model = _transformer(wan_files.T2V_CHANNELS)
    if image:  # Wan 2.1 I2V's image embedding and added key / value projections (refused for conversion, but mapped)
        from diffusers import WanTransformer3DModel

        config = {k: v for k, v in model.config.items() if not k.startswith("_")}
        model = WanTransformer3DModel(**{**config, "image_dim": 24, "added_kv_proj_dim": 256})
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("image", [False, True], ids=["t2v", "with-image-embedding"])
def test_wan_layout_against_diffusers_converter(image):
    """diffusers' ``convert_wan_transformer_to_diffusers`` undoes the inverse layout exactly (also behind ComfyUI's
    prefix), and the conversion's moves, from the config the shapes give, make the same tensors as that converter."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from parallel_runtime.families.wan.comfy_tiny import comfy_transformer

    sd = _transformer_sd(image)
    original = comfy_transformer(sd)
    prefixed = {f"model.diffusion_model.{k}": v for k, v in original.items()}
    for checkpoint in (dict(original), prefixed):
        theirs = convert_wan_transformer_to_diffusers(checkpoint)
        assert set(theirs) == set(sd)
        assert all(torch.equal(theirs[k], sd[k]) for k in sd)
    config = wan_files.transformer_config({k: tuple(v.shape) for k, v in original.items()})
    assert (config["num_attention_heads"], config["image_dim"]) == (2, 24 if image else None)
    moves = wan_files.transformer_moves(config)
    assert {m.source for m in moves} == set(original)
    ours = dict(apply_moves(group_moves(moves), iter(original.items())))
    assert set(ours) == set(sd) and all(torch.equal(ours[k], sd[k]) for k in sd)


def test_wan_vae_layout_against_diffusers_converter():
    """The VAE's inverse (Qwen-Image's, the same Wan 2.1 VAE) undone by diffusers' converter into AutoencoderKLWan."""
    from diffusers import AutoencoderKLWan

    from parallel_runtime.families.qwenimage.files import wan_vae_to_diffusers
    from parallel_runtime.families.qwenimage.tiny import wan_vae

    torch.manual_seed(0)
    sd = AutoencoderKLWan(base_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=2).state_dict()
    theirs = wan_vae_to_diffusers(wan_vae(sd))
    assert set(theirs) == set(sd) and all(torch.equal(theirs[k], sd[k]) for k in sd)


def _tensors(folder, component):
    sub = os.path.join(folder, component)
    out = {}
    for f in sorted(f for f in os.listdir(sub) if f.endswith(".safetensors")):
        out |= load_file(os.path.join(sub, f))
    return out


def _same_experts(folder, reference):
    for component in ("transformer", "transformer_2"):
        ours, theirs = _tensors(folder, component), _tensors(reference, component)
        assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs), component


def _config(folder, component):
    with open(os.path.join(folder, component, "config.json")) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_scaled"])
def test_wan_converted_folder_is_the_diffusers_folder(tiny, fmt):
    """The transformer and the VAE bit for bit and in the same dtype as the diffusers folder of the same model (the
    transformer's fp8 kept with its scales, meaning the reference's weights; ComfyUI's prefix dropped), their configs
    the reference's; the text encoder's file linked, not copied; the tokenizer from the file's SentencePiece model
    giving ComfyUI's token ids."""
    import sentencepiece
    from transformers import AutoTokenizer

    from parallel_runtime.families.wan.comfy_tiny import tiny_spiece_model

    base, _, made, _ = tiny
    names, reference = made[fmt]
    plan = jobs.validate_comfy_files(**names)
    assert (plan.family, plan.variant, plan.transformer_2) == ("wan", "Wan 2.1 T2V (2 layers, 256 wide)", None)
    name, _ = jobs.model_from_comfy_files(**names)
    folder = os.path.join(base, "converted", name)
    for component in ("transformer", "vae"):
        ours, theirs = _tensors(folder, component), _tensors(reference, component)
        if component == "transformer":  # fp8 stays fp8 (its scales beside): compared as what it means
            ours = fp8_meaning(ours)
            assert set(ours) == set(theirs), component
        for key, value in theirs.items():
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), f"{component}: {key}"
        config, expected = _config(folder, component), _config(reference, component)
        assert {k: config[k] for k in config} == {k: expected[k] for k in config}, component
    assert os.path.islink(os.path.join(folder, "text_encoder", "model.safetensors"))
    assert _config(folder, "text_encoder")["model_type"] == "umt5"
    with open(os.path.join(folder, "model_index.json")) as f:
        index = json.load(f)
    assert (index["_class_name"], index["boundary_ratio"]) == ("WanPipeline", None)
    comfy = sentencepiece.SentencePieceProcessor(model_proto=tiny_spiece_model(), add_eos=True)  # ComfyUI's tokenizer
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer"))
    for text in (PROMPT, "zebra über naïve  words", ""):
        assert tokenizer(text)["input_ids"] == comfy.encode(text)
    assert tokenizer.model_max_length == wan_files.MAX_SEQUENCE_LENGTH


def test_wan_scaled_fp8_text_encoder_keeps_fp8(tiny):
    """ComfyUI's umt5_xxl_fp8_e4m3fn_scaled layout (fp8 matrices, a ``scale_weight`` each, the ``scaled_fp8`` marker,
    the SentencePiece model beside them): the converted text encoder is rewritten (not linked), its fp8 weights kept
    fp8 with their scales beside them (meaning weight × scale), without ComfyUI's bookkeeping or the tokenizer data,
    and the tokenizer is still made from the file."""
    from parallel_runtime.families.tiny import quantized

    base, models, made, _ = tiny
    names, _ = made["bf16"]
    source = load_file(os.path.join(models, "text_encoders", names["text_encoder"]))
    spiece = source.pop(wan_files.SPIECE_KEY)
    stored, expected = quantized(source, "fp8_scaled", {k: [k] for k in source}, dict)
    fp8 = _write(models, "text_encoders", "tiny_umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                 {**stored, wan_files.SPIECE_KEY: spiece})  # fmt: skip
    assert stored["encoder.block.0.layer.0.SelfAttention.q.weight"].dtype == torch.float8_e4m3fn
    name, _ = jobs.model_from_comfy_files(**{**names, "text_encoder": fp8})
    folder = os.path.join(base, "converted", name)
    written = os.path.join(folder, "text_encoder", "model.safetensors")
    assert not os.path.islink(written)
    ours = load_file(written)
    assert ours["encoder.block.0.layer.0.SelfAttention.q.weight"].dtype == torch.float8_e4m3fn
    ours = fp8_meaning(ours)
    assert set(ours) == set(expected)
    assert all(ours[k].dtype == v.dtype and torch.equal(ours[k], v) for k, v in expected.items())
    assert os.path.isfile(os.path.join(folder, "tokenizer", "spiece.model"))


def _video(folder, pipeline, steps, **kwargs):
    pipe = pipeline.from_pretrained(folder, dtype=torch.float32)
    # A converted folder keeps scaled fp8 (diffusers leaves the scales); the reference holds what it means in bf16,
    # the tiny files' other dtype: each weight through bf16, which leaves the reference's own weights as they are.
    apply_fp8_scales(pipe.transformer, folder)
    with torch.no_grad():
        for parameter in pipe.transformer.parameters():
            parameter.copy_(parameter.to(torch.bfloat16))
    pipe.set_progress_bar_config(disable=True)
    return _run(pipe, steps, **kwargs), pipe


def _run(pipe, steps, **kwargs):
    frames = pipe(
        prompt=PROMPT,
        negative_prompt="blurry",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=steps,
        guidance_scale=4.0,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        **kwargs,
    ).frames
    return torch.as_tensor(frames)


def test_wan21_converted_runs_as_the_diffusers_folder(tiny):
    """WanPipeline on the folder converted from the scaled-fp8 files equals it on the diffusers folder of the same
    weights (text encoder, tokenizer, transformer, VAE, scheduler all from the conversion)."""
    from diffusers import WanPipeline

    base, _, made, _ = tiny
    names, reference = made["fp8_scaled"]
    name, _ = jobs.model_from_comfy_files(**names)
    ours, _ = _video(os.path.join(base, "converted", name), WanPipeline, 2)
    theirs, _ = _video(reference, WanPipeline, 2)
    assert ours.shape == (1, 5, 32, 32, 3)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)


def test_wan22_experts_convert_and_run_as_the_diffusers_folder(tiny):
    """Wan 2.2 A14B from its two files (the high-noise expert in diffusion_model, the low-noise one in
    diffusion_model_2): both experts bit for bit, the boundary and flow shift Wan's, and WanPipeline's video equal to
    the diffusers folder's over steps on both sides of the boundary (the low-noise expert changes it)."""
    from diffusers import WanPipeline

    base, _, _, (names, reference) = tiny
    plan = jobs.validate_comfy_files(**names)
    assert (plan.variant, plan.transformer_2.widget) == ("Wan 2.2 A14B T2V", "diffusion_model_2")
    name, _ = jobs.model_from_comfy_files(**names)
    folder = os.path.join(base, "converted", name)
    _same_experts(folder, reference)
    with open(os.path.join(folder, "model_index.json")) as f:
        assert json.load(f)["boundary_ratio"] == wan_files.WAN22_T2V_BOUNDARY
    ours, pipe = _video(folder, WanPipeline, 4, guidance_scale_2=3.0)
    theirs, _ = _video(reference, WanPipeline, 4, guidance_scale_2=3.0)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)
    pipe.scheduler.set_timesteps(4)
    boundary = wan_files.WAN22_T2V_BOUNDARY * pipe.scheduler.config.num_train_timesteps
    assert any(t < boundary for t in pipe.scheduler.timesteps) and any(t >= boundary for t in pipe.scheduler.timesteps)
    # The high-noise expert on every step makes another video: the converted low-noise expert ran.
    pipe.transformer_2 = pipe.transformer
    one_expert = _run(pipe, 4, guidance_scale_2=3.0)
    assert not torch.allclose(ours, one_expert, atol=1e-3)


def _write(models, folder, name, tensors):
    os.makedirs(os.path.join(models, folder), exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(models, folder, name))
    return name


def _refused(names, widget, *words):
    with pytest.raises(InvalidInput) as e:
        jobs.validate_comfy_files(**names)
    assert e.value.widget == widget, str(e.value)
    for word in words:
        assert word in str(e.value), str(e.value)


def test_wan_refusals_name_the_input(tiny):
    """Each file that does not fit is refused at validation, naming its widget and what to pick instead: an expert
    without its pair, the experts swapped, Wan 2.2 I2V's high-noise expert alone, a second expert of another size or
    not Wan's, a second transformer for a family of one, files cut short, T5 for UMT5, a text encoder without its
    tokenizer, Wan 2.2's VAE beside another transformer than TI2V-5B's (and TI2V-5B's beside Wan 2.1's VAE), and the
    Wan models this pack does not convert."""
    _, models, made, (expert_names, _) = tiny
    names, _ = made["bf16"]
    transformer = load_file(os.path.join(models, "diffusion_models", names["diffusion_model"]))
    text = load_file(os.path.join(models, "text_encoders", names["text_encoder"]))

    lone = {**expert_names, "diffusion_model_2": "none"}
    _refused(lone, "diffusion_model_2", "two experts", "low_noise")
    swapped = {
        **expert_names,
        "diffusion_model": expert_names["diffusion_model_2"],
        "diffusion_model_2": expert_names["diffusion_model"],
    }
    _refused(swapped, "diffusion_model", "wrong way round")
    i2v = {**transformer, "patch_embedding.weight": torch.zeros(256, 36, 1, 2, 2, dtype=torch.bfloat16)}
    _refused({**names, "diffusion_model": _write(models, "diffusion_models", "i2v.safetensors", i2v)},
             "diffusion_model_2", "two experts")  # fmt: skip
    _refused({**expert_names, "diffusion_model_2": "i2v.safetensors"}, "diffusion_model_2", "not the same model")
    vae = load_file(os.path.join(models, "vae", names["vae"]))
    not_wan = _write(models, "diffusion_models", "not_wan.safetensors", vae)
    _refused({**expert_names, "diffusion_model_2": not_wan}, "diffusion_model_2", "not a Wan transformer")
    # A family of one transformer (Qwen-Image's keys) is refused a second before its files are read further.
    qwen = {"txt_norm.weight": torch.zeros(4), "transformer_blocks.0.img_mod.1.weight": torch.zeros(4, 4)}
    qwen_names = {**expert_names, "diffusion_model": _write(models, "diffusion_models", "qwen.safetensors", qwen)}
    _refused(qwen_names, "diffusion_model_2", "Qwen-Image takes one transformer", "none")
    short = {k: v for k, v in transformer.items() if not k.startswith("blocks.1.ffn.")}
    _refused({**names, "diffusion_model": _write(models, "diffusion_models", "short.safetensors", short)},
             "diffusion_model", "lacks blocks.1.ffn.0.bias")  # fmt: skip
    path = os.path.join(models, "diffusion_models", "truncated.safetensors")
    with open(os.path.join(models, "diffusion_models", names["diffusion_model"]), "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) - 100])
    _refused({**names, "diffusion_model": "truncated.safetensors"}, "diffusion_model", "not a readable safetensors")

    t5 = {k: v for k, v in text.items() if "relative_attention_bias" not in k or ".block.0." in k}
    _refused({**names, "text_encoder": _write(models, "text_encoders", "t5.safetensors", t5)},
             "text_encoder", "T5-XXL", "umt5_xxl")  # fmt: skip
    untokenized = {k: v for k, v in text.items() if k != wan_files.SPIECE_KEY}
    _refused({**names, "text_encoder": _write(models, "text_encoders", "untokenized.safetensors", untokenized)},
             "text_encoder", "tokenizer")  # fmt: skip
    wan22 = {**vae, "decoder.upsamples.0.upsamples.0.residual.2.weight": torch.zeros(1)}
    _refused({**names, "vae": _write(models, "vae", "wan22_vae.safetensors", wan22)}, "vae", "48-channel")

    for key, model in wan_files.OTHER_MODELS[:2]:
        other = {**transformer, key: torch.zeros(1, dtype=torch.bfloat16)}
        _refused({**names, "diffusion_model": _write(models, "diffusion_models", "other.safetensors", other)},
                 "diffusion_model", model)  # fmt: skip
    ti2v = {**transformer, "patch_embedding.weight": torch.zeros(256, 48, 1, 2, 2, dtype=torch.bfloat16)}
    _refused({**names, "diffusion_model": _write(models, "diffusion_models", "ti2v.safetensors", ti2v)},
             "vae", "TI2V-5B", "wan2.2_vae.safetensors")  # fmt: skip
    odd = {**transformer, "patch_embedding.weight": torch.zeros(256, 20, 1, 2, 2, dtype=torch.bfloat16)}
    _refused({**names, "diffusion_model": _write(models, "diffusion_models", "odd.safetensors", odd)},
             "diffusion_model", "20 latent channels")  # fmt: skip


@pytest.mark.slow  # a second pipeline of two experts; Wan 2.2 A14B T2V's runs by default
def test_wan22_i2v_experts_convert_and_run_as_the_diffusers_folder(tiny):
    """Wan 2.2 A14B I2V from its two files: WanImageToVideoPipeline without an image encoder (the start image enters
    through its latents), which the pack's Wan I2V runs, both experts bit for bit, its boundary, and the video from a
    start image equal to the diffusers folder's."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from parallel_runtime import model_folders
    from parallel_runtime.families.wan.comfy_tiny import make_tiny_wan_files

    base, models, _, _ = tiny
    made = make_tiny_wan_files(str(models), str(base / "reference"), seed=2, formats=("bf16",), experts=True, i2v=True)
    names, reference = made["bf16"]
    name, plan = jobs.model_from_comfy_files(**names)
    assert plan.variant == "Wan 2.2 A14B I2V"
    assert model_folders.resolve(name).family == "wan_i2v"
    folder = os.path.join(base, "converted", name)
    _same_experts(folder, reference)
    with open(os.path.join(folder, "model_index.json")) as f:
        index = json.load(f)
    assert (index["_class_name"], index["boundary_ratio"]) == ("WanImageToVideoPipeline", wan_files.WAN22_I2V_BOUNDARY)
    image = Image.fromarray((torch.arange(32 * 32 * 3) % 251).reshape(32, 32, 3).to(torch.uint8).numpy())
    ours, _ = _video(folder, WanImageToVideoPipeline, 2, image=image)
    theirs, _ = _video(reference, WanImageToVideoPipeline, 2, image=image)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)


def test_clip_vision_layouts_read_as_comfyui_reads_them(tiny, tiny_i2v, comfyui_dir):
    """The open_clip inverse undone exactly by the conversion (tensors and the shapes the config is read from), and
    ComfyUI's own reading of both tiny files (``comfy/clip_vision.py`` in a process of its own, on the tiny config)
    taking every tensor and giving the penultimate hidden states the converted folder's encoder gives, from the same
    pixels (an image at the encoder's size: ComfyUI's preprocessing and the folder's processor resize alike there)."""
    from PIL import Image
    from safetensors import safe_open
    from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection

    from parallel_runtime.families.wan.comfy_tiny import open_clip_vision

    base, models, _, _ = tiny
    names, _, open_clip = tiny_i2v
    files = [os.path.join(models, "clip_vision", name) for name in (names["clip_vision"], open_clip)]
    sd = load_file(files[0])
    ours = wan_files.open_clip_to_transformers(open_clip_vision(sd))
    assert set(ours) == set(sd) and all(torch.equal(ours[k], sd[k]) for k in sd)
    shapes = {k: tuple(v.shape) for k, v in open_clip_vision(sd).items()}
    assert wan_files.clip_vision_shapes(shapes) == {k: tuple(v.shape) for k, v in sd.items()}

    name, _ = jobs.model_from_comfy_files(**names)
    folder = os.path.join(base, "converted", name)
    with open(os.path.join(comfyui_dir, "comfy", "clip_vision_config_h.json")) as f:
        config = json.load(f)  # ComfyUI's ViT-H config at the tiny sizes
    tiny_config = _config(folder, "image_encoder")
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "image_size", "patch_size", "projection_dim")
    config |= {k: tiny_config[k] for k in sizes}
    side = config["image_size"]
    pixels = (torch.arange(side * side * 3).reshape(1, side, side, 3) * 7 % 251).to(torch.uint8)
    scratch = base / "clip-vision-check"
    scratch.mkdir(exist_ok=True)
    with open(scratch / "config.json", "w") as f:
        json.dump(config, f)
    save_file({"image": pixels.float() / 255.0}, str(scratch / "image.safetensors"))
    check = os.path.join(os.path.dirname(__file__), "_comfy_clip_vision_check.py")
    out = str(scratch / "out.safetensors")
    args = [comfyui_dir, str(scratch / "config.json"), str(scratch / "image.safetensors"), out, *files]
    subprocess.run([sys.executable, check, *args], check=True, timeout=600)
    comfy = load_file(out)
    with safe_open(out, framework="pt") as f:
        metadata = f.metadata()

    processor = CLIPImageProcessor.from_pretrained(os.path.join(folder, "image_processor"))
    values = processor(images=Image.fromarray(pixels[0].numpy()), return_tensors="pt").pixel_values
    assert (values - comfy["pixel_values"]).abs().max().item() <= 1e-6
    encoder = CLIPVisionModelWithProjection.from_pretrained(os.path.join(folder, "image_encoder"), dtype=torch.float32)
    with torch.no_grad():
        expected = encoder(pixel_values=values, output_hidden_states=True).hidden_states[-2]
    for i in range(len(files)):
        assert json.loads(metadata[f"missing.{i}"]) == json.loads(metadata[f"unexpected.{i}"]) == [], files[i]
        hidden = comfy[f"penultimate_hidden_states.{i}"]
        assert hidden.shape == expected.shape and (hidden - expected).abs().max().item() <= 1e-5, files[i]


def test_clip_vision_config_is_comfyuis_vit_h(comfyui_dir):
    """What the config takes from outside the weights (heads, activation, epsilon), and the image size it reads from
    them, are ComfyUI's ViT-H config's, read from the shapes of a full-size ViT-H (built on the meta device)."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    with open(os.path.join(comfyui_dir, "comfy", "clip_vision_config_h.json")) as f:
        vit_h = json.load(f)
    with torch.device("meta"):
        model = CLIPVisionModelWithProjection(CLIPVisionConfig(**vit_h))
    config = wan_files.clip_vision_config({k: tuple(v.shape) for k, v in model.state_dict().items()})
    assert {k: config[k] for k in vit_h if k in config} == {k: v for k, v in vit_h.items() if k in config}
    # Not written, and only training reads them (transformers' defaults otherwise); ComfyUI's dtype is its own choice.
    assert set(vit_h) - set(config) == {
        "attention_dropout",
        "dropout",
        "initializer_factor",
        "initializer_range",
        "torch_dtype",
    }


def test_wan21_i2v_converts_and_runs_as_the_diffusers_folder(tiny, tiny_i2v):
    """Wan 2.1 I2V from its four files: a WanImageToVideoPipeline folder the pack's Wan I2V runs, its image encoder
    bit for bit the reference's from either layout of the CLIP vision file (transformers' linked, also with the int64
    ``position_ids`` older transformers saved; open_clip's converted: each its own cached folder), its config and image
    processor the reference's, and the video from a start image equal to the diffusers folder's."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image
    from transformers import CLIPVisionModelWithProjection

    from parallel_runtime import model_folders

    base, models, _, _ = tiny
    names, reference, open_clip = tiny_i2v
    clip = load_file(os.path.join(models, "clip_vision", names["clip_vision"]))
    positions = torch.arange(clip["vision_model.embeddings.position_embedding.weight"].shape[0]).unsqueeze(0)
    old = _write(models, "clip_vision", "old_clip_vision.safetensors", {**clip, POSITION_IDS: positions})
    folders = []
    for clip_vision in (names["clip_vision"], open_clip, old):
        name, plan = jobs.model_from_comfy_files(**{**names, "clip_vision": clip_vision})
        assert (plan.variant, model_folders.resolve(name).family) == ("Wan 2.1 I2V (2 layers, 256 wide)", "wan_i2v")
        folder = os.path.join(base, "converted", name)
        ours, theirs = _tensors(folder, "image_encoder"), _tensors(reference, "image_encoder")
        assert set(ours) - set(theirs) == ({POSITION_IDS} if clip_vision == old else set())
        assert all(ours[k].dtype == v.dtype and torch.equal(ours[k], v) for k, v in theirs.items())
        config, expected = _config(folder, "image_encoder"), _config(reference, "image_encoder")
        assert config == {k: expected[k] for k in config}
        with open(os.path.join(folder, "image_processor", "preprocessor_config.json")) as f:
            processor = json.load(f)
        with open(os.path.join(reference, "image_processor", "preprocessor_config.json")) as f:
            assert processor == json.load(f)
        with open(os.path.join(folder, "model_index.json")) as f:
            index = json.load(f)
        assert index["image_encoder"] == ["transformers", "CLIPVisionModelWithProjection"]
        folders.append(folder)
    # transformers takes the old file's index as its own (a buffer it makes), and loads every weight.
    encoder = CLIPVisionModelWithProjection.from_pretrained(os.path.join(folders[2], "image_encoder"))
    assert all(torch.equal(encoder.state_dict()[k], v) for k, v in _tensors(reference, "image_encoder").items())
    linked = os.path.join(folders[0], "image_encoder", "model.safetensors")
    assert os.path.islink(linked) and not os.path.islink(os.path.join(folders[1], "image_encoder", "model.safetensors"))
    image = Image.fromarray((torch.arange(40 * 56 * 3) % 251).reshape(40, 56, 3).to(torch.uint8).numpy())
    ours, _ = _video(folders[0], WanImageToVideoPipeline, 2, image=image)
    theirs, _ = _video(reference, WanImageToVideoPipeline, 2, image=image)
    assert ours.shape == (1, 5, 32, 32, 3)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0)


def test_wan21_i2v_refusals_name_the_input(tiny, tiny_i2v):
    """The CLIP vision file where it belongs only, before anything is converted: Wan 2.1 I2V without one, with a
    second transformer, with a file that is no CLIP vision model or one of another width; Wan T2V and Wan 2.2 A14B
    with one; another family with one."""
    _, models, made, (expert_names, _) = tiny
    names, _, _ = tiny_i2v
    t2v_names, _ = made["bf16"]
    _refused({**names, "clip_vision": "none"}, "clip_vision", "Wan 2.1 I2V", "clip_vision_h.safetensors")
    _refused(
        {**names, "diffusion_model_2": expert_names["diffusion_model_2"]},
        "diffusion_model_2",
        "set diffusion_model_2 to none",
    )
    vae = load_file(os.path.join(models, "vae", names["vae"]))
    _refused({**names, "clip_vision": _write(models, "clip_vision", "a_vae.safetensors", vae)},
             "clip_vision", "not a CLIP vision model")  # fmt: skip
    clip = load_file(os.path.join(models, "clip_vision", names["clip_vision"]))
    narrow = {**clip, "vision_model.embeddings.patch_embedding.weight": torch.zeros(32, 3, 8, 8, dtype=torch.float16)}
    _refused({**names, "clip_vision": _write(models, "clip_vision", "clip_vision_l.safetensors", narrow)},
             "clip_vision", "32 wide", "64-wide image tokens")  # fmt: skip
    short = {k: v for k, v in clip.items() if k != "visual_projection.weight"}
    _refused({**names, "clip_vision": _write(models, "clip_vision", "short_clip.safetensors", short)},
             "clip_vision", "lacks 'visual_projection.weight'", "CLIP ViT-H")  # fmt: skip
    for other in (t2v_names, expert_names):
        _refused({**other, "clip_vision": names["clip_vision"]}, "clip_vision", "set clip_vision to none")
    qwen = {"txt_norm.weight": torch.zeros(4), "transformer_blocks.0.img_mod.1.weight": torch.zeros(4, 4)}
    qwen_names = {**t2v_names, "diffusion_model": _write(models, "diffusion_models", "qwen.safetensors", qwen)}
    _refused({**qwen_names, "clip_vision": names["clip_vision"]}, "clip_vision", "Qwen-Image reads no CLIP vision")


def test_wan22_vae_layout_against_comfyui_and_the_converter(comfyui_dir):
    """Wan 2.2's VAE: the inverse (``comfy_vae22``) gives ComfyUI's own ``comfy/ldm/wan/vae2_2.py`` WanVAE's keys and
    shapes at the tiny sizes (read in a subprocess: importing ComfyUI's model code parses its command line), the
    forward conversion (``wan22_vae_to_diffusers``, diffusers' ``convert_vae_22`` renames) undoes it exactly, and the
    config read from the shapes is the tiny VAE's."""
    import subprocess
    import sys

    from parallel_runtime.families.wan.comfy_tiny import comfy_vae22, wan22_vae

    torch.manual_seed(0)
    vae = wan22_vae()
    sd = vae.state_dict()
    original = comfy_vae22(sd)
    code = (
        f"import json, sys; sys.path.insert(0, {str(comfyui_dir)!r}); sys.argv = [sys.argv[0], '--cpu']\n"
        "import comfy.options; comfy.options.enable_args_parsing()\n"
        "from comfy.ldm.wan.vae2_2 import WanVAE\n"
        "m = WanVAE(dim=4, dec_dim=8, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1,\n"
        "           temperal_downsample=[False, True, True])\n"
        "print(json.dumps({k: list(t.shape) for k, t in m.state_dict().items()}))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=comfyui_dir)
    assert run.returncode == 0, run.stderr[-2000:]
    comfy = json.loads(run.stdout.strip().splitlines()[-1])
    assert comfy == {k: list(v.shape) for k, v in original.items()}
    ours = wan_files.wan22_vae_to_diffusers(original)
    assert set(ours) == set(sd) and all(torch.equal(ours[k], sd[k]) for k in sd)
    config = wan_files.vae22_config({k: tuple(v.shape) for k, v in original.items()})
    assert {k: config[k] for k in config if not k.startswith("_")} == {
        k: v for k, v in vae.config.items() if not k.startswith("_")
    }


def test_wan22_ti2v_converts_and_runs_as_the_diffusers_folder(tiny):
    """Wan 2.2 TI2V-5B from its transformer file and Wan 2.2's VAE: a WanPipeline folder with expand_timesteps (the
    pack's wan_ti2v family), transformer and VAE bit for bit, flow shift 5, and the video from text and from a start
    image (WanImageToVideoPipeline on the same folder) equal to the diffusers folder's."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    from parallel_runtime import model_folders
    from parallel_runtime.families.wan.comfy_tiny import make_tiny_wan_files

    base, models, _, _ = tiny
    made = make_tiny_wan_files(str(models), str(base / "reference"), seed=3, formats=("bf16",), ti2v=True)
    names, reference = made["bf16"]
    name, plan = jobs.model_from_comfy_files(**names)
    assert (plan.family, plan.variant) == ("wan_ti2v", "Wan 2.2 TI2V (2 layers, 256 wide)")
    assert model_folders.resolve(name).family == "wan_ti2v"
    folder = os.path.join(base, "converted", name)
    for component in ("transformer", "vae"):
        ours, theirs = _tensors(folder, component), _tensors(reference, component)
        assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs), component
        assert _config(folder, component) == _config(reference, component), component
    with open(os.path.join(folder, "model_index.json")) as f:
        assert json.load(f)["expand_timesteps"] is True
    with open(os.path.join(folder, "scheduler", "scheduler_config.json")) as f:
        assert json.load(f)["flow_shift"] == wan_files.WAN22_TI2V_SHIFT
    ours, _ = _video(folder, WanPipeline, 2)
    theirs, _ = _video(reference, WanPipeline, 2)
    assert ours.shape == (1, 5, 32, 32, 3) and torch.allclose(ours, theirs, atol=1e-5, rtol=0)
    image = Image.fromarray((torch.arange(32 * 32 * 3) % 251).reshape(32, 32, 3).to(torch.uint8).numpy())
    ours, _ = _video(folder, WanImageToVideoPipeline, 2, image=image)
    theirs, _ = _video(reference, WanImageToVideoPipeline, 2, image=image)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)
