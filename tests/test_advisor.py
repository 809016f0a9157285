"""The strategy advisor (``comfy-parallel advise``) on a model folder whose headers declare FLUX.1-dev's real
transformer (every tensor's real shape, bf16, in a sparse file that takes no disk) and on the tiny models, for the
three declared boxes of issue 28. The expectations are computed here by hand, from FLUX.1-dev's published shape and
the basis the advisor states, independently of its code."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from parallel_runtime.advisor import advise, measured_box, parse_gpus, read_model
from parallel_runtime.errors import InvalidInput
from parallel_runtime.families.tiny import make_tiny_model
from parallel_runtime.headers import read_header

GIB = 2**30
# FLUX.1-dev, as published (black-forest-labs/FLUX.1-dev): its transformer's config and parameter count, and its other
# components' parameter counts (CLIP-L's text model, T5-XXL's encoder, the VAE), all stored in bf16.
FLUX1_DEV = {
    "_class_name": "FluxTransformer2DModel",
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
TRANSFORMER_PARAMETERS = 11_901_408_320
ENCODER_PARAMETERS = {"text_encoder": 123_060_480, "text_encoder_2": 4_762_310_656}
VAE_PARAMETERS = 83_819_683

# The advisor's stated basis, restated: bf16 activations, 32 copies of the hidden state per token (8 replicated + 24
# split under TP), TP splits FLUX.1-dev's plan's 72.3% of the weights (a rank held 14.2 of 22.2 GiB at tp 2), a
# decode holds 8 first-level feature maps of 128 channels per pixel, 90% of a GPU usable; the declared links'
# bandwidths; 500 TFLOP/s.
BYTES, COPIES, TP_KEPT, TP_SPLIT, HEADROOM = 2, 32, 8, 0.723, 0.9
BANDWIDTH = {"pcie,no-p2p": 8e9, "nvlink": 150e9, "pcie": 20e9}
RATE = 500e12

WIDTH = HEIGHT = 1024
IMAGE_TOKENS = (WIDTH // 16) * (HEIGHT // 16)  # 4096
TOKENS = IMAGE_TOKENS + 512  # T5's padded prompt
HIDDEN = 24 * 128
WEIGHTS = TRANSFORMER_PARAMETERS * BYTES
VAE = VAE_PARAMETERS * BYTES  # the VAE's weights stay resident beside every stage (the staged policy)
FULL_ACTIVATIONS = TOKENS * HIDDEN * BYTES * COPIES
ONE_GPU_S = (2 * TRANSFORMER_PARAMETERS * TOKENS + 4 * (19 + 38) * TOKENS**2 * HIDDEN) / RATE
ALLREDUCED_LAYERS = 19 * 2 + 38  # rowwise layers of FLUX.1's _tp_plan: 2 per double-stream block, 1 per single


def write_sparse_safetensors(path: str, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file with this header whose data is a hole: the right length, no disk (``truncate``)."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * {"BF16": 2, "F32": 4, "F8_E4M3": 1}[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)


def flux1_dev_shapes() -> dict[str, list[int]]:
    """Every tensor of FLUX.1-dev's transformer with its real shape (built on the meta device: no memory)."""
    from diffusers import FluxTransformer2DModel

    config = {k: v for k, v in FLUX1_DEV.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    return {name: list(t.shape) for name, t in model.state_dict().items()}


def write_flux1_dev(folder: str, transformer_dtype: str = "BF16") -> str:
    """A FLUX.1-dev-sized diffusers folder: the transformer's real tensors, the others one tensor of their size."""
    for component in ("transformer", "vae", *ENCODER_PARAMETERS):
        os.makedirs(os.path.join(folder, component))
    with open(os.path.join(folder, "model_index.json"), "w") as f:
        json.dump({"_class_name": "FluxPipeline"}, f)
    with open(os.path.join(folder, "transformer", "config.json"), "w") as f:
        json.dump(FLUX1_DEV, f)
    with open(os.path.join(folder, "vae", "config.json"), "w") as f:
        json.dump({"_class_name": "AutoencoderKL", "block_out_channels": [128, 256, 512, 512]}, f)
    shapes = flux1_dev_shapes()
    write_sparse_safetensors(
        os.path.join(folder, "transformer", "diffusion_pytorch_model.safetensors"),
        {name: (transformer_dtype, shape) for name, shape in shapes.items()},
    )
    write_sparse_safetensors(
        os.path.join(folder, "vae", "diffusion_pytorch_model.safetensors"), {"all": ("BF16", [VAE_PARAMETERS])}
    )
    for component, count in ENCODER_PARAMETERS.items():
        write_sparse_safetensors(os.path.join(folder, component, "model.safetensors"), {"all": ("BF16", [count])})
    return folder


@pytest.fixture(scope="module")
def flux1_dev(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_flux1_dev(str(tmp_path_factory.mktemp("advisor") / "FLUX.1-dev"))


def test_the_sparse_folder_is_flux1_dev_and_takes_no_disk(flux1_dev: str) -> None:
    path = os.path.join(flux1_dev, "transformer", "diffusion_pytorch_model.safetensors")
    tensors, _ = read_header(path)  # the loader's own checks: the header matches the file's length
    assert sum(math.prod(shape) for _, shape in tensors.values()) == TRANSFORMER_PARAMETERS
    assert os.path.getsize(path) > WEIGHTS and os.stat(path).st_blocks * 512 < 1 << 20
    model = read_model(flux1_dev)
    assert model.family.key == "flux" and model.transformer_parameters == TRANSFORMER_PARAMETERS
    assert model.transformer_bytes == WEIGHTS
    assert model.encoder_bytes == sum(ENCODER_PARAMETERS.values()) * BYTES
    assert model.stored_dtypes["transformer"] == ("BF16",) and model.stored_bytes["transformer"] == WEIGHTS


def _by_name(advice) -> dict:
    return {o.name: o for o in advice.options}


def test_two_24gb_pcie_cards_without_p2p(flux1_dev: str) -> None:
    advice = advise(read_model(flux1_dev), parse_gpus("2x24GB,pcie,no-p2p"), WIDTH, HEIGHT)
    options, usable = _by_name(advice), 24 * GIB * HEADROOM
    # device_map: half the weights each and a whole step's activations; it moves the hidden state across once a step
    device_map = options["device_map over 2 GPUs"]
    assert device_map.peak == WEIGHTS // 2 + FULL_ACTIVATIONS + VAE and device_map.fits
    assert device_map.sends == TOKENS * HIDDEN * BYTES
    assert device_map.relative == pytest.approx((ONE_GPU_S + TOKENS * HIDDEN * BYTES / 8e9) / ONE_GPU_S)
    # TP 2: 27.7% + 72.3%/2 of the weights; activations of 8 + 24/2 copies; all-reduces of the whole sequence
    tp = options["tensor_parallel tp 2"]
    assert tp.weights == pytest.approx(WEIGHTS * (1 - TP_SPLIT + TP_SPLIT / 2), rel=1e-3)
    assert tp.activations == TOKENS * HIDDEN * BYTES * (TP_KEPT + (COPIES - TP_KEPT) / 2)
    tp_sends = ALLREDUCED_LAYERS * TOKENS * HIDDEN * BYTES * 2 * (1 / 2)
    assert tp.sends == pytest.approx(tp_sends) and tp.fits
    assert tp.relative == pytest.approx((ONE_GPU_S / 2 + tp_sends / 8e9) / ONE_GPU_S)
    assert tp.relative > 1  # over PCIe without P2P, TP is slower than one GPU (raylight #22 #31)
    # A replica of 22.2 GiB does not fit 90% of 24 GiB: one GPU, context parallel, data parallel
    assert WEIGHTS > usable
    for name in ("one GPU", "context_parallel ulysses 2", "context_parallel ring 2", "data_parallel 2"):
        assert not options[name].fits, name
    assert [o.name for o in advice.options if o.fits] == ["device_map over 2 GPUs", "tensor_parallel tp 2"]
    assert not advice.changes


def test_four_80gb_nvlink(flux1_dev: str) -> None:
    advice = advise(read_model(flux1_dev), parse_gpus("4x80GB,nvlink"), WIDTH, HEIGHT)
    options = _by_name(advice)
    assert all(o.fits for o in advice.options)
    slice_bytes = TOKENS / 4 * HIDDEN * BYTES
    expected = {
        "data_parallel 4": ONE_GPU_S / 4,
        "context_parallel ulysses 4": ONE_GPU_S / 4 + 57 * 4 * slice_bytes * 3 / 4 / 150e9,
        "context_parallel ring 4": ONE_GPU_S / 4 + 57 * 2 * slice_bytes * 3 / 150e9,
        "tensor_parallel tp 4": ONE_GPU_S / 4 + ALLREDUCED_LAYERS * TOKENS * HIDDEN * BYTES * 2 * 3 / 4 / 150e9,
        # TP in pairs over each pair's half of the tokens, plus Ulysses over 2 pairs of the heads a TP rank holds
        "tp_cp tp 2 × ulysses 2": ONE_GPU_S / 4
        + (ALLREDUCED_LAYERS * TOKENS / 2 * HIDDEN * BYTES * 2 / 2 + 57 * 4 * TOKENS / 2 * HIDDEN * BYTES / 2 / 2)
        / 150e9,
        "device_map over 4 GPUs": ONE_GPU_S + 3 * TOKENS * HIDDEN * BYTES / 150e9,
        "one GPU": ONE_GPU_S,
    }
    for name, seconds in expected.items():
        assert options[name].relative == pytest.approx(seconds / ONE_GPU_S), name
    assert [o.name for o in advice.options] == sorted(expected, key=expected.get)
    assert options["context_parallel ulysses 4"].activations == math.ceil(TOKENS / 4) * HIDDEN * BYTES * COPIES
    # device_map's quarter of the weights is still its largest stage: the encoders are balanced over the 4 GPUs
    # (9.1 GiB / 4), the VAE's decode at 1024² is 2 GiB of 128-channel feature maps; the VAE's weights stay throughout
    encoders = sum(ENCODER_PARAMETERS.values()) * BYTES
    decode = VAE + WIDTH * HEIGHT * 128 * BYTES * 8
    assert max(encoders / 4 + VAE, decode) < WEIGHTS / 4 + FULL_ACTIVATIONS + VAE < encoders
    assert options["device_map over 4 GPUs"].peak == WEIGHTS // 4 + FULL_ACTIVATIONS + VAE


def test_eight_48gb_pcie(flux1_dev: str) -> None:
    advice = advise(read_model(flux1_dev), parse_gpus("8x48GB,pcie"), WIDTH, HEIGHT)
    options = _by_name(advice)
    ulysses = options["context_parallel ulysses 8"]
    ulysses_sends = 57 * 4 * (TOKENS / 8 * HIDDEN * BYTES) * 7 / 8
    assert ulysses.sends == pytest.approx(ulysses_sends)
    assert ulysses.relative == pytest.approx((ONE_GPU_S / 8 + ulysses_sends / 20e9) / ONE_GPU_S)
    tp = options["tensor_parallel tp 8"]
    assert tp.weights == pytest.approx(WEIGHTS * (1 - TP_SPLIT + TP_SPLIT / 8), rel=1e-3)
    assert tp.relative == pytest.approx(
        (ONE_GPU_S / 8 + ALLREDUCED_LAYERS * TOKENS * HIDDEN * BYTES * 2 * 7 / 8 / 20e9) / ONE_GPU_S
    )
    # over PCIe the token split beats TP, which all-reduces the whole sequence in every block
    names = [o.name for o in advice.options]
    assert names.index("context_parallel ulysses 8") < names.index("tensor_parallel tp 8")
    assert names[0] == "data_parallel 8"


def test_nothing_fits_says_what_to_change(flux1_dev: str) -> None:
    model = read_model(flux1_dev)
    one = advise(model, parse_gpus("1x24GB"), WIDTH, HEIGHT)
    assert not any(o.fits for o in one.options)
    room = 24 * GIB * HEADROOM - FULL_ACTIVATIONS
    assert math.ceil(WEIGHTS / room) == 2
    assert any("device_map over 2 such GPUs" in c for c in one.changes)
    assert any("fp8" in c and "would fit" in c for c in one.changes)  # 11.1 GiB + 0.8 GiB < 21.6 GiB
    assert not any("fewer pixels" in c for c in one.changes)  # the weights alone do not fit
    # 32 GiB holds the weights; 4096² needs 12.1 GiB of activations on top, and 2560² (26112 tokens) is the first
    # size down in steps of an eighth whose activations fit beside them
    big = advise(model, parse_gpus("1x32GB"), 4096, 4096)
    assert (WEIGHTS + 26112 * HIDDEN * BYTES * COPIES + VAE) <= 32 * GIB * HEADROOM
    assert (WEIGHTS + 37376 * HIDDEN * BYTES * COPIES + VAE) > 32 * GIB * HEADROOM  # 3072²
    assert "fewer pixels: 2560×2560 fits" in big.changes


def test_tiny_model_folders(tmp_path) -> None:
    from safetensors import safe_open

    for key in ("flux", "qwenimage"):
        folder = make_tiny_model(key, str(tmp_path / key))
        model = read_model(folder)
        path = os.path.join(folder, "transformer", "diffusion_pytorch_model.safetensors")
        with safe_open(path, "pt") as f:
            tensors = [f.get_tensor(k) for k in f.keys()]
        assert model.transformer_parameters == sum(t.numel() for t in tensors)
        assert model.stored_bytes["transformer"] == sum(t.numel() * t.element_size() for t in tensors)
        assert model.transformer_bytes == model.transformer_parameters * 2  # loaded in bf16 on GPUs
        advice = advise(model, parse_gpus("2x24GB,pcie,no-p2p"), 512, 512)
        assert all(o.fits for o in advice.options)
        names = {o.name for o in advice.options}
        # true CFG (Qwen-Image) adds cfg_parallel; FLUX.1 is guidance-distilled
        assert ("cfg_parallel (ulysses 1 per half)" in names) == (key == "qwenimage")


@pytest.mark.parametrize("distilled", [True, False])
def test_a_step_distilled_klein_runs_one_pass_a_step(tmp_path, distilled) -> None:
    """FLUX.2 [klein] 4B / 9B are step-distilled (model_index.json's is_distilled): one transformer pass a step, no
    cfg_parallel; their base models run true CFG, two passes, and cfg_parallel splits them."""
    from parallel_runtime.families.flux2_klein.tiny import make_tiny_model as make_tiny_klein

    model = read_model(make_tiny_klein(str(tmp_path / "klein"), distilled=distilled))
    assert model.passes == (1 if distilled else 2)
    advice = advise(model, parse_gpus("2x24GB,pcie"), 512, 512)
    assert ("cfg_parallel (ulysses 1 per half)" in {o.name for o in advice.options}) is not distilled
    assert ("× 2 passes (true CFG)" in advice.text()) is not distilled


# Wan 2.1 I2V 14B, as its diffusers folder is published (Wan-AI/Wan2.1-I2V-14B-480P-Diffusers): the transformer's
# config, and the parameters of each component (counted on the meta device from the published configs: the transformer,
# UMT5-XXL's encoder, the CLIP ViT-H/14 image encoder, the VAE), stored in bf16.
WAN21_I2V = {
    "_class_name": "WanTransformer3DModel",
    "patch_size": [1, 2, 2],
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 36,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": 1280,
    "added_kv_proj_dim": 5120,
    "rope_max_seq_len": 1024,
}
CLIP_VIT_H = {"_class_name": "CLIPVisionModel", "image_size": 224, "patch_size": 14, "hidden_size": 1280}
I2V_LOADED = {"vae": 126_892_531, "image_encoder": 630_766_080}  # what Wan 2.1 I2V's denoise loads
WAN21_I2V_PARAMETERS = {"transformer": 16_394_878_784, "text_encoder": 5_680_910_336, **I2V_LOADED}


def write_wan21_i2v(folder: str) -> str:
    """A Wan 2.1 I2V 14B-sized diffusers folder: each component one tensor of its size (sparse: no disk)."""
    counts = WAN21_I2V_PARAMETERS
    for component in counts:
        os.makedirs(os.path.join(folder, component))
    with open(os.path.join(folder, "model_index.json"), "w") as f:
        json.dump({"_class_name": "WanImageToVideoPipeline"}, f)
    for component, component_config in (
        ("transformer", WAN21_I2V),
        ("vae", {"_class_name": "AutoencoderKLWan", "base_dim": 96}),
        ("image_encoder", CLIP_VIT_H),
    ):
        with open(os.path.join(folder, component, "config.json"), "w") as f:
            json.dump(component_config, f)
    for component, count in counts.items():
        write_sparse_safetensors(os.path.join(folder, component, "model.safetensors"), {"all": ("BF16", [count])})
    return folder


def test_an_image_to_video_folder_counts_what_its_denoise_loads(tmp_path) -> None:
    """Wan 2.1 I2V's denoise loads the VAE and the CLIP image encoder beside the transformer on every GPU that runs it
    (a second VAE beside the one that stays for the decode), and the encoder's 257 tokens (ViT-H/14 at 224²: 16 × 16
    patches and the class token) join the text's 512: the advisor counts both, as the ranks' check does, where the
    same folder read as text-to-video (as the advisor read it before) counts neither."""
    import dataclasses

    from parallel_runtime.families import family

    model = read_model(write_wan21_i2v(str(tmp_path / "Wan2.1-I2V-14B-480P")))
    loaded = sum(I2V_LOADED.values()) * BYTES  # 1.4 GiB
    assert model.family.key == "wan_i2v" and model.denoise_components == ("vae", "image_encoder")
    assert model.denoise_bytes == loaded and model.context_tokens == 257
    width, height, box = 832, 480, parse_gpus("2x80GB,nvlink")
    per_token = 40 * 128 * BYTES * COPIES
    tokens = (width // 16) * (height // 16) + 512 + 257  # one frame: the advisor sizes images
    weights = WAN21_I2V_PARAMETERS["transformer"] * BYTES
    options = _by_name(advise(model, box, width, height))
    for name, split in (("one GPU", 1), ("context_parallel ulysses 2", 2), ("cfg_parallel (ulysses 1 per half)", 1)):
        option = options[name]
        assert option.activations == math.ceil(tokens / split) * per_token, name
        # The denoise is the largest stage: the transformer, its step, the VAE that stays and what the denoise loads.
        assert option.peak == weights + option.activations + I2V_LOADED["vae"] * BYTES + loaded, name
    as_t2v = _by_name(advise(dataclasses.replace(model, family=family("wan"), context_tokens=0), box, width, height))
    grew = options["one GPU"].peak - as_t2v["one GPU"].peak
    assert grew == loaded + 257 * per_token
    text = advise(model, box, width, height).text()
    assert "vae and image_encoder loaded in the denoise 1.4 GiB" in text and "257 image-encoder tokens" in text


def test_a_clip_counts_every_latent_frames_tokens(tmp_path, flux1_dev: str) -> None:
    """A video model's advice is for the clip ParallelSampler's length makes: 81 frames are 21 latent frames, each
    with its 16-pixel patches, every one of them in every step's activations; a length the VAE cannot make, or a clip
    of an image model, is refused by name."""
    model = read_model(write_wan21_i2v(str(tmp_path / "Wan2.1-I2V-14B-480P")))
    width, height, box = 832, 480, parse_gpus("8x80GB,nvlink")
    per_token = 40 * 128 * BYTES * COPIES
    text = 512 + 257
    for length, latent_frames in ((1, 1), (81, 21)):
        option = _by_name(advise(model, box, width, height, length))["context_parallel ulysses 8"]
        tokens = (width // 16) * (height // 16) * latent_frames + text
        assert option.activations == math.ceil(tokens / 8) * per_token, length
    assert "at 832×480 × 81 frames:" in advise(model, box, width, height, 81).text()
    with pytest.raises(InvalidInput, match=r"^length: 80 frames is not 4k \+ 1 .* use 77 or 81"):
        advise(model, box, width, height, 80)
    with pytest.raises(InvalidInput, match=r"^length: 5 frames, but FLUX.1 makes images; set length to 1"):
        advise(read_model(flux1_dev), box, WIDTH, HEIGHT, 5)


def test_two_experts_count_both(tmp_path) -> None:
    """Wan 2.2 A14B's two experts stay resident together (the steps switch between them): the advisor counts both
    experts' weights on the GPUs, and one expert's parameters in a step's compute."""
    folder = write_wan21_i2v(str(tmp_path / "Wan2.2-I2V-A14B"))
    one = read_model(folder)
    expert = os.path.join(folder, "transformer_2")
    os.makedirs(expert)
    count = WAN21_I2V_PARAMETERS["transformer"]
    write_sparse_safetensors(os.path.join(expert, "model.safetensors"), {"all": ("BF16", [count])})  # no disk
    two = read_model(folder)
    assert two.experts == ("transformer", "transformer_2") and one.experts == ("transformer",)
    assert two.transformer_bytes == 2 * one.transformer_bytes == 2 * WAN21_I2V_PARAMETERS["transformer"] * BYTES
    box = parse_gpus("8x80GB,nvlink")
    ones, twos = (_by_name(advise(m, box, 832, 480, 81)) for m in (one, two))
    assert twos["one GPU"].weights == 2 * ones["one GPU"].weights
    assert twos["one GPU"].relative == ones["one GPU"].relative == 1.0  # a step runs one expert
    assert "2 experts resident together" in advise(two, box, 832, 480, 81).text()


def test_fp8_files_are_held_as_stored(tmp_path, flux1_dev: str) -> None:
    """The pack holds a transformer's fp8 weights in fp8 (the weights widget's default, "as stored"), so on the GPUs an
    fp8 file takes its stored bytes, half of a bf16 model's, and fits where the bf16 one would not."""
    model = read_model(write_flux1_dev(str(tmp_path / "fp8"), "F8_E4M3"))
    assert model.stored_bytes["transformer"] == TRANSFORMER_PARAMETERS
    assert model.stored_dtypes["transformer"] == ("F8_E4M3",)
    assert model.transformer_bytes == TRANSFORMER_PARAMETERS == WEIGHTS // 2
    box = parse_gpus("2x24GB,pcie,no-p2p")
    fp8 = {o.name: o.weights for o in advise(model, box, WIDTH, HEIGHT).options}
    bf16 = {o.name: o.weights for o in advise(read_model(flux1_dev), box, WIDTH, HEIGHT).options}
    assert fp8.keys() == bf16.keys() and all(fp8[s] < bf16[s] for s in fp8), (fp8, bf16)


@pytest.mark.parametrize(
    "text",
    ["24GB", "2x24GB", "2x24GB,nvlink,no-p2p", "2x24GB,pcie,nvlink", "2x24GB,pcie,fast", "2x24GB,pcie,bw=x"],
)
def test_bad_gpus_name_the_option_and_the_syntax(text: str) -> None:
    with pytest.raises(InvalidInput) as e:
        parse_gpus(text)
    assert e.value.widget == "--gpus"


def test_the_command(flux1_dev: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "parallel_runtime.cli", "advise", "--model", flux1_dev, "--gpus", "2x24GB,pcie,no-p2p"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("FLUX.1-dev (FLUX.1) at 1024×1024: transformer 22.2 GiB (11.90 B parameters)")
    table = lines[lines.index(next(line for line in lines if line.startswith("strategy"))) + 1 :]
    assert table[0].startswith("device_map over 2 GPUs") and table[1].startswith("tensor_parallel tp 2")
    assert "basis:" in lines
    bad = subprocess.run(
        [sys.executable, "-m", "parallel_runtime.cli", "advise", "--model", flux1_dev, "--gpus", "lots"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "--gpus" in bad.stderr


def test_a_doctor_report_gives_the_measured_box() -> None:
    """What ``comfy-parallel doctor`` reports on two GPUs (its report's shape, written out) becomes the box: the
    smaller GPU, the slower pair; a report from CPU ranks or a failed check is refused naming ``--gpus``."""
    ranks = [{"memory_total_gib": 79.1}, {"memory_total_gib": 80.0}]
    pair = {"kind": "collective", "nbytes": 64 << 20, "peer_access": None}
    peers = [{**pair, "seconds": 0.01}, {**pair, "seconds": 0.02}, {"kind": "copy", "peer_access": False}]
    report = {"ok": True, "device": "cuda", "ranks": ranks, "peers": peers, "errors": []}
    box = measured_box(report)
    assert (box.gpus, box.memory, box.p2p, box.measured) == (2, int(79.1 * GIB), False, True)
    assert box.bandwidth == (64 << 20) / 0.02
    for bad in ({**report, "device": "cpu"}, {**report, "ok": False, "errors": ["all-reduce: hung"]}):
        with pytest.raises(InvalidInput) as e:
            measured_box(bad)
        assert e.value.widget == "--gpus"


# -- ComfyUI's single files ------------------------------------------------------------------------------------------
def _file_sizes(path: str) -> tuple[int, int]:
    """A safetensors file's weights, counted here: (parameters, stored bytes), without ComfyUI's fp8 scales."""
    from safetensors import safe_open

    parameters = stored = 0
    with safe_open(path, "pt") as f:
        for key in f.keys():
            if key.endswith(".scale_weight") or key.endswith(".scale_input") or key == "scaled_fp8":
                continue
            tensor = f.get_tensor(key)
            parameters += tensor.numel()
            stored += tensor.numel() * tensor.element_size()
    return parameters, stored


@pytest.fixture()
def comfy_models(comfyui_files_dir, monkeypatch) -> str:
    monkeypatch.setenv("COMFY_PARALLEL_COMFY_MODELS", str(comfyui_files_dir))
    return str(comfyui_files_dir)


def test_comfyui_files_are_measured_from_their_headers(tiny_comfy_files, comfy_models) -> None:
    """The tiny FLUX.1's ComfyUI files (bf16, fp8, scaled fp8) measure as their tensors count here, and as the diffusers
    folder holding the same weights does; the bf16 one gets the same advice as that folder; nothing is converted."""
    from parallel_runtime.advisor import read_files
    from parallel_runtime.comfy_files import resolve

    converted = os.path.join(comfy_models, "converted")
    # The models folder is the session's: other modules' tests may have converted files into it before this one.
    before = sorted(os.listdir(converted)) if os.path.exists(converted) else None
    box = parse_gpus("2x24GB,pcie,no-p2p")
    for fmt, (widgets, reference) in tiny_comfy_files.items():
        model = read_files(
            widgets["diffusion_model"], widgets["text_encoder"], widgets["text_encoder_2"], widgets["vae"]
        )
        folder = read_model(reference)
        parameters, stored = _file_sizes(resolve("diffusion_model", widgets["diffusion_model"], "diffusion_model"))
        assert model.name == widgets["diffusion_model"] and model.family.key == "flux"
        assert model.parameters["transformer"] == parameters == folder.parameters["transformer"]
        assert model.stored_bytes["transformer"] == stored
        for role in ("text_encoder", "text_encoder_2", "vae"):
            assert model.parameters[role] == _file_sizes(resolve(role, widgets[role], role))[0], role
        assert model.parameters["vae"] == folder.parameters["vae"]
        if fmt == "bf16":
            assert model.transformer_bytes == 2 * parameters
            assert advise(model, box, 512, 512).options == advise(folder, box, 512, 512).options
        else:  # fp8 held as stored: one byte a matrix element, the norms and biases as the file has them
            assert model.transformer_bytes == stored < 2 * parameters
            assert "F8_E4M3" in model.stored_dtypes["transformer"]
    assert (sorted(os.listdir(converted)) if os.path.exists(converted) else None) == before  # nothing converted


def test_a_gguf_file_counts_its_size_and_shares_it_under_tensor_parallel(tiny_comfy_files, comfy_models) -> None:
    from safetensors.torch import load_file

    from parallel_runtime.advisor import read_files
    from parallel_runtime.comfy_files import resolve
    from parallel_runtime.families.tiny import write_gguf

    widgets, _ = tiny_comfy_files["bf16"]
    source = resolve("diffusion_model", widgets["diffusion_model"], "diffusion_model")
    path = os.path.join(comfy_models, "diffusion_models", "advisor-tiny-flux-Q8_0.gguf")
    write_gguf(load_file(source), path, "flux", "Q8_0")
    try:
        model = read_files(os.path.basename(path), widgets["text_encoder"], widgets["text_encoder_2"], widgets["vae"])
        assert model.gguf and model.transformer_bytes == os.path.getsize(path)
        assert model.parameters["transformer"] == _file_sizes(source)[0]  # the shapes are the model's, unpacked
        advice = advise(model, parse_gpus("4x80GB,nvlink"), 512, 512)
        options = {o.name: o for o in advice.options}
        assert {"device_map over 4 GPUs", "data_parallel 4"} <= set(options)
        # Each tensor-parallel rank holds its share of the packed file (the slices of the planned layers; the tiny
        # model's 2 heads split over 2 GPUs).
        options = {o.name: o for o in advise(model, parse_gpus("2x80GB,nvlink"), 512, 512).options}
        assert options["tensor_parallel tp 2"].weights < model.transformer_bytes == options["data_parallel 2"].weights
    finally:
        os.remove(path)


def test_the_command_on_comfyui_files(tiny_comfy_files, comfy_models, capsys) -> None:
    """``advise`` with ParallelModelFromComfyFiles' widgets as options (in-process: the command's own entry point)."""
    from parallel_runtime.cli import main

    widgets, _ = tiny_comfy_files["fp8"]
    command = ["advise", "--comfy-models", comfy_models, "--width", "512", "--height", "512", "--gpus", "2x24GB,pcie"]
    files = [f"--{w.replace('_', '-')}={widgets[w]}" for w in ("diffusion_model", "text_encoder", "vae")]
    assert main([*command, *files, "--text-encoder-2", widgets["text_encoder_2"]]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{widgets['diffusion_model']} (FLUX.1) at 512×512:")
    assert "F8_E4M3" in out.splitlines()[0]
    assert main([*command, "--diffusion-model", widgets["vae"]]) == 2
    assert "diffusion_model" in capsys.readouterr().err  # a VAE picked as the transformer, named by its widget
    with pytest.raises(SystemExit) as e:
        main([*command, *files, "--model", "x"])
    assert e.value.code == 2 and "--model" in capsys.readouterr().err


# -- in ComfyUI ------------------------------------------------------------------------------------------------------
def test_the_advisor_node_in_comfyui(comfyui_server, comfyui_models_dir) -> None:
    """ParallelAdvisor in a real ComfyUI: the advice of a tiny model on declared GPUs, shown on the node (its UI text)
    and as its output, the same text as the command's; with no GPUs declared on a CPU backend, the prompt is refused
    before it queues, naming ``gpus``."""
    from comfyui_host import PromptRejected

    folder = make_tiny_model("flux", str(comfyui_models_dir / "advisor-tiny-flux"))
    inputs = {"model": "advisor-tiny-flux", "width": 512, "height": 256, "gpus": "2x24GB,pcie,no-p2p"}
    prompt_id, _ = comfyui_server.run({"1": {"class_type": "ParallelAdvisor", "inputs": inputs}})
    shown = comfyui_server.history(prompt_id, timeout=10)["outputs"]["1"]["text"]
    assert shown == [advise(read_model(folder), parse_gpus(inputs["gpus"]), 512, 256).text()]
    assert shown[0].startswith("advisor-tiny-flux (FLUX.1) at 512×256:")
    with pytest.raises(PromptRejected) as e:
        comfyui_server.post_prompt({"1": {"class_type": "ParallelAdvisor", "inputs": {**inputs, "gpus": ""}}})
    assert "gpus" in json.dumps(e.value.node_errors["1"]) and "runs on CPU" in json.dumps(e.value.node_errors["1"])
