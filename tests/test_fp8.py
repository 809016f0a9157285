"""fp8 weights stay fp8 (issue 26): the converted folder keeps a ComfyUI fp8 / scaled-fp8 transformer as it is
stored, and the ranks hold it in fp8 on every strategy (``worker/fp8_weights.py``), computing in the run's dtype.

Every image is compared with diffusers' own one-process pipeline on the same converted folder, its scales applied by
``helpers.apply_fp8_scales`` — written apart from the pack's loader and hook —, within 1e-4 in float32. Ulysses and
tensor parallel on the scaled-fp8 FLUX.1 and Qwen-Image are test_comfy_files' (the default run); here the other
strategy classes (device_map, data parallel, cfg_parallel for Qwen-Image), plain fp8, what a rank holds (its
parameters' bytes: fp8 where the file is), stacked LoRAs on fp8 weights, and ``as dtype`` against ``as stored``.

The large text encoders (FLUX.1's T5, Qwen-Image's Qwen2.5-VL) written as fp8 and scaled fp8 stay fp8 too: their
folder no larger than the file, and the encode op's embeddings equal transformers' encoder on the weights as they
mean (a float32 folder of them, loaded by transformers) within 1e-5, with rank 0 holding their Linear weights in fp8.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from diffusers import FluxPipeline, QwenImagePipeline
from helpers import (
    PROMPT,
    STEPS,
    apply_fp8_scales,
    converted_and_one_shot,
    family_reference,
    generate,
    generate_family,
    one_shot_images,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from parallel_runtime import InvalidInput, default_spec, get_backend, jobs, model_folders
from parallel_runtime.families.tiny import make_tiny_lora, save_diffusers_lora, write_text_encoder_formats

TOKENS = 32
FP8_FORMATS = ("fp8", "fp8_scaled")
# The converted tiny FLUX.1's layers a LoRA changes (it has one block of each kind): column- and row-sharded ones
# under tensor parallelism, packed ones (to_q / to_k / to_v of the file's qkv share a scale) and the top.
LORA_LAYERS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_v",
    "transformer_blocks.0.attn.to_out.0",
    "transformer_blocks.0.ff.net.0.proj",
    "transformer_blocks.0.ff.net.2",
    "single_transformer_blocks.0.proj_mlp",
    "single_transformer_blocks.0.proj_out",
    "proj_out",
)


@pytest.fixture(scope="module")
def files(tiny_comfy_files, tiny_qwen_comfy_files, comfyui_files_dir, tmp_path_factory):
    """The session's tiny FLUX.1 and Qwen-Image as ComfyUI's files, listed for this module and converted below a
    folder of its own; LoRAs go to a folder of its own too."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("COMFY_PARALLEL_COMFY_MODELS", str(comfyui_files_dir))
        env.setenv("COMFY_PARALLEL_CONVERTED", str(tmp_path_factory.mktemp("fp8-converted")))
        env.setenv("COMFY_PARALLEL_LORAS", str(tmp_path_factory.mktemp("fp8-loras")))
        yield {"flux": tiny_comfy_files, "qwenimage": tiny_qwen_comfy_files, "models": comfyui_files_dir}


def _folder(name: str) -> str:
    return model_folders.resolve(name).path


def _stored(folder: str, component: str = "transformer") -> dict[str, str]:
    sub = os.path.join(folder, component)
    dtypes = {}
    for file in sorted(f for f in os.listdir(sub) if f.endswith(".safetensors")):
        with safe_open(os.path.join(sub, file), framework="pt") as f:
            dtypes |= {key: f.get_slice(key).get_dtype() for key in f.keys()}
    return dtypes


@pytest.mark.parametrize("family", ["flux", "qwenimage"])
@pytest.mark.parametrize("fmt", ["fp8", "fp8_scaled"])
def test_the_converted_folder_keeps_fp8_and_is_no_larger_than_the_file(files, family, fmt):
    """The transformer's fp8 weights stay fp8 on disk (a scaled file's scales beside them, one per fp8 weight): the
    folder's transformer is no larger than the file plus its config (and the safetensors header, whose diffusers
    names are longer than BFL's), about half of the bf16 file's."""
    names, _ = files[family][fmt]
    name, _ = jobs.model_from_comfy_files(**names)
    sub = os.path.join(_folder(name), "transformer")
    written = sum(os.path.getsize(os.path.join(sub, f)) for f in os.listdir(sub))
    diffusion_models = files["models"] / "diffusion_models"
    file = os.path.getsize(diffusion_models / names["diffusion_model"])
    bf16 = os.path.getsize(diffusion_models / files[family]["bf16"][0]["diffusion_model"])
    config = os.path.getsize(os.path.join(sub, "config.json"))
    print(f"{family} {fmt}: file {file} B, converted transformer {written} B, the bf16 file {bf16} B")
    assert written <= file + config + (8 << 10)
    assert written < 0.6 * bf16
    dtypes = _stored(_folder(name))
    fp8 = {k for k, d in dtypes.items() if d == "F8_E4M3"}
    scales = {k.removesuffix("_scale") for k in dtypes if k.endswith(".weight_scale")}
    assert fp8 and scales == (fp8 if fmt == "fp8_scaled" else set())


def test_an_unknown_weights_choice_is_refused_by_name(files):
    names, _ = files["flux"]["fp8"]
    name, _ = jobs.model_from_comfy_files(**names)
    with pytest.raises(InvalidInput, match=r"weights: unknown choice 'nf4'; choose one of as stored, as dtype"):
        jobs.plan_transformer(default_spec(ranks=2, device="cpu"), model=name, weights="nf4")


# -- on real CPU ranks ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spec(files):
    return default_spec(ranks=2, device="cpu", memory_policy="staged")


@pytest.fixture(scope="module")
def flux(files):
    """(model name, one-shot reference) for FLUX.1's scaled-fp8 and plain-fp8 files."""
    return {
        fmt: converted_and_one_shot(files["flux"], FluxPipeline, guidance_scale=3.5, tokens=TOKENS, fmt=fmt)
        for fmt in ("fp8_scaled", "fp8")
    }


def _held_bytes(spec) -> list[int]:
    """The parameter bytes of the transformer each rank that holds one holds (device_map: rank 0 alone)."""
    ranks = get_backend(spec).status().ranks
    return [m.parameter_bytes for r in ranks for m in r.resident if m.component == "transformer"]


def _bytes_if(folder: str, fp8_bytes: int) -> int:
    """A whole transformer's parameter bytes in float32, its fp8 weights at ``fp8_bytes`` each (scales are no
    parameters)."""
    total = 0
    sub = os.path.join(folder, "transformer")
    for file in sorted(f for f in os.listdir(sub) if f.endswith(".safetensors")):
        with safe_open(os.path.join(sub, file), framework="pt") as f:
            for key in f.keys():
                if key.endswith(".weight_scale"):
                    continue
                piece = f.get_slice(key)
                n = 1
                for d in piece.get_shape():
                    n *= d
                total += n * (fp8_bytes if piece.get_dtype() == "F8_E4M3" else 4)
    return total


@pytest.mark.multirank
def test_data_parallel_and_device_map_hold_fp8(spec, flux):
    """Data parallel on the plain-fp8 FLUX.1 (a replica per rank, read by the pack's loader) and device_map on the
    scaled one (placed by diffusers, then held): each image the one-shot pipeline's; each rank's transformer holds
    its fp8 weights in fp8 — its parameters' bytes are those of the file's dtypes, far below float32's."""
    name, one_shot = flux["fp8"]
    image = generate(spec, "data_parallel", model=name, batch_size=2, tokens=TOKENS)
    assert (image - one_shot(3, 64, 64, 2)).abs().max() <= 1e-4
    held, whole = _held_bytes(spec), _bytes_if(_folder(name), 4)
    print(f"data parallel, plain fp8: each rank holds {held} B of parameters; all in float32 {whole} B")
    assert held == [_bytes_if(_folder(name), 1)] * 2
    assert all(h < 0.5 * whole for h in held)

    name, one_shot = flux["fp8_scaled"]
    image = generate(spec, "device_map", model=name, tokens=TOKENS)
    assert (image - one_shot(3, 64, 64)).abs().max() <= 1e-4
    assert _held_bytes(spec) == [_bytes_if(_folder(name), 1)]


@pytest.mark.multirank
def test_cfg_parallel_on_scaled_fp8_qwenimage(spec, files):
    names, _ = files["qwenimage"]["fp8_scaled"]
    name, _ = jobs.model_from_comfy_files(**names)
    expected = family_reference(_folder(name), "qwenimage", 3)
    _, image = generate_family(spec, "qwenimage", "cfg_parallel", model=name)
    diff = (image - expected).abs().max().item()
    print(f"scaled-fp8 Qwen-Image, cfg_parallel: max |diff| vs one-shot {diff:.3g}")
    assert diff <= 1e-4


@pytest.mark.multirank
def test_stacked_loras_on_fp8_under_tensor_parallel(spec, flux):
    """Two LoRAs on the scaled-fp8 FLUX.1, tensor parallel: each rank merges its slices of both into the weight its
    fp8 layer computes with (never into the fp8 weight), equal to diffusers' pipeline with both as PEFT adapters on
    the dequantized model; and the image differs from the one without them (the LoRAs do something)."""
    name, one_shot = flux["fp8_scaled"]
    folder, loras = _folder(name), os.environ["COMFY_PARALLEL_LORAS"]
    stack = [("fp8_a.safetensors", 0.8, 11), ("fp8_b.safetensors", -0.6, 12)]
    for file, _, seed in stack:
        lora = make_tiny_lora(folder, "flux", layers=LORA_LAYERS, seed=seed, size=1.0)
        save_diffusers_lora(lora, os.path.join(loras, file), "flux")
    transformer = jobs.plan_transformer(spec, model=name, strategy="tensor_parallel", tp_degree=2)
    for file, strength, _ in stack:
        transformer, _ = jobs.add_lora(transformer, lora_name=file, strength=strength)
    positive = jobs.encode_prompt(spec, model=name, prompt=PROMPT, max_sequence_length=TOKENS)
    latent = jobs.sample(transformer, positive, seed=3, steps=STEPS, guidance_scale=3.5, width=64, height=64)
    image = jobs.decode(spec, model=name, samples=latent)

    pipe = FluxPipeline.from_pretrained(folder, dtype=torch.float32)
    apply_fp8_scales(pipe.transformer, folder)
    for i, (file, _, _) in enumerate(stack):
        pipe.load_lora_weights(os.path.join(loras, file), adapter_name=f"lora{i}")
    pipe.set_adapters([f"lora{i}" for i in range(len(stack))], [strength for _, strength, _ in stack])
    expected = one_shot_images(pipe, guidance_scale=3.5, max_sequence_length=TOKENS)(3, 64, 64)
    diff = (image - expected).abs().max().item()
    print(f"stacked LoRAs on scaled fp8, tensor parallel: max |diff| vs diffusers {diff:.3g}")
    assert diff <= 1e-4
    assert (image - one_shot(3, 64, 64)).abs().max() > 1e-2


@pytest.mark.multirank
def test_peft_adapters_on_fp8_are_refused_by_name_and_its_fixes_agree(spec, flux):
    """``lora_mode: peft`` on a transformer held in fp8 is refused naming lora_mode (PEFT would cast the adapters to
    fp8), and the backend stays usable: both fixes the refusal names — auto (merged per layer into the fp8 layers'
    computed weights) and PEFT adapters on the weights held ``as dtype`` — give the same image, the LoRA's."""
    import dataclasses

    from parallel_runtime import OpFailed
    from parallel_runtime.wire import LoraMode

    name, one_shot = flux["fp8"]
    lora = "fp8_peft.safetensors"
    make = make_tiny_lora(_folder(name), "flux", layers=LORA_LAYERS, seed=13, size=1.0)
    save_diffusers_lora(make, os.path.join(os.environ["COMFY_PARALLEL_LORAS"], lora), "flux")
    positive = jobs.encode_prompt(spec, model=name, prompt=PROMPT, max_sequence_length=TOKENS)

    def image(mode: LoraMode, weights: str = "as stored") -> torch.Tensor:
        handle = jobs.plan_transformer(spec, model=name, strategy="data_parallel", weights=weights)
        handle, _ = jobs.add_lora(handle, lora_name=lora, strength=0.8)
        handle = dataclasses.replace(handle, spec=dataclasses.replace(handle.spec, lora_mode=mode))
        latent = jobs.sample(
            handle, positive, seed=3, steps=STEPS, guidance_scale=3.5, width=64, height=64, batch_size=2
        )
        return jobs.decode(spec, model=name, samples=latent)

    with pytest.raises((InvalidInput, OpFailed), match=r"lora_mode: peft .* held in fp8 the LoRA would be rounded"):
        image(LoraMode.PEFT)
    fused, adapters = image(LoraMode.AUTO), image(LoraMode.PEFT, weights="as dtype")
    diff = (fused - adapters).abs().max().item()
    print(f"a LoRA on plain fp8: fused per layer vs PEFT on the weights as dtype, max |diff| {diff:.3g}")
    assert diff <= 1e-4
    assert (fused - one_shot(3, 64, 64, 2)).abs().max() > 1e-2


AS_DTYPE_CASES = [
    # The default run's case: scaled fp8, a replica per rank read by tensor parallel's slice reader, which applies
    # the scales in the dtype as it reads (nothing else in the default run takes ``as dtype``).
    pytest.param("context_parallel", {}, "fp8_scaled", id="context_parallel-fp8_scaled"),
    pytest.param("context_parallel", {}, "fp8", id="context_parallel-fp8", marks=pytest.mark.slow),
    pytest.param("tensor_parallel", {"tp_degree": 2}, "fp8_scaled", id="tp-fp8_scaled", marks=pytest.mark.slow),
    pytest.param("tensor_parallel", {"tp_degree": 2}, "fp8", id="tp-fp8", marks=pytest.mark.slow),
]


@pytest.mark.multirank
@pytest.mark.parametrize("strategy, args, fmt", AS_DTYPE_CASES)
def test_as_dtype_gives_the_image_of_as_stored(spec, flux, strategy, args, fmt):
    """``as dtype`` (made in the dtype at load, scales applied) and the default ``as stored`` give the same image, on
    plain fp8 too; the dtype's copy holds float32's bytes."""
    name, one_shot = flux[fmt]
    image = generate(spec, strategy, model=name, tokens=TOKENS, weights="as dtype", **args)
    assert (image - one_shot(3, 64, 64)).abs().max() <= 1e-4
    if strategy == "context_parallel":
        assert _held_bytes(spec) == [_bytes_if(_folder(name), 4)] * 2


# -- the text encoders ---------------------------------------------------------------------------------------------
# Each family's large text encoder: FLUX.1's T5 (beside CLIP-L, kept fp16), Qwen-Image's Qwen2.5-VL.
ENCODERS = {"flux": ("text_encoder_2", FluxPipeline), "qwenimage": ("text_encoder", QwenImagePipeline)}


@pytest.fixture(scope="module")
def fp8_encoders(files):
    """FLUX.1 and Qwen-Image converted with their large text encoder written as fp8 and as scaled fp8 (the bf16
    transformer, which is linked): ``{(family, fmt): (model name, the text encoder's file)}``."""
    made = {}
    for key, (widget, _) in ENCODERS.items():
        names, _ = files[key]["bf16"]
        for fmt, file in write_text_encoder_formats(str(files["models"]), names[widget], FP8_FORMATS).items():
            name, _ = jobs.model_from_comfy_files(**{**names, widget: file})
            made[key, fmt] = name, files["models"] / "text_encoders" / file
    return made


@pytest.mark.parametrize("family", ENCODERS)
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_the_converted_text_encoder_keeps_fp8_and_is_no_larger_than_its_file(fp8_encoders, family, fmt):
    """A text encoder's fp8 weights stay fp8 on disk, a scaled file's scales beside them (one per fp8 weight, under
    diffusers' name): its folder is no larger than the file plus its config and the longer scale names; plain fp8
    (nothing to rename) is the file itself, linked."""
    name, file = fp8_encoders[family, fmt]
    widget, _ = ENCODERS[family]
    sub = os.path.join(_folder(name), widget)
    written = sum(os.path.getsize(os.path.join(sub, f)) for f in os.listdir(sub))
    config = os.path.getsize(os.path.join(sub, "config.json"))
    print(f"{family} {widget} {fmt}: file {os.path.getsize(file)} B, converted {written} B")
    assert written <= os.path.getsize(file) + config + (8 << 10)
    assert os.path.islink(os.path.join(sub, "model.safetensors")) == (fmt == "fp8")
    dtypes = _stored(_folder(name), widget)
    fp8 = {k for k, d in dtypes.items() if d == "F8_E4M3"}
    scales = {k.removesuffix("_scale") for k in dtypes if k.endswith(".weight_scale")}
    assert fp8 and scales == (fp8 if fmt == "fp8_scaled" else set())


def _meaning_encoder(folder: str, widget: str, out) -> torch.nn.Module:
    """The reference text encoder: the converted folder's weights as they mean — each fp8 tensor cast to float32, times
    its scale — saved as a float32 folder and loaded by transformers as it loads any, independently of the pack's
    loader and hook."""
    import transformers

    sub = os.path.join(folder, widget)
    tensors = {}
    for file in sorted(f for f in os.listdir(sub) if f.endswith(".safetensors")):
        tensors |= load_file(os.path.join(sub, file))
    meaning = {}
    for key, value in tensors.items():
        if key.endswith(".weight_scale"):
            continue
        value = value.float()
        scale = tensors.get(key + "_scale")
        if scale is not None:
            value = value * (scale.float() if scale.numel() == 1 else scale.float().reshape(-1, 1))
        meaning[key] = value
    os.makedirs(out, exist_ok=True)
    shutil.copyfile(os.path.join(sub, "config.json"), os.path.join(out, "config.json"))
    save_file(meaning, os.path.join(out, "model.safetensors"))
    with open(os.path.join(sub, "config.json")) as f:
        cls = getattr(transformers, json.load(f)["architectures"][0])
    return cls.from_pretrained(out, dtype=torch.float32)


def _held_fp8_bytes(encoder: torch.nn.Module) -> int:
    """The parameter bytes of ``encoder`` (float32) with every Linear layer's weight at one byte an element, but for
    the layers its class keeps in float32 (T5's ``wo``, whose input T5 casts to its weight's dtype): what the rank
    holds (a weight tied to an embedding stays float32 too)."""
    kept = set(encoder._keep_in_fp32_modules or ())
    modules = dict(encoder.named_modules())
    linear = {
        id(m.weight) for n, m in modules.items() if isinstance(m, torch.nn.Linear) and not kept & set(n.split("."))
    }
    linear -= {id(m.weight) for m in modules.values() if not isinstance(m, torch.nn.Linear) and hasattr(m, "weight")}
    return sum(p.numel() * (1 if id(p) in linear else 4) for p in encoder.parameters())


@pytest.mark.multirank
def test_fp8_text_encoders_encode_as_they_mean_held_in_fp8(spec, fp8_encoders, tmp_path):
    """The pack's encode op (rank 0 of the 2 CPU ranks, placed device_map="balanced") on T5 and Qwen2.5-VL in fp8
    and scaled fp8 equals transformers' encoders on the weights as they mean (cast up × scale, in float32) within
    1e-5, and rank 0 holds every Linear weight of them in fp8 (its parameters' bytes), the rest in float32."""
    for (family, fmt), (name, _) in fp8_encoders.items():
        widget, pipeline = ENCODERS[family]
        folder = _folder(name)
        ours = jobs.encode_prompt(spec, model=name, prompt=PROMPT, max_sequence_length=TOKENS).tensors
        encoder = _meaning_encoder(folder, widget, tmp_path / f"{family}-{fmt}")
        pipe = pipeline.from_pretrained(folder, transformer=None, vae=None, dtype=torch.float32, **{widget: encoder})
        theirs = pipe.encode_prompt(PROMPT, max_sequence_length=TOKENS)[0]
        diff = (ours["prompt_embeds"] - theirs).abs().max().item()
        print(f"{family} {widget} {fmt}: max |diff| vs transformers on the meaning {diff:.3g}")
        assert ours["prompt_embeds"].shape == theirs.shape and diff <= 1e-5

        others = [m for n, m in pipe.components.items() if n.startswith("text_encoder") and n != widget]
        expected = _held_fp8_bytes(encoder) + sum(4 * p.numel() for m in others for p in m.parameters())
        (rank0, *_) = get_backend(spec).status().ranks
        held = [m.parameter_bytes for m in rank0.resident if m.component == "text_encoders"]
        print(f"{family} {fmt}: rank 0 holds {held} B of text encoders; Linear weights in fp8 would be {expected} B")
        assert held == [expected]
        assert _held_fp8_bytes(encoder) < sum(4 * p.numel() for p in encoder.parameters())
