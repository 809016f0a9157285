"""fp8 weights stay fp8 (issue 26): the converted folder keeps a ComfyUI fp8 / scaled-fp8 transformer as it is
stored, and the ranks hold it in fp8 on every strategy (``worker/fp8_weights.py``), computing in the run's dtype.

Every image is compared with diffusers' own one-process pipeline on the same converted folder, its scales applied by
``helpers.apply_fp8_scales`` — written apart from the pack's loader and hook —, within 1e-4 in float32. Ulysses and
tensor parallel on the scaled-fp8 FLUX.1 and Qwen-Image are test_comfy_files' (the default run); here the other
strategy classes (device_map, data parallel, cfg_parallel for Qwen-Image), plain fp8, what a rank holds (its
parameters' bytes: fp8 where the file is), stacked LoRAs on fp8 weights, and ``as dtype`` against ``as stored``.
"""

from __future__ import annotations

import os

import pytest
import torch
from diffusers import FluxPipeline
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

from parallel_runtime import InvalidInput, default_spec, get_backend, jobs, model_folders
from parallel_runtime.families.tiny import make_tiny_lora, save_diffusers_lora

TOKENS = 32
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


def _stored(folder: str) -> dict[str, torch.dtype]:
    sub = os.path.join(folder, "transformer")
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


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("strategy, args", [("tensor_parallel", {"tp_degree": 2}), ("context_parallel", {})])
def test_as_dtype_gives_the_image_of_as_stored(spec, flux, strategy, args):
    """``as dtype`` (made in the dtype at load, scales applied) and the default ``as stored`` give the same image on
    plain fp8 too; the dtype's copy holds float32's bytes."""
    for fmt in ("fp8_scaled", "fp8"):
        name, one_shot = flux[fmt]
        image = generate(spec, strategy, model=name, tokens=TOKENS, weights="as dtype", **args)
        assert (image - one_shot(3, 64, 64)).abs().max() <= 1e-4
        if strategy == "context_parallel":
            assert _held_bytes(spec) == [_bytes_if(_folder(name), 4)] * 2
