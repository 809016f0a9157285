"""ComfyUI's own model files (``comfy_files``) of FLUX.1 and Qwen-Image: FLUX.1's moves against diffusers' converter,
the converted folder bit for bit against the same model's diffusers folder in every weight format ComfyUI distributes,
the cache, refusals that name the input, and every strategy on real CPU ranks from the converted model equal to
diffusers' one-shot pipeline on the diffusers folder.

The tiny files come from the families' ``tiny.py`` (the inverse of the key mapping); the tokenizers
from the ComfyUI installation (COMFYUI_DIR), as in a real ComfyUI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel
from helpers import converted_and_one_shot, fp8_meaning, generate
from safetensors.torch import load_file, save_file

from parallel_runtime import (
    Cancelled,
    InvalidInput,
    comfy_files,
    default_spec,
    get_backend,
    jobs,
    launcher,
    model_folders,
)
from parallel_runtime.families.flux import files as flux_files
from parallel_runtime.families.flux.tiny import bfl_transformer
from parallel_runtime.families.tiny import ldm_vae

PROMPT = "a photo of a horse in the city"
STEPS, TOKENS = 2, 32


@pytest.fixture(scope="module")
def tiny(tiny_comfy_files, comfyui_files_dir, tmp_path_factory, models_root):
    """The session's tiny FLUX.1 as ComfyUI's files (every transformer format) with their reference diffusers folders,
    listed for the module (COMFY_PARALLEL_COMFY_MODELS) and converted below a folder of its own."""
    base = tmp_path_factory.mktemp("comfy-files")
    saved = {k: os.environ.get(k) for k in ("COMFY_PARALLEL_COMFY_MODELS", "COMFY_PARALLEL_CONVERTED")}
    os.environ["COMFY_PARALLEL_COMFY_MODELS"] = str(comfyui_files_dir)
    os.environ["COMFY_PARALLEL_CONVERTED"] = str(base / "converted")
    yield base, comfyui_files_dir, tiny_comfy_files
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _bfl_at_flux1_width(guidance: bool = True) -> dict[str, torch.Tensor]:
    """A BFL-layout state dict with FLUX.1-dev's output widths (3072, 12 288 MLP, 128-wide heads) and narrow inputs:
    the conversion moves rows, so every row count is the real one while the tensors stay small."""
    g = torch.Generator().manual_seed(0)
    inner, mlp, narrow = 3072, 12288, 3

    def t(*shape):
        return torch.randn(*shape, generator=g)

    sd = {
        "img_in.weight": t(inner, 64),
        "img_in.bias": t(inner),
        "txt_in.weight": t(inner, 4096),
        "txt_in.bias": t(inner),
    }
    for name in ("time_in", "vector_in", *(("guidance_in",) if guidance else ())):
        sd |= {
            f"{name}.in_layer.weight": t(inner, 768 if name == "vector_in" else 256),
            f"{name}.in_layer.bias": t(inner),
        }
        sd |= {f"{name}.out_layer.weight": t(inner, narrow), f"{name}.out_layer.bias": t(inner)}
    for i in range(2):
        b = f"double_blocks.{i}"
        for stream in ("img", "txt"):
            sd |= {f"{b}.{stream}_mod.lin.weight": t(6 * inner, narrow), f"{b}.{stream}_mod.lin.bias": t(6 * inner)}
            sd |= {f"{b}.{stream}_attn.qkv.weight": t(3 * inner, narrow), f"{b}.{stream}_attn.qkv.bias": t(3 * inner)}
            sd |= {f"{b}.{stream}_attn.norm.query_norm.scale": t(128), f"{b}.{stream}_attn.norm.key_norm.scale": t(128)}
            sd |= {f"{b}.{stream}_attn.proj.weight": t(inner, narrow), f"{b}.{stream}_attn.proj.bias": t(inner)}
            sd |= {f"{b}.{stream}_mlp.0.weight": t(mlp, narrow), f"{b}.{stream}_mlp.0.bias": t(mlp)}
            sd |= {f"{b}.{stream}_mlp.2.weight": t(inner, narrow), f"{b}.{stream}_mlp.2.bias": t(inner)}
    for i in range(2):
        b = f"single_blocks.{i}"
        sd |= {f"{b}.modulation.lin.weight": t(3 * inner, narrow), f"{b}.modulation.lin.bias": t(3 * inner)}
        sd |= {f"{b}.linear1.weight": t(3 * inner + mlp, narrow), f"{b}.linear1.bias": t(3 * inner + mlp)}
        sd |= {f"{b}.linear2.weight": t(inner, narrow), f"{b}.linear2.bias": t(inner)}
        sd |= {f"{b}.norm.query_norm.scale": t(128), f"{b}.norm.key_norm.scale": t(128)}
    sd |= {"final_layer.linear.weight": t(64, narrow), "final_layer.linear.bias": t(64)}
    sd |= {
        "final_layer.adaLN_modulation.1.weight": t(2 * inner, narrow),
        "final_layer.adaLN_modulation.1.bias": t(2 * inner),
    }
    return sd


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_flux1_moves_match_diffusers_converter(guidance):
    """At FLUX.1's real width, where diffusers' converter works: the same keys, the same tensors."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    sd = _bfl_at_flux1_width(guidance)
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    config = flux_files.transformer_config(shapes)
    assert config["num_attention_heads"] == 24 and config["attention_head_dim"] == 128
    assert (config["num_layers"], config["num_single_layers"], config["guidance_embeds"]) == (2, 2, guidance)
    ours = dict(
        comfy_files.apply_moves(comfy_files.group_moves(flux_files.transformer_moves(config, shapes)), iter(sd.items()))
    )
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(sd))
    assert set(ours) == set(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    # And the keys (and row counts: the inputs are narrow here) are FluxTransformer2DModel's, built on the meta device.
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**{k: v for k, v in config.items() if not k.startswith("_")})
    assert {k: v.shape[0] for k, v in model.state_dict().items()} == {k: v.shape[0] for k, v in ours.items()}


def _component_tensors(folder, component):
    sub = os.path.join(folder, component)
    files = sorted(f for f in os.listdir(sub) if f.endswith(".safetensors"))
    out = {}
    for f in files:
        out |= {k.removeprefix("text_model."): v for k, v in load_file(os.path.join(sub, f)).items()}
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_scaled"])
def test_converted_folder_is_the_diffusers_folder(tiny, fmt):
    """Every tensor of every component, bit for bit and in the same dtype, as the diffusers folder of the same model
    (the transformer's fp8 weights kept fp8 with their scales beside them: as they mean); the text encoders linked,
    not copied."""
    base, _, made = tiny
    names, reference = made[fmt]
    plan = jobs.validate_comfy_files(**names)
    assert (plan.family, plan.variant) == ("flux", "FLUX.1-dev")
    name, _ = jobs.model_from_comfy_files(**names)
    folder = os.path.join(base, "converted", name)
    for component in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        ours, theirs = _component_tensors(folder, component), _component_tensors(reference, component)
        if component == "transformer":
            stored = {v.dtype for v in ours.values()}
            assert (torch.float8_e4m3fn in stored) == (fmt != "bf16"), "the converted transformer keeps fp8"
            ours = fp8_meaning(ours)
        assert set(ours) == set(theirs), component
        for key, value in theirs.items():
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), f"{component}: {key}"
    for component in ("text_encoder", "text_encoder_2"):
        assert os.path.islink(os.path.join(folder, component, "model.safetensors"))
    with open(os.path.join(folder, "transformer", "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(reference, "transformer", "config.json")) as f:
        expected = json.load(f)
    assert {k: config[k] for k in config if not k.startswith("_")} == {
        k: (list(v) if isinstance(v, tuple) else v)
        for k, v in {**expected, "out_channels": expected["out_channels"] or expected["in_channels"]}.items()
        if k in config and not k.startswith("_")
    }


def test_conversion_is_cached_keyed_by_the_files(tiny):
    base, models, made = tiny
    names, _ = made["bf16"]
    first, plan = jobs.model_from_comfy_files(**names)
    stamp = os.stat(os.path.join(plan.folder, "transformer")).st_mtime_ns
    again, _ = jobs.model_from_comfy_files(**names)
    assert again == first and os.stat(os.path.join(plan.folder, "transformer")).st_mtime_ns == stamp
    vae = os.path.join(models, "vae", names["vae"])
    os.utime(vae, ns=(time.time_ns(), time.time_ns()))  # the same name, a new file as far as anyone can tell
    changed, _ = jobs.model_from_comfy_files(**names)
    assert changed != first and os.path.isfile(os.path.join(base, "converted", changed, "model_index.json"))
    # The nodes' model input resolves it like a diffusers folder.
    from parallel_runtime import model_folders

    assert model_folders.resolve(changed).family == "flux"


def test_cancelled_conversion_leaves_nothing(tiny):
    _, models, made = tiny
    names, _ = made["fp8"]
    vae = os.path.join(models, "vae", names["vae"])
    os.utime(vae, ns=(1, 1))  # a key no earlier test converted
    plan = jobs.validate_comfy_files(**names)
    calls = []
    with pytest.raises(Cancelled):
        comfy_files.convert(plan, should_cancel=lambda: len(calls) > 3 or calls.append(1))
    assert not [p for p in os.listdir(os.path.dirname(plan.folder)) if p.startswith(os.path.basename(plan.folder))]


def test_no_disk_space_is_refused_before_writing(tiny, monkeypatch):
    _, models, made = tiny
    names, _ = made["fp8_scaled"]
    os.utime(os.path.join(models, "vae", names["vae"]), ns=(2, 2))
    plan = jobs.validate_comfy_files(**names)
    monkeypatch.setattr(comfy_files.shutil, "disk_usage", lambda path: _Usage())
    with pytest.raises(
        InvalidInput, match=r"diffusion_model: converting .* writes .* MiB to .* free; .*COMFY_PARALLEL_CONVERTED"
    ):
        comfy_files.convert(plan)
    assert not os.path.exists(plan.folder)


class _Usage:
    total, used, free = 1 << 30, 1 << 30, 1 << 20


def _raw(path, header: dict | str, data: bytes = b"") -> None:
    """A file in safetensors' framing with any header: the length, the JSON text, the bytes."""
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + data)


def _f32(shape, start, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [start, end]}


HOSTILE_HEADERS = {
    "entry-not-an-object": ({"a.weight": 1}, b"", r"its header entry for 'a.weight' is not an object"),
    "missing-dtype": ({"a.weight": {"shape": [1], "data_offsets": [0, 4]}}, bytes(4), r"the dtype None"),
    "string-shape": (
        {"a.weight": {"dtype": "F32", "shape": "12", "data_offsets": [0, 4]}},
        bytes(4),
        r"the shape '12', not a list of non-negative integers",
    ),
    "deep-nesting": ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", b"", r"nests too deep"),
    "past-the-end": ({"a.weight": _f32([4], 0, 16)}, bytes(4), r"tensors take 16 bytes but the file holds 4"),
    "overlapping": (
        {"a.weight": _f32([2], 0, 8), "b.weight": _f32([2], 4, 12)},
        bytes(12),
        r"'b.weight' start at 4, which overlaps the tensor before it",
    ),
    "cut-short": ({"a.weight": _f32([4], 0, 16)}, bytes(10), r"holds 10 after the header: it is cut short"),
    "unknown-dtype": (
        {"a.weight": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}},
        bytes(1),
        r"the dtype 'F7', which safetensors does not know",
    ),
    "size-mismatch": ({"a.weight": _f32([2], 0, 4)}, bytes(4), r"is F32 of shape \(2,\) but 4 bytes long"),
    "metadata-not-strings": ({"__metadata__": {"a": 1}}, b"", r"__metadata__ is not an object of strings"),
}


def test_hostile_headers_are_refused_by_name(tiny):
    """Each is a refusal naming the input and what is wrong, from the header alone (no tensor is read), never a raw
    exception nor a file that passes here and fails on the ranks."""
    _, models, made = tiny
    names, _ = made["bf16"]
    for label, (header, data, message) in HOSTILE_HEADERS.items():
        _raw(models / "diffusion_models" / f"hostile-{label}.safetensors", header, data)
        with pytest.raises(InvalidInput, match=message) as e:
            jobs.validate_comfy_files(**{**names, "diffusion_model": f"hostile-{label}.safetensors"})
        assert e.value.widget == "diffusion_model", label
        assert f"'hostile-{label}.safetensors' is not a readable safetensors file" in str(e.value), label
        assert "download it again, or pick another file" in str(e.value), label
    deep = {"_quantization_metadata": "[" * 100_000 + "]" * 100_000}  # a sound header, its metadata not
    _raw(
        models / "diffusion_models" / "hostile-metadata.safetensors",
        {"__metadata__": deep, "a": _f32([1], 0, 4)},
        bytes(4),
    )
    with pytest.raises(
        InvalidInput, match=r"diffusion_model: 'hostile-metadata.safetensors' is quantized as unreadable"
    ):
        jobs.validate_comfy_files(**{**names, "diffusion_model": "hostile-metadata.safetensors"})


# A conversion in a process of its own, which stops for good once it has written part of the folder ("WRITING"), so
# that the test can kill it there; or, given a fill file, fills the disk at that point and goes on.
_CONVERSION = """
import json, os, sys, time
from parallel_runtime import InvalidInput, comfy_files, jobs
names, fill = json.loads(sys.argv[1]), sys.argv[2]
plan = jobs.validate_comfy_files(**names)
def progress(done, total, text):
    if done != 2:
        return
    if not fill:
        print("WRITING", flush=True)
        time.sleep(600)
    try:
        with open(fill, "wb") as f:
            while True:
                f.write(bytes(1 << 20))
                f.flush()
    except OSError:
        pass
try:
    comfy_files.convert(plan, on_progress=progress)
    print("CONVERTED")
except InvalidInput as e:
    print("REFUSED:", e)
print("LEFT:", sorted(p for p in os.listdir(os.path.dirname(plan.folder)) if p != os.path.basename(fill)))
"""


def test_a_killed_conversion_is_never_a_model_and_the_next_one_sweeps_it(tiny, monkeypatch):
    """SIGKILL mid-way leaves a partial folder: it has no model_index.json (written last), no model widget lists or
    resolves it, and the next conversion removes it because its writer is gone."""
    _, models, made = tiny
    names, _ = made["bf16"]
    os.utime(os.path.join(models, "vae", names["vae"]), ns=(3, 3))  # a key no other test converts
    plan = jobs.validate_comfy_files(**names)
    env = {**os.environ, "PYTHONPATH": launcher.PACKAGE_ROOT}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CONVERSION, json.dumps(names), ""], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "WRITING"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    root = os.path.dirname(plan.folder)
    (partial,) = [p for p in os.listdir(root) if p.startswith(plan.name + ".partial-")]
    assert partial.endswith(f"-{proc.pid}") and os.listdir(os.path.join(root, partial))
    assert not os.path.exists(os.path.join(root, partial, "model_index.json")) and not plan.converted
    with pytest.raises(InvalidInput, match=r"model: .* is a conversion that was cut short \(a partial folder\)"):
        model_folders.resolve(partial)
    monkeypatch.setenv("COMFY_PARALLEL_MODELS", root)  # even where a models folder holds it, it is no model
    assert partial not in model_folders.list_models() and partial not in dict(model_folders.skipped_models())
    assert jobs.model_from_comfy_files(**names)[0] == plan.name
    assert sorted(p for p in os.listdir(root) if p.startswith(plan.name)) == [plan.name]
    assert model_folders.resolve(plan.name).family == "flux"


def test_a_disk_that_fills_during_a_conversion_is_said_the_packs_way(tiny, tmp_path):
    """A disk with room when the conversion starts, filled by someone else while it writes: the refusal says where
    and how much, and nothing of the conversion is kept. In a mount namespace of its own, on a small tmpfs."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give a conversion a small disk of its own")
    _, models, made = tiny
    names, _ = made["fp8_scaled"]
    os.utime(os.path.join(models, "vae", names["vae"]), ns=(4, 4))
    disk = tmp_path / "disk"
    disk.mkdir()
    script = f'mount -t tmpfs -o size=300m tmpfs {disk} && exec {sys.executable} -c "$0" "$1" "$2"'
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, _CONVERSION, json.dumps(names),
         str(disk / "filler")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": launcher.PACKAGE_ROOT, "COMFY_PARALLEL_CONVERTED": str(disk / "converted")},
    )  # fmt: skip
    if "mount:" in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-2000:])
    refused = next(line for line in proc.stdout.splitlines() if line.startswith("REFUSED:"))
    assert f"diffusion_model: the disk of {disk / 'converted'} filled up while converting" in refused, refused
    assert re.search(r"writes [\d.]+ MiB there \([\d.]+ [GM]iB were free when it started; nothing was kept\)", refused)
    assert "COMFY_PARALLEL_CONVERTED" in refused
    assert "os error" not in refused and "LEFT: []" in proc.stdout, proc.stdout


def _write(path, tensors, metadata=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, path, metadata=metadata)


def _refusal_cases(models, names):
    d = models / "diffusion_models"
    (d / "flux1-dev-Q4_K_S.gguf").write_bytes(b"GGUF" + bytes(60))
    (d / "flux1-dev.ckpt").write_bytes(b"\x80\x02")
    _write(
        str(d / "nf4.safetensors"),
        {
            "double_blocks.0.img_attn.qkv.weight": torch.zeros(2, 2),
            "double_blocks.0.img_attn.qkv.weight.absmax": torch.zeros(2, 2),
        },
    )
    _write(
        str(d / "svdq.safetensors"),
        {"transformer_blocks.0.attn.to_qkv.qweight": torch.zeros(2, 2).to(torch.int8), "x.wscales": torch.zeros(2, 2)},
    )
    _write(str(d / "int8.safetensors"), {"double_blocks.0.img_attn.qkv.weight": torch.zeros(2, 2).to(torch.int8)})
    _write(
        str(d / "nvfp4.safetensors"),
        {"a.weight": torch.zeros(2, 2)},
        {"_quantization_metadata": json.dumps({"layers": {"a": {"format": "nvfp4"}}})},
    )
    _write(str(d / "flux2.safetensors"), {"double_stream_modulation_img.lin.weight": torch.zeros(2, 2)})
    _write(str(d / "sdxl-unet.safetensors"), {"input_blocks.0.0.weight": torch.zeros(2, 2)})
    (d / "broken.safetensors").write_bytes(b"\xff" * 20)
    return [
        ("diffusion_model", "flux1-dev-Q4_K_S.gguf", r"not a GGUF file this pack reads: .* download it again"),
        ("diffusion_model", "flux1-dev.ckpt", r"pickle"),
        ("diffusion_model", "nf4.safetensors", r"NF4 / FP4 \(bitsandbytes\)"),
        ("diffusion_model", "svdq.safetensors", r"nunchaku"),
        ("diffusion_model", "int8.safetensors", r"I8 tensors \(an integer quantization\)"),
        ("diffusion_model", "nvfp4.safetensors", r"quantized as nvfp4"),
        (
            "diffusion_model",
            "flux2.safetensors",
            r"not a transformer this pack recognises \(FLUX.1, FLUX.2 or FLUX.2 \[klein\]",
        ),
        ("diffusion_model", "sdxl-unet.safetensors", r"not a transformer this pack recognises"),
        ("diffusion_model", "broken.safetensors", r"not a readable safetensors file"),
        ("diffusion_model", names["vae"], r"unknown file"),
        ("diffusion_model", "../vae/" + names["vae"], r"not a file name"),
        ("text_encoder_2", names["text_encoder"], r"both text encoders are CLIP"),
        ("text_encoder", names["vae"], r"unknown file"),
        ("vae", names["text_encoder"], r"unknown file"),
    ]


def test_refusals_name_the_input(tiny):
    _, models, made = tiny
    names, _ = made["bf16"]
    for widget, value, message in _refusal_cases(models, names):
        with pytest.raises(InvalidInput, match=message) as e:
            jobs.validate_comfy_files(**{**names, widget: value})
        assert e.value.widget == widget and str(e.value).startswith(f"{widget}: "), (widget, value, e.value)
    # The VAE picked as the diffusion model, by a path it is listed under (models/vae is not a diffusion folder):
    os.symlink(models / "vae" / names["vae"], models / "diffusion_models" / "ae-linked.safetensors")
    with pytest.raises(InvalidInput, match=r"diffusion_model: .* is a VAE or a text encoder"):
        jobs.validate_comfy_files(**{**names, "diffusion_model": "ae-linked.safetensors"})
    assert "flux1-dev-Q4_K_S.gguf" in comfy_files.list_files("diffusion_model")  # listed, so that picking it says why


def test_a_kontext_file_converts_into_the_kontext_folder(tiny):
    """ComfyUI's FLUX.1 Kontext file has FLUX.1-dev's keys and shapes, so its name tells it: it converts into a folder
    whose model_index names FluxKontextPipeline (the flux_kontext family runs it, with its image), every component
    tensor for tensor the FLUX.1-dev conversion of the same weights."""
    _, models, made = tiny
    names, _ = made["bf16"]
    kontext = "flux1-dev-kontext_tiny.safetensors"
    os.symlink(models / "diffusion_models" / names["diffusion_model"], models / "diffusion_models" / kontext)
    name, plan = jobs.model_from_comfy_files(**{**names, "diffusion_model": kontext})
    assert (plan.family, plan.variant) == ("flux_kontext", "FLUX.1 Kontext [dev]")
    assert model_folders.resolve(name).family == "flux_kontext"
    with open(os.path.join(plan.folder, "model_index.json")) as f:
        assert json.load(f)["_class_name"] == "FluxKontextPipeline"
    _, dev = jobs.model_from_comfy_files(**names)
    assert dev.family == "flux" and dev.folder != plan.folder  # the same weights, each model's own folder
    for component in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        ours, theirs = _component_tensors(plan.folder, component), _component_tensors(dev.folder, component)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], v) for k, v in theirs.items()), component
    # FluxKontextPipeline reads the converted folder and edits with it.
    from diffusers import FluxKontextPipeline
    from PIL import Image

    pipe = FluxKontextPipeline.from_pretrained(plan.folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        prompt="a cat",
        image=Image.new("RGB", (32, 32), (200, 40, 40)),
        num_inference_steps=1,
        width=32,
        height=32,
        max_area=32 * 32,
        _auto_resize=False,
        max_sequence_length=32,
        output_type="pt",
    ).images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()


def test_flux1_files_that_would_fail_after_converting_are_refused_by_name(tiny):
    """FLUX.1's rotary axes and its VAE's norm groups are not in the files: a transformer whose heads are not 128 wide,
    or a VAE whose channels are not multiples of 32, converted and then failed at denoise or decode."""
    _, models, made = tiny
    names, _ = made["bf16"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        heads_64 = FluxTransformer2DModel(
            in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=64, num_attention_heads=2,
            joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=True, axes_dims_rope=(8, 28, 28),
        )  # fmt: skip
        channels_16 = AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(16, 16, 16, 16), layers_per_block=1, latent_channels=16, norm_num_groups=16,
            use_quant_conv=False, use_post_quant_conv=False,
        )  # fmt: skip
    _write(str(models / "diffusion_models" / "heads_64.safetensors"), bfl_transformer(heads_64.state_dict(), 1, 1))
    _write(str(models / "vae" / "channels_16.safetensors"), ldm_vae(channels_16.state_dict(), 4))
    for widget, value, message in (
        ("diffusion_model", "heads_64.safetensors", r"attention heads 64 wide, .* cover 128: .* pick flux1-dev"),
        ("vae", "channels_16.safetensors", r"has \[16, 16, 16, 16\] channels, .* multiple of 32: pick FLUX.1's VAE"),
    ):
        with pytest.raises(InvalidInput, match=message) as e:
            jobs.validate_comfy_files(**{**names, widget: value})
        assert e.value.widget == widget, e.value


# -- every strategy on real CPU ranks ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tiny):
    """The scaled-fp8 model converted, and diffusers' one-shot pipeline on the converted folder, scales applied."""
    from diffusers import FluxPipeline

    return converted_and_one_shot(tiny[2], FluxPipeline, guidance_scale=3.5, tokens=TOKENS)


def _transformer_on_each_rank(spec) -> list:
    return [next(m for m in r.resident if m.component == "transformer") for r in get_backend(spec).status().ranks]


@pytest.mark.multirank
def test_tensor_parallel_and_ulysses_on_the_converted_model(converted):
    """One 2-rank backend: tensor parallel (each rank reads its slice of the converted, sharded transformer) and
    Ulysses, each image equal to the one-shot pipeline on the diffusers folder within test_strategies' tolerances."""
    name, one_shot = converted
    spec = default_spec(ranks=2, device="cpu", memory_policy="staged")
    image = generate(spec, "tensor_parallel", model=name, tp_degree=2)
    assert (image - one_shot(3, 64, 64)).abs().max() <= 1e-4
    sharded = [m.parameter_bytes for m in _transformer_on_each_rank(spec)]
    image = generate(spec, "context_parallel", model=name, ulysses_degree=2)
    assert (image - one_shot(3, 64, 64)).abs().max() <= 1e-4
    full = _transformer_on_each_rank(spec)[0].parameter_bytes
    print(f"converted model, tensor parallel: parameter share per rank {[round(s / full, 3) for s in sharded]}")
    assert all(s / full <= 0.75 for s in sharded)


# The other strategies: the same folder through the same paths (the default run's test_strategies covers them on its
# own tiny model); left to `pytest -m slow` for the time they take.
MORE_STRATEGIES = [
    ("device_map", "device_map", {}, 1),
    ("ring", "context_parallel", {"ring_degree": 2, "ulysses_degree": 1}, 1),
    ("data_parallel", "data_parallel", {}, 2),
]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("label, strategy, args, batch", MORE_STRATEGIES, ids=[c[0] for c in MORE_STRATEGIES])
def test_other_strategies_on_the_converted_model(converted, label, strategy, args, batch):
    name, one_shot = converted
    spec = default_spec(ranks=2, device="cpu", memory_policy="staged")
    image = generate(spec, strategy, model=name, batch_size=batch, **args)
    assert image.shape[0] == batch
    assert (image - one_shot(3, 64, 64, batch)).abs().max() <= 1e-4


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.four_ranks
def test_tp_cp_on_the_converted_model(converted):
    """tp_cp (TP 2 × Ring 2) on 4 ranks: the tiny model's 2 heads leave one per TP rank, so Ring splits the tokens."""
    name, one_shot = converted
    spec = default_spec(ranks=4, device="cpu", memory_policy="staged")
    image = generate(spec, "tp_cp", model=name, tp_degree=2, ring_degree=2, ulysses_degree=1)
    assert (image - one_shot(3, 64, 64)).abs().max() <= 1e-4


# -- Qwen-Image ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen(tiny, tiny_qwen_comfy_files):
    """The session's tiny Qwen-Image as ComfyUI's files, listed and converted where the module's FLUX.1 files are."""
    return tiny_qwen_comfy_files


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_scaled"])
def test_qwenimage_converted_folder_is_the_diffusers_folder(qwen, fmt):
    """The transformer and VAE tensor for tensor as the diffusers folder (the transformer linked when its file needs
    nothing done, also plain fp8, rewritten for scaled fp8's scales and its prefix), the text encoder linked in its
    published layout, the tokenizer ComfyUI's; with bf16 the text encoder, loaded by transformers, equals the
    reference's."""
    names, reference = qwen[fmt]
    plan = jobs.validate_comfy_files(**names)
    assert (plan.family, plan.variant) == ("qwenimage", "Qwen-Image")
    name, _ = jobs.model_from_comfy_files(**names)
    folder = plan.folder
    for component in ("transformer", "vae"):
        ours, theirs = _component_tensors(folder, component), _component_tensors(reference, component)
        if component == "transformer":
            ours = fp8_meaning(ours)
        assert set(ours) == set(theirs), component
        for key, value in theirs.items():
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), f"{component}: {key}"
    transformer = os.path.join(folder, "transformer", "diffusion_pytorch_model.safetensors")
    assert os.path.islink(transformer) == (fmt != "fp8_scaled")  # plain fp8 in diffusers' keys: kept, linked
    assert os.path.islink(os.path.join(folder, "text_encoder", "model.safetensors"))
    from parallel_runtime import model_folders

    assert model_folders.resolve(name).family == "qwenimage"
    if fmt == "bf16":
        from transformers import Qwen2_5_VLForConditionalGeneration

        ours, theirs = (
            Qwen2_5_VLForConditionalGeneration.from_pretrained(os.path.join(f, "text_encoder")).state_dict()
            for f in (folder, reference)
        )
        assert set(ours) == set(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_qwenimage_scaled_fp8_text_encoder_keeps_fp8(qwen, tiny):
    """ComfyUI's qwen_2.5_vl_7b_fp8_scaled layout (fp8 matrices, a ``scale_weight`` each, the ``scaled_fp8`` marker):
    the converted text encoder is rewritten (not linked) in the file's own published layout, its fp8 weights kept
    fp8 with their scales beside them under diffusers' name, meaning weight × scale, without ComfyUI's
    bookkeeping."""
    _, models, _ = tiny
    names, _ = qwen["bf16"]
    source = load_file(str(models / "text_encoders" / names["text_encoder"]))
    stored, expected = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, {}
    for key, value in source.items():
        if key.startswith("model.layers.") and value.ndim == 2:
            scale = value.float().abs().max() / 448.0
            stored[key] = (value.float() / scale).to(torch.float8_e4m3fn)
            stored[key.removesuffix(".weight") + ".scale_weight"] = scale.reshape(())
            expected[key] = (stored[key].float() * scale).to(torch.bfloat16)
        else:
            stored[key] = expected[key] = value
    _write(str(models / "text_encoders" / "tiny_qwen_2.5_vl_7b_fp8_scaled.safetensors"), stored)
    fp8 = {**names, "text_encoder": "tiny_qwen_2.5_vl_7b_fp8_scaled.safetensors"}
    _, plan = jobs.model_from_comfy_files(**fp8)
    written = os.path.join(plan.folder, "text_encoder", "model.safetensors")
    assert not os.path.islink(written)
    ours = load_file(written)
    assert ours["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    ours = fp8_meaning(ours)
    assert set(ours) == set(expected)
    for key, value in expected.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key


def test_qwenimage_refusals_name_the_input(qwen, tiny):
    _, models, flux = tiny
    flux_names, _ = flux["bf16"]
    names, _ = qwen["bf16"]
    cases = [
        ("text_encoder", flux_names["text_encoder"], r"is CLIP \(FLUX.1's clip_l\), not Qwen2.5-VL"),
        ("text_encoder", flux_names["text_encoder_2"], r"is T5 .* qwen_2.5_vl_7b"),
        ("text_encoder_2", flux_names["text_encoder_2"], r"Qwen-Image takes one text encoder, .* set text_encoder_2"),
        ("vae", flux_names["vae"], r"FLUX.1's ae.safetensors .* not Qwen-Image's \(Wan 2.1's\) VAE"),
        ("diffusion_model", names["vae"], r"unknown file"),
    ]
    for widget, value, message in cases:
        with pytest.raises(InvalidInput, match=message) as e:
            jobs.validate_comfy_files(**{**names, widget: value})
        assert e.value.widget == widget, (widget, value, e.value)
    # And the other way round: FLUX.1's transformer with Qwen's files.
    for widget, value, message in (
        ("text_encoder", names["text_encoder"], r"neither CLIP-L nor T5-XXL"),
        ("text_encoder_2", "none", r"FLUX.1 takes 2 text encoders .* pick one"),
        ("vae", names["vae"], r"not a VAE in the original layout"),
    ):
        with pytest.raises(InvalidInput, match=message) as e:
            jobs.validate_comfy_files(**{**flux_names, widget: value})
        assert e.value.widget == widget, (widget, value, e.value)
    # A transformer cut short is refused by what it lacks.
    cut = models / "diffusion_models" / "qwen-cut.safetensors"
    full = load_file(str(models / "diffusion_models" / names["diffusion_model"]))
    _write(str(cut), {k: v for k, v in full.items() if not k.startswith("transformer_blocks.1.")})
    plan = jobs.validate_comfy_files(**{**names, "diffusion_model": cut.name})  # one layer fewer is a smaller model
    assert plan.configs["transformer"]["num_layers"] == 1
    _write(str(cut), {k: v for k, v in full.items() if k != "transformer_blocks.0.attn.to_k.weight"})
    with pytest.raises(InvalidInput, match=r"diffusion_model: .* lacks transformer_blocks.0.attn.to_k.weight"):
        jobs.validate_comfy_files(**{**names, "diffusion_model": cut.name})
    _write(str(cut), {k: v for k, v in full.items() if not k.endswith("attn.norm_q.weight")})
    with pytest.raises(InvalidInput, match=r"diffusion_model: .* lacks 'transformer_blocks.0.attn.norm_q.weight'"):
        jobs.validate_comfy_files(**{**names, "diffusion_model": cut.name})


# Qwen-Image-Edit's picture, as LoadImage makes one (8-bit pixels / 255).
EDIT_PIXELS = torch.randint(0, 256, (1, 40, 56, 3), generator=torch.Generator().manual_seed(11)).float() / 255
NEGATIVE = "a blue painting"


@pytest.fixture(scope="module")
def qwen_edit(qwen, tiny):
    """ComfyUI's Qwen-Image-Edit transformer files of the tiny Qwen-Image: 2511's (its weights and ComfyUI's flag),
    2509's and the first Edit's (its weights under their names). Returns the widgets' values of 2511's."""
    _, models, _ = tiny
    names, _ = qwen["bf16"]
    transformers = models / "diffusion_models"
    weights = load_file(str(transformers / names["diffusion_model"]))
    flag = {"__index_timestep_zero__": torch.tensor([])}
    _write(str(transformers / "tiny_qwen_image_edit_2511.safetensors"), {**weights, **flag})
    for name in ("tiny_qwen_image_edit_2509_bf16.safetensors", "tiny_qwen_image_edit_bf16.safetensors"):
        os.symlink(transformers / names["diffusion_model"], transformers / name)
    return {**names, "diffusion_model": "tiny_qwen_image_edit_2511.safetensors"}


def test_qwenimage_edit_files_convert_into_the_edit_folder(qwen, qwen_edit, tiny, tmp_path):
    """ComfyUI's Qwen-Image-Edit files have Qwen-Image's keys and shapes: 2511's (told by ComfyUI's
    ``__index_timestep_zero__`` flag) converts into a Qwen-Image-Edit Plus folder — the transformer tensor for tensor
    Qwen-Image's without the flag, its ``zero_cond_t``, the edit pipeline's model_index.json, the processor written
    from ComfyUI's tokenizer — whose one-shot QwenImageEditPlusPipeline equals the diffusers edit folder's; 2509's is
    told by its name (``zero_cond_t`` off), and the first Edit's is refused by name, not run as Qwen-Image."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers import Qwen2Tokenizer

    from parallel_runtime.families.base import pil_images
    from parallel_runtime.families.qwenimage_edit.tiny import as_edit_folder

    _, models, _ = tiny
    names, reference = qwen["bf16"]
    plan = jobs.validate_comfy_files(**{**names, "diffusion_model": "tiny_qwen_image_edit_2509_bf16.safetensors"})
    assert (plan.family, plan.variant) == ("qwenimage_edit", "Qwen-Image-Edit-2509")
    assert plan.configs["transformer"]["zero_cond_t"] is False
    with pytest.raises(
        InvalidInput, match=r"diffusion_model: .* the first Qwen-Image-Edit's .* without its image"
    ) as e:
        jobs.validate_comfy_files(**{**names, "diffusion_model": "tiny_qwen_image_edit_bf16.safetensors"})
    assert e.value.widget == "diffusion_model"
    # The edit model's text encoder sees the pictures: one without the vision tower is refused by name.
    encoders = models / "text_encoders"
    text = load_file(str(encoders / names["text_encoder"]))
    _write(str(encoders / "tiny_qwen_no_vision.safetensors"), {k: v for k, v in text.items() if "visual." not in k})
    with pytest.raises(InvalidInput, match=r"text_encoder: .* has no vision tower .* qwen_2.5_vl_7b") as e:
        jobs.validate_comfy_files(**{**qwen_edit, "text_encoder": "tiny_qwen_no_vision.safetensors"})

    name, plan = jobs.model_from_comfy_files(**qwen_edit)
    assert (plan.family, plan.variant) == ("qwenimage_edit", "Qwen-Image-Edit-2511")
    assert model_folders.resolve(name).family == "qwenimage_edit"
    expected = str(tmp_path / "edit")
    shutil.copytree(reference, expected)
    as_edit_folder(expected, Qwen2Tokenizer.from_pretrained(os.path.join(expected, "tokenizer")), zero_cond_t=True)
    ours, theirs = _component_tensors(plan.folder, "transformer"), _component_tensors(expected, "transformer")
    assert set(ours) - set(theirs) == {"__index_timestep_zero__"}  # linked: kept in the file, no model's weight
    assert all(ours[k].dtype == v.dtype and torch.equal(ours[k], v) for k, v in theirs.items())
    with open(os.path.join(expected, "transformer", "config.json")) as f:
        config = json.load(f)
    assert config["zero_cond_t"] is True
    assert all(config[k] == v for k, v in plan.configs["transformer"].items() if not k.startswith("_")), config

    def edited(folder: str) -> torch.Tensor:
        pipe = QwenImageEditPlusPipeline.from_pretrained(folder, dtype=torch.float32)
        return pipe(
            image=pil_images(EDIT_PIXELS),
            prompt=PROMPT,
            num_inference_steps=STEPS,
            height=64,
            width=64,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        ).images

    assert torch.equal(edited(plan.folder), edited(expected))


@pytest.mark.slow
@pytest.mark.multirank
def test_qwenimage_edit_converted_on_tensor_parallel(qwen_edit):
    """The converted 2511 folder on 2 CPU ranks (the picture on the encoder, tensor parallel, true CFG) gives
    QwenImageEditPlusPipeline's image on the same folder."""
    from diffusers import QwenImageEditPlusPipeline

    from parallel_runtime.families.base import pil_images

    name, _ = jobs.model_from_comfy_files(**qwen_edit)
    spec = default_spec(ranks=2, device="cpu", memory_policy="staged")
    positive = jobs.encode_prompt(spec, model=name, prompt=PROMPT, negative_prompt=NEGATIVE, image=EDIT_PIXELS)
    transformer = jobs.plan_transformer(spec, model=name, strategy="tensor_parallel", tp_degree=2)
    settings = {"width": 64, "height": 64, "true_cfg_scale": 4.0}
    latent = jobs.sample(transformer, positive, seed=3, steps=STEPS, guidance_scale=1.0, **settings)
    image = jobs.decode(spec, model=name, samples=latent)
    pipe = QwenImageEditPlusPipeline.from_pretrained(model_folders.resolve(name).path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        image=pil_images(EDIT_PIXELS),
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        num_inference_steps=STEPS,
        generator=[torch.Generator("cpu").manual_seed(3)],
        output_type="pt",
        **settings,
    ).images.permute(0, 2, 3, 1)
    diff = (image - expected).abs().max().item()
    print(f"converted Qwen-Image-Edit-2511, tensor parallel: max |diff| vs one-shot {diff:.3g}")
    assert diff <= 1e-4


@pytest.fixture(scope="module")
def qwen_converted(qwen):
    """The scaled-fp8 Qwen-Image converted, and the one-shot QwenImagePipeline's image on the converted folder as
    diffusers reads it, scales applied (true CFG with a negative prompt: test_strategies' settings)."""
    from helpers import family_reference

    names, _ = qwen["fp8_scaled"]
    name, _ = jobs.model_from_comfy_files(**names)
    return name, family_reference(model_folders.resolve(name).path, "qwenimage", 3)


QWEN_STRATEGIES = [
    pytest.param("tensor_parallel", {"tp_degree": 2}, id="tp"),
    pytest.param("context_parallel", {"ulysses_degree": 2}, id="ulysses"),
    # CI's budget: the same paths again.
    pytest.param("context_parallel", {"ring_degree": 2, "ulysses_degree": 1}, marks=pytest.mark.slow, id="ring"),
    pytest.param("device_map", {}, marks=pytest.mark.slow, id="device_map"),
]


@pytest.mark.multirank
@pytest.mark.parametrize("strategy, args", QWEN_STRATEGIES)
def test_qwenimage_strategies_on_the_converted_model(qwen_converted, strategy, args):
    """The converted folder on 2 CPU ranks (one backend for the module) gives the one-shot pipeline's image on the
    diffusers folder within test_strategies' tolerance."""
    from helpers import generate_family

    name, expected = qwen_converted
    spec = default_spec(ranks=2, device="cpu", memory_policy="staged")
    _, image = generate_family(spec, "qwenimage", strategy, model=name, **args)
    diff = (image - expected).abs().max().item()
    print(f"converted Qwen-Image, {strategy} {args}: max |diff| vs one-shot {diff:.3g}")
    assert diff <= 1e-4


@pytest.mark.slow  # ~45 s on a loaded 2-core machine (building the 7B and 20B models' modules, even on meta)
def test_qwenimage_configs_at_the_real_sizes():
    """At Qwen-Image's and Qwen2.5-VL-7B's real sizes (models built on the meta device from their published configs,
    written here independently): the configs read back from the shapes alone build models with exactly those shapes,
    and the transformer's expected keys are the model's."""
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from parallel_runtime.families.qwenimage import files as qwenimage_files
    from parallel_runtime.families.qwenimage.tiny import published_qwen_layout

    def shapes_of(model, layout=dict):
        return {k: tuple(v.shape) for k, v in layout(model.state_dict()).items()}

    with torch.device("meta"):
        transformer = QwenImageTransformer2DModel()  # diffusers' defaults are Qwen-Image's: 60 layers, 24 heads
        shapes = shapes_of(transformer)
        config = qwenimage_files.transformer_config(shapes)
        assert (config["num_layers"], config["num_attention_heads"], config["joint_attention_dim"]) == (60, 24, 3584)
        assert set(qwenimage_files.transformer_keys(config)) == set(shapes)
        again = QwenImageTransformer2DModel(**{k: v for k, v in config.items() if not k.startswith("_")})
        assert shapes_of(again) == shapes
        published = Qwen2_5_VLConfig(
            text_config={
                "vocab_size": 152064,
                "hidden_size": 3584,
                "intermediate_size": 18944,
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
            },
            vision_config={
                "depth": 32,
                "hidden_size": 1280,
                "intermediate_size": 3420,
                "num_heads": 16,
                "out_hidden_size": 3584,
            },
            tie_word_embeddings=False,
        )
        encoder = Qwen2_5_VLForConditionalGeneration(published)
        shapes = shapes_of(encoder, published_qwen_layout) | {"lm_head.weight": (152064, 3584)}
        derived = qwenimage_files.text_encoder_config(shapes)
        assert (derived["num_attention_heads"], derived["num_key_value_heads"], derived["tie_word_embeddings"]) == (
            28,
            4,
            False,
        )
        assert derived["vision_config"]["num_heads"] == 16 and derived["vision_config"]["spatial_merge_size"] == 2
        rebuilt = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**derived))
        assert shapes_of(rebuilt) == shapes_of(encoder)
        assert rebuilt.config.text_config.rope_parameters["mrope_section"] == [16, 24, 24]
