"""ComfyUI-GGUF's transformers (``gguf_files``): the tiny FLUX.1 and Qwen-Image written as GGUF Q8_0 and Q4_K in
ComfyUI-GGUF's layout, converted by ParallelModelFromComfyFiles into a folder that links the file, held packed on
every rank, and under each strategy equal to diffusers' one-shot pipeline on a folder holding what the file means
(the gguf package's dequantization of it); refusals that name the input before anything loads.
"""

from __future__ import annotations

import os
import struct

import gguf
import numpy as np
import pytest
import torch
from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig, QwenImageTransformer2DModel
from gguf import quants
from helpers import generate, generate_family, one_shot_images

from parallel_runtime import InvalidInput, default_spec, get_backend, jobs, model_folders
from parallel_runtime.estimates import gguf_bytes
from parallel_runtime.families import tp_plan
from parallel_runtime.families.flux.tiny import bfl_transformer
from parallel_runtime.families.tiny import count_blocks, quantize_q4_k, write_gguf, write_gguf_formats
from parallel_runtime.gguf_files import gguf_weights, load_gguf_transformer, read_gguf, tensor_parallel_share

TOKENS = 32


def _flux_layout(sd):
    return bfl_transformer(sd, count_blocks(sd, "transformer_blocks."), count_blocks(sd, "single_transformer_blocks."))


@pytest.fixture(scope="module")
def files(tiny_comfy_files, tiny_qwen_comfy_files, comfyui_files_dir, tmp_path_factory, models_root):
    """The session's tiny FLUX.1 and Qwen-Image as GGUF Q8_0 / Q4_K files beside their ComfyUI files, each with its
    reference folder; listed for the module and converted below a folder of its own."""
    base = tmp_path_factory.mktemp("gguf")
    saved = {k: os.environ.get(k) for k in ("COMFY_PARALLEL_COMFY_MODELS", "COMFY_PARALLEL_CONVERTED")}
    os.environ["COMFY_PARALLEL_COMFY_MODELS"] = str(comfyui_files_dir)
    os.environ["COMFY_PARALLEL_CONVERTED"] = str(base / "converted")
    models = str(comfyui_files_dir)
    made = {
        "flux": write_gguf_formats(models, tiny_comfy_files["bf16"], "flux", _flux_layout, FluxTransformer2DModel),
        "qwenimage": write_gguf_formats(
            models, tiny_qwen_comfy_files["bf16"], "qwen_image", dict, QwenImageTransformer2DModel
        ),
    }
    yield comfyui_files_dir, made
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# -- the tiny files ----------------------------------------------------------------------------------------------
def test_q4_k_blocks_are_the_format():
    """The pack's Q4_K writer (the gguf package cannot quantize K-quants) gives blocks the gguf package dequantizes
    to the values within a 4-bit step of each sub-block, and diffusers' own dequantizer reads the same values (in half
    precision, as its layers compute with them)."""
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    x[3] = 0.0  # an all-zero row: d = 0, codes 0
    packed = quantize_q4_k(x)
    assert packed.shape == (8, 2 * 144) and packed.dtype == np.uint8
    values = quants.dequantize(packed, gguf.GGMLQuantizationType.Q4_K)
    step = (x.reshape(8, 16, 32).max(axis=2) - np.minimum(x.reshape(8, 16, 32).min(axis=2), 0)) / 15
    err = np.abs(values - x).reshape(8, 16, 32).max(axis=2)
    assert (err <= step * 0.75 + 1e-3).all(), (err / np.maximum(step, 1e-9)).max()
    assert (values[3] == 0).all()
    ours = dequantize_gguf_tensor(
        GGUFParameter(torch.from_numpy(packed), quant_type=gguf.GGMLQuantizationType.Q4_K)
    ).float()
    assert (ours - torch.from_numpy(values)).abs().max() <= 2e-3 * np.abs(x).max()  # half precision's rounding


def test_the_files_are_comfyui_ggufs(files):
    models, made = files
    for family, arch in (("flux", "flux"), ("qwenimage", "qwen_image")):
        for qtype in ("Q8_0", "Q4_K"):
            names, _ = made[family][qtype]
            header = read_gguf(str(models / "diffusion_models" / names["diffusion_model"]))
            assert header.architecture == arch
            assert qtype in set(header.types.values()) and "F32" in set(header.types.values())


# -- converting -------------------------------------------------------------------------------------------------
def test_the_converted_folder_links_the_file_and_every_rank_holds_it_packed(files):
    """The folder's transformer is the file, linked (nothing written but configs and the moves), and the loaded model
    holds GGUF-packed parameters: their bytes are what the format says (Q8_0: 34 bytes per 32 values, Q4_K: 144 per
    256), and dequantized they are what the file means."""
    models, made = files
    for family, cls in (("flux", FluxTransformer2DModel), ("qwenimage", QwenImageTransformer2DModel)):
        for qtype, ratio in (("Q8_0", 34 / 32), ("Q4_K", 144 / 256)):
            names, reference = made[family][qtype]
            name, _ = jobs.model_from_comfy_files(**names)
            folder = os.path.join(os.environ["COMFY_PARALLEL_CONVERTED"], name)
            link = gguf_weights(os.path.join(folder, "transformer"))
            assert os.path.realpath(link) == os.path.realpath(models / "diffusion_models" / names["diffusion_model"])
            assert sorted(os.listdir(os.path.join(folder, "transformer"))) == [
                "config.json",
                "diffusion_pytorch_model.gguf",
                "gguf_moves.json",
            ]
            model = load_gguf_transformer(cls, folder, torch.float32, "cpu")
            packed = {k: p for k, p in model.named_parameters() if hasattr(p, "quant_type")}
            assert packed, "no GGUF-packed parameter"
            for key, p in packed.items():  # (out, in) values packed as out × in / block blocks of the type's bytes
                out, width = p.quant_shape
                assert p.dtype == torch.uint8 and p.numel() == round(out * width * ratio), key
                assert p.quant_type.name == qtype
            values = sum(p.quant_shape[0] * p.quant_shape[1] for p in packed.values())
            assert gguf_bytes(values, qtype) == sum(p.numel() for p in packed.values())  # the README's estimate
            expected = cls.from_pretrained(reference, subfolder="transformer", dtype=torch.float32).state_dict()
            from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

            for key, value in model.state_dict().items():
                torch.testing.assert_close(dequantize_gguf_tensor(value).float(), expected[key], rtol=0, atol=1e-6)


@pytest.mark.slow  # building the tiny FLUX.2's files (its Mistral and tokenizer) takes a while
def test_flux2_gguf_converts_and_loads_packed(tmp_path, monkeypatch):
    """FLUX.2's GGUF goes the same way: its layout's moves make the model's keys from BFL's, the weights stay packed
    and mean what the file means."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    from parallel_runtime.families.flux2.tiny import _bfl_flux2_transformer, make_tiny_flux2_files

    models = tmp_path / "models"
    monkeypatch.setenv("COMFY_PARALLEL_COMFY_MODELS", str(models))
    monkeypatch.setenv("COMFY_PARALLEL_CONVERTED", str(tmp_path / "converted"))
    made = make_tiny_flux2_files(str(models), str(tmp_path / "reference"), formats=("bf16",))["bf16"]
    names, reference = write_gguf_formats(
        str(models), made, "flux", _bfl_flux2_transformer, Flux2Transformer2DModel, ("Q4_K",)
    )["Q4_K"]
    name, _ = jobs.model_from_comfy_files(**names)
    model = load_gguf_transformer(Flux2Transformer2DModel, str(tmp_path / "converted" / name), torch.float32, "cpu")
    assert any(hasattr(p, "quant_type") for p in model.parameters())
    expected = Flux2Transformer2DModel.from_pretrained(reference, subfolder="transformer", dtype=torch.float32)
    for key, value in expected.state_dict().items():
        got = dequantize_gguf_tensor(model.state_dict()[key]).float()
        torch.testing.assert_close(got, value, rtol=0, atol=1e-6)


def _raw_type_offset(path: str, name: str) -> int:
    """Where tensor ``name``'s type sits in ``path``'s tensor infos (to write one the gguf package does not know)."""
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == name)
    return int(tensor.field.offset) + sum(int(part.nbytes) for part in tensor.field.parts[:4])


def test_refusals_name_the_input(files):
    """Each bad GGUF is a refusal naming diffusion_model and the fix, from the headers alone."""
    models, made = files
    names, _ = made["flux"]["Q8_0"]
    d = models / "diffusion_models"
    source = str(d / names["diffusion_model"])
    data = open(source, "rb").read()
    (d / "cut.gguf").write_bytes(data[: len(data) - 4096])
    (d / "junk.gguf").write_bytes(b"GGUF" + bytes(60))
    odd = bytearray(data)
    at = _raw_type_offset(source, "double_blocks.0.img_attn.qkv.weight")
    odd[at : at + 4] = struct.pack("<I", 99)
    (d / "odd-type.gguf").write_bytes(bytes(odd))
    sd = {
        k: v for k, v in _flux_layout(FluxTransformer2DModel.from_config(_tiny_flux_config(made)).state_dict()).items()
    }
    write_gguf(sd, str(d / "wan-arch.gguf"), "wan", "Q8_0")
    write_gguf(sd, str(d / "said-qwen.gguf"), "qwen_image", "Q8_0")
    iq = gguf.GGUFWriter(str(d / "iq2.gguf"), "flux")
    iq.add_tensor("double_blocks.0.img_attn.qkv.weight", np.zeros((4, 66), np.uint8), raw_shape=(4, 66),
                  raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)  # fmt: skip
    iq.write_header_to_file()
    iq.write_kv_data_to_file()
    iq.write_tensors_to_file()
    iq.close()
    # As ComfyUI-GGUF writes Wan's 5-D patch embedding: reshaped to 2-D, its shape beside.
    wan = gguf.GGUFWriter(str(d / "wan-5d.gguf"), "wan")
    wan.add_array("comfy.gguf.orig_shape.patch_embedding.weight", [64, 16, 1, 2, 2])
    wan.add_tensor("patch_embedding.weight", np.zeros((64, 64), np.float32))
    wan.write_header_to_file()
    wan.write_kv_data_to_file()
    wan.write_tensors_to_file()
    wan.close()
    for value, message in (
        ("cut.gguf", r"not a GGUF file this pack reads: it is cut short"),
        ("junk.gguf", r"not a GGUF file this pack reads"),
        ("odd-type.gguf", r"a tensor type the gguf package does not know"),
        ("iq2.gguf", r"holds IQ2_XXS tensors, which diffusers' GGUF path cannot compute; pick a Q8_0"),
        ("wan-arch.gguf", r"a GGUF of 'wan' .* a family this pack does not run; pick a GGUF of FLUX.1"),
        ("said-qwen.gguf", r"says it is a GGUF of 'qwen_image' .* holds FLUX.1's tensors"),
        ("wan-5d.gguf", r"a GGUF file this pack does not load: .* stored reshaped .* use the model's bf16 or fp8"),
    ):
        with pytest.raises(InvalidInput, match=message) as e:
            jobs.validate_comfy_files(**{**names, "diffusion_model": value})
        assert e.value.widget == "diffusion_model", e.value
    os.symlink(source, models / "text_encoders" / "t5.gguf")
    with pytest.raises(InvalidInput, match=r"text_encoder_2: .* only the diffusion model may be GGUF"):
        jobs.validate_comfy_files(**{**names, "text_encoder_2": "t5.gguf"})


def test_a_gguf_component_outside_a_conversion_is_refused(tmp_path, monkeypatch):
    """A diffusers folder whose component holds only a .gguf file the pack did not link: refused naming the model
    input, with where a GGUF transformer goes."""
    model = tmp_path / "diffusers" / "gguf-folder"
    (model / "transformer").mkdir(parents=True)
    (model / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    (model / "transformer" / "config.json").write_text("{}")
    (model / "transformer" / "flux1-dev-Q8_0.gguf").write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setenv("COMFY_PARALLEL_MODELS", str(tmp_path / "diffusers"))
    with pytest.raises(InvalidInput, match=r"model: gguf-folder/transformer holds GGUF weights, .* ParallelModelFrom"):
        model_folders.resolve("gguf-folder")


def _tiny_flux_config(made) -> dict:
    _, reference = made["flux"]["Q8_0"]
    return FluxTransformer2DModel.load_config(reference, subfolder="transformer")


def test_the_node_says_what_a_tensor_parallel_rank_holds(files):
    """Under tensor_parallel and tp_cp the node counts a rank's slices: packed where they are whole blocks, and apart
    the rowwise slices the rank dequantizes at load (Q4_K's 256-value blocks do not split the tiny model's 256-wide
    attention output over 2 ranks; Q8_0's 32-value ones do)."""
    _, made = files
    for qtype, dequantized in (("Q8_0", False), ("Q4_K", True)):
        name, _ = jobs.model_from_comfy_files(**made["flux"][qtype][0])
        for ranks, strategy, args in ((2, "tensor_parallel", {}), (4, "tp_cp", {"ring_degree": 2})):
            spec = default_spec(ranks=ranks, device="cpu", memory_policy="staged")
            handle = jobs.plan_transformer(spec, model=name, strategy=strategy, tp_degree=2, ulysses_degree=1, **args)
            assert "packed as GGUF on a rank (its tensor-parallel slices)" in handle.held, handle.held
            assert ("dequantized at load" in handle.held) is dequantized, handle.held
    # What the strategies that keep a replica say: the file's packed bytes, not a dtype's copy.
    handle = jobs.plan_transformer(default_spec(ranks=2, device="cpu"), model=name, strategy="context_parallel")
    assert handle.held.startswith("weights: ") and "packed as GGUF on a rank," in handle.held, handle.held
    handle = jobs.plan_transformer(default_spec(ranks=2, device="cpu"), model=name, strategy="device_map")
    assert "packed as GGUF on the GPUs, spread by their packed bytes (device_map)" in handle.held, handle.held


# -- every strategy on real CPU ranks ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flux_models(files):
    """Each FLUX.1 GGUF converted, and diffusers' one-shot pipeline on the folder of what it means."""
    from diffusers import FluxPipeline

    _, made = files
    out = {}
    for qtype, (names, reference) in made["flux"].items():
        name, _ = jobs.model_from_comfy_files(**names)
        pipe = FluxPipeline.from_pretrained(reference, dtype=torch.float32)
        out[qtype] = (name, one_shot_images(pipe, guidance_scale=3.5, max_sequence_length=TOKENS))
    return out


FLUX_STRATEGIES = [
    pytest.param("Q4_K", "context_parallel", {"ulysses_degree": 2}, 1, id="Q4_K-ulysses"),
    # data parallel on GGUF runs in the default run with stacked LoRAs (test_stacked_loras_on_gguf_weights_...)
    pytest.param("Q8_0", "data_parallel", {}, 2, marks=pytest.mark.slow, id="Q8_0-data_parallel"),
    pytest.param("Q8_0", "device_map", {}, 1, id="Q8_0-device_map"),
    pytest.param("Q8_0", "context_parallel", {"ulysses_degree": 2}, 1, marks=pytest.mark.slow, id="Q8_0-ulysses"),
    pytest.param(
        "Q4_K", "context_parallel", {"ring_degree": 2, "ulysses_degree": 1}, 1, marks=pytest.mark.slow, id="Q4_K-ring"
    ),
    pytest.param("Q4_K", "data_parallel", {}, 2, marks=pytest.mark.slow, id="Q4_K-data_parallel"),
    pytest.param("Q4_K", "device_map", {}, 1, marks=pytest.mark.slow, id="Q4_K-device_map"),
    # Q4_K: some rowwise slices dequantized at load, the rest packed; Q8_0: every slice packed
    pytest.param("Q4_K", "tensor_parallel", {}, 1, id="Q4_K-tensor_parallel"),
    pytest.param("Q8_0", "tensor_parallel", {}, 1, marks=pytest.mark.slow, id="Q8_0-tensor_parallel"),
]


@pytest.mark.multirank
@pytest.mark.parametrize("qtype, strategy, args, batch", FLUX_STRATEGIES)
def test_flux_gguf_strategies(flux_models, qtype, strategy, args, batch):
    """2 CPU ranks (one backend for the module): the GGUF model's image equals the one-shot pipeline on what the file
    means within 1e-4, and every rank that holds the transformer holds it packed (less than fp32's bytes by the
    format's ratio)."""
    name, one_shot = flux_models[qtype]
    spec = default_spec(ranks=2, device="cpu", memory_policy="staged")
    image = generate(spec, strategy, model=name, batch_size=batch, tokens=TOKENS, **args)
    diff = (image - one_shot(3, 64, 64, batch)).abs().max().item()
    print(f"FLUX.1 GGUF {qtype} {strategy} {args}: max |diff| vs one-shot {diff:.3g}")
    assert diff <= 1e-4
    held = [m for r in get_backend(spec).status().ranks for m in r.resident if m.component == "transformer"]
    assert len(held) == (1 if strategy == "device_map" else 2)
    fp32 = _fp32_bytes(name)
    assert all(m.parameter_bytes < fp32 * 0.5 for m in held), ([m.parameter_bytes for m in held], fp32)
    if strategy == "tensor_parallel":
        # Each rank holds its share of the file: its slices (packed, or dequantized where the rule says), the rest
        # whole, as the node's estimate counts them; well under the whole file.
        folder = os.path.join(os.environ["COMFY_PARALLEL_CONVERTED"], name, "transformer")
        share = tensor_parallel_share(folder, tp_plan("FluxTransformer2DModel"), 2, 4)
        assert (share.dequantized_weights > 0) is (qtype == "Q4_K")
        assert [m.parameter_bytes for m in held] == [share.packed_bytes + share.dequantized_bytes] * 2
        file = os.path.getsize(gguf_weights(folder))
        packed = held[0].parameter_bytes - share.dequantized_bytes
        print(f"FLUX.1 GGUF {qtype} tensor_parallel: a rank holds {packed / file:.2f} × the file packed")
        assert packed < file * 0.75


@pytest.mark.multirank
@pytest.mark.four_ranks
@pytest.mark.slow
def test_flux_gguf_tp_cp_on_four_ranks(flux_models):
    """tp_cp on 4 CPU ranks (TP 2 inside, Ring 2 across: the tiny model's 2 heads leave one per TP rank, which
    Ulysses cannot split) of the Q4_K file: each rank's packed and dequantized slices under the sequence split equal
    the one-shot pipeline on what the file means within 1e-4."""
    name, one_shot = flux_models["Q4_K"]
    spec = default_spec(ranks=4, device="cpu", memory_policy="staged")
    image = generate(spec, "tp_cp", model=name, tokens=TOKENS, tp_degree=2, ring_degree=2, ulysses_degree=1)
    diff = (image - one_shot(3, 64, 64, 1)).abs().max().item()
    print(f"FLUX.1 GGUF Q4_K tp_cp tp 2 × ring 2: max |diff| vs one-shot {diff:.3g}")
    assert diff <= 1e-4
    held = [m for r in get_backend(spec).status().ranks for m in r.resident if m.component == "transformer"]
    assert all(m.parallelism == {"tp_degree": 2, "ring_degree": 2, "ulysses_degree": 1} for m in held), held


def _fp32_bytes(name: str) -> int:
    """What the transformer's parameters take in float32 (its config's model built on the meta device)."""
    from accelerate import init_empty_weights

    folder = os.path.join(os.environ["COMFY_PARALLEL_CONVERTED"], name)
    with init_empty_weights():
        model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(folder, subfolder="transformer"))
    return sum(p.numel() * 4 for p in model.parameters())


@pytest.fixture(scope="module")
def qwen_models(files):
    """Each Qwen-Image GGUF converted, and (made when first asked for) the one-shot pipeline's image on the folder of
    what it means: (model name, that image)."""
    from helpers import family_reference

    _, made = files
    cache = {}

    def model(qtype: str) -> tuple[str, torch.Tensor]:
        if qtype not in cache:
            names, reference = made["qwenimage"][qtype]
            cache[qtype] = (jobs.model_from_comfy_files(**names)[0], family_reference(reference, "qwenimage", 3))
        return cache[qtype]

    return model


QWEN_STRATEGIES = [
    pytest.param("Q8_0", "cfg_parallel", {}, id="Q8_0-cfg_parallel"),
    pytest.param("Q4_K", "cfg_parallel", {}, marks=pytest.mark.slow, id="Q4_K-cfg_parallel"),
    pytest.param("Q4_K", "context_parallel", {"ulysses_degree": 2}, marks=pytest.mark.slow, id="Q4_K-ulysses"),
    pytest.param("Q4_K", "tensor_parallel", {}, marks=pytest.mark.slow, id="Q4_K-tensor_parallel"),
    pytest.param("Q8_0", "tensor_parallel", {}, marks=pytest.mark.slow, id="Q8_0-tensor_parallel"),
]


@pytest.mark.multirank
@pytest.mark.parametrize("qtype, strategy, args", QWEN_STRATEGIES)
def test_qwenimage_gguf_strategies(qwen_models, qtype, strategy, args):
    """Qwen-Image's GGUF (true CFG with a negative prompt) on 2 CPU ranks equals the one-shot pipeline on what the
    file means within 1e-4."""
    name, expected = qwen_models(qtype)
    spec = default_spec(ranks=2, device="cpu", memory_policy="staged")
    _, image = generate_family(spec, "qwenimage", strategy, model=name, **args)
    diff = (image - expected).abs().max().item()
    print(f"Qwen-Image GGUF {qtype} {strategy} {args}: max |diff| vs one-shot {diff:.3g}")
    assert diff <= 1e-4


def test_qwenimage_reference_is_diffusers_own_gguf_path(files):
    """For Qwen-Image (whose ComfyUI files keep diffusers' keys) diffusers' own one-process GGUF path reads the file
    itself: ``from_single_file`` with ``GGUFQuantizationConfig`` computes what the reference folder's model computes,
    so the strategies' reference is diffusers' GGUF path."""
    models, made = files
    for qtype in ("Q8_0", "Q4_K"):
        names, reference = made["qwenimage"][qtype]
        own = QwenImageTransformer2DModel.from_single_file(
            str(models / "diffusion_models" / names["diffusion_model"]),
            config=reference,
            subfolder="transformer",
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
            torch_dtype=torch.float32,
            local_files_only=True,
        )
        plain = QwenImageTransformer2DModel.from_pretrained(reference, subfolder="transformer", dtype=torch.float32)
        torch.manual_seed(0)
        inputs = {
            "hidden_states": torch.randn(1, 16, 64),
            "encoder_hidden_states": torch.randn(1, 8, 128),
            "encoder_hidden_states_mask": torch.ones(1, 8, dtype=torch.bool),
            "timestep": torch.tensor([0.5]),
            "img_shapes": [[(1, 4, 4)]],
        }
        with torch.no_grad():
            a, b = own(**inputs).sample, plain(**inputs).sample
        assert (a - b).abs().max() <= 1e-5


# -- LoRAs on GGUF weights ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_loras(files, tmp_path_factory):
    """Two tiny LoRAs of the FLUX.1 model (diffusers' layout) in the module's LoRA folder: the family's test layers
    that its one-block model has (packed Q8_0 layers, F32 ones, the embedder and proj_out)."""
    from parallel_runtime.families.flux.tiny import LORA_LAYERS as FLUX_LAYERS
    from parallel_runtime.families.tiny import make_tiny_lora, save_diffusers_lora

    LORA_LAYERS = [m for m in FLUX_LAYERS if ".1." not in m]

    _, made = files
    _, reference = made["flux"]["Q8_0"]
    root = tmp_path_factory.mktemp("gguf-loras")
    old = os.environ.get("COMFY_PARALLEL_LORAS")
    os.environ["COMFY_PARALLEL_LORAS"] = str(root)
    for i, name in enumerate(("gguf_a.safetensors", "gguf_b.safetensors")):
        lora = make_tiny_lora(reference, "flux", layers=LORA_LAYERS, seed=20 + i)
        save_diffusers_lora(lora, root / name, "flux")
    yield root
    if old is None:
        del os.environ["COMFY_PARALLEL_LORAS"]
    else:
        os.environ["COMFY_PARALLEL_LORAS"] = old


STACK = (("gguf_a.safetensors", 0.8), ("gguf_b.safetensors", -0.5))


@pytest.mark.multirank
def test_stacked_loras_on_gguf_weights_are_side_branches(files, flux_models, gguf_loras):
    """Two LoRAs stacked on the Q8_0 model under data parallel: PEFT adapters beside the packed weights (auto), the
    image equal to diffusers' pipeline with the same adapters on what the file means; ``fused`` (which would merge
    the deltas into packed weights) is refused naming lora_mode, and the backend stays usable."""
    import dataclasses

    from diffusers import FluxPipeline

    from parallel_runtime import OpFailed
    from parallel_runtime.wire import LoraMode

    _, made = files
    name, _ = flux_models["Q8_0"]
    spec = default_spec(ranks=2, device="cpu", memory_policy="staged")
    positive = jobs.encode_prompt(spec, model=name, prompt="a photo of a horse in the city", max_sequence_length=TOKENS)

    def image(mode: LoraMode) -> torch.Tensor:
        handle = jobs.plan_transformer(spec, model=name, strategy="data_parallel")
        for lora, strength in STACK:
            handle, _ = jobs.add_lora(handle, lora_name=lora, strength=strength)
        handle = dataclasses.replace(handle, spec=dataclasses.replace(handle.spec, lora_mode=mode))
        latent = jobs.sample(handle, positive, seed=3, steps=2, guidance_scale=3.5, width=64, height=64, batch_size=2)
        return jobs.decode(spec, model=name, samples=latent)

    ours = image(LoraMode.AUTO)
    pipe = FluxPipeline.from_pretrained(made["flux"]["Q8_0"][1], dtype=torch.float32)
    for i, (lora, _) in enumerate(STACK):
        pipe.load_lora_weights(str(gguf_loras / lora), adapter_name=f"lora{i}")
    pipe.set_adapters(["lora0", "lora1"], [strength for _, strength in STACK])
    expected = one_shot_images(pipe, guidance_scale=3.5, max_sequence_length=TOKENS)(3, 64, 64, 2)
    diff = (ours - expected).abs().max().item()
    print(f"FLUX.1 GGUF Q8_0 with two stacked LoRAs (PEFT side branches): max |diff| vs one-shot {diff:.3g}")
    assert diff <= 1e-4
    with pytest.raises((InvalidInput, OpFailed), match=r"lora_mode: .* a GGUF transformer holds packed"):
        image(LoraMode.FUSED)
    assert (image(LoraMode.AUTO) - ours).abs().max() <= 1e-6


def test_loras_on_gguf_under_tensor_parallel_are_refused_by_name(files, gguf_loras):
    """A LoRA chained to a GGUF transformer under tensor parallelism is refused at the LoRA loader, naming lora_name
    and the strategies that take it, before anything loads."""
    _, made = files
    name, _ = jobs.model_from_comfy_files(**made["flux"]["Q8_0"][0])
    handle = jobs.plan_transformer(default_spec(ranks=2, device="cpu"), model=name, strategy="tensor_parallel")
    with pytest.raises(InvalidInput, match=r"lora_name: gguf_a.safetensors: LoRAs on a GGUF .* context_parallel"):
        jobs.add_lora(handle, lora_name="gguf_a.safetensors", strength=0.8)


# -- device_map ----------------------------------------------------------------------------------------------------
def test_device_map_spreads_a_gguf_transformer_by_its_packed_bytes(tmp_path):
    """device_map's plan of where each block of a GGUF transformer goes (``spread_by_packed_bytes``, diffusers' own
    ``device_map="auto"`` on the packed parameters; on CPU only the plan, as no GPU is there to place it on): a
    FLUX.1 of 4 + 4 blocks in Q4_K over two GPUs whose budgets hold 0.8 × its packed bytes each goes to both, each
    GPU within its budget, nothing offloaded; counted in float32 values the same budgets would not hold it."""
    from collections import Counter

    from parallel_runtime.gguf_files import file_tensors, spread_by_packed_bytes

    torch.manual_seed(0)
    plain = FluxTransformer2DModel(
        in_channels=64,
        num_layers=4,
        num_single_layers=4,
        attention_head_dim=128,
        num_attention_heads=2,
        joint_attention_dim=64,
        pooled_projection_dim=64,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    )
    plain.save_config(tmp_path / "transformer")
    path = write_gguf(plain.state_dict(), str(tmp_path / "flux-Q4_K.gguf"), "flux", "Q4_K")
    packed = FluxTransformer2DModel.from_single_file(
        file_tensors(path),
        config=str(tmp_path),
        subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        torch_dtype=torch.float32,
        local_files_only=True,
    )

    def size(model: torch.nn.Module, name: str = "") -> int:
        return sum(p.numel() * p.element_size() for p in (model.get_submodule(name) if name else model).parameters())

    whole, fp32 = size(packed), size(plain)
    assert whole < fp32 * 0.3  # Q4_K's matrices are 0.56 bytes a value
    budget = {0: int(whole * 0.8), 1: int(whole * 0.8)}
    placed = spread_by_packed_bytes(packed, budget)
    held = Counter()
    for name, device in placed.items():
        held[device] += size(packed, name)
    print(f"GGUF Q4_K over 2 GPUs of {budget[0]} bytes each: {dict(held)} ({whole} packed, {fp32} in float32)")
    assert set(held) == {0, 1} and all(held[d] <= budget[d] for d in (0, 1)), placed
    assert sum(held.values()) == whole
    assert any(block.startswith("transformer_blocks") for block, d in placed.items() if d == 0)
    assert any(block.startswith("single_transformer_blocks") for block, d in placed.items() if d == 1)
    assert {"cpu", "disk"} & set(spread_by_packed_bytes(plain, budget).values())
