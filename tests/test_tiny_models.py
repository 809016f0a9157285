"""The tiny offline pipelines: safetensors only, small, deterministic, and loadable by the real pipeline classes."""

from pathlib import Path

import pytest
import torch
from diffusers import (
    DiffusionPipeline,
    Flux2KleinPipeline,
    Flux2Pipeline,
    FluxKontextPipeline,
    FluxPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    WanImageToVideoPipeline,
    WanPipeline,
)
from PIL import Image

from parallel_runtime.families import REGISTRY, family
from parallel_runtime.families.tiny import family_tiny

PIPELINE_CLASSES = {
    "flux": FluxPipeline,
    "flux_kontext": FluxKontextPipeline,
    "flux2": Flux2Pipeline,
    "flux2_klein": Flux2KleinPipeline,
    "qwenimage": QwenImagePipeline,
    "qwenimage_edit": QwenImageEditPlusPipeline,
    "wan": WanPipeline,
    "wan_i2v": WanImageToVideoPipeline,
    "wan_ti2v": WanPipeline,  # with expand_timesteps
}
TINY_MODELS = {adapter.key: family_tiny(adapter.key).make_tiny_model for adapter in REGISTRY}


def files(model_dir: str) -> dict[str, bytes]:
    root = Path(model_dir)
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def built(request, tmp_path_factory) -> tuple[str, str]:
    name = request.param
    return name, TINY_MODELS[name](str(tmp_path_factory.mktemp(name)), 0)


def test_every_family_has_a_tiny_model_of_its_pipeline():
    assert set(TINY_MODELS) == set(PIPELINE_CLASSES)
    assert all(PIPELINE_CLASSES[key].__name__ == family(key).pipeline for key in PIPELINE_CLASSES)


def test_safetensors_only_and_small(built):
    _, model_dir = built
    contents = files(model_dir)
    weights = [name for name in contents if name.endswith((".safetensors", ".bin", ".pt", ".pth", ".ckpt"))]
    assert weights and all(name.endswith(".safetensors") for name in weights)
    assert sum(len(data) for data in contents.values()) < 5 * 2**20


def test_same_seed_same_bytes_other_seed_other_weights(built, tmp_path):
    name, model_dir = built
    assert files(TINY_MODELS[name](str(tmp_path / "again"), 0)) == files(model_dir)
    other = files(TINY_MODELS[name](str(tmp_path / "other"), 1))
    assert other.keys() == files(model_dir).keys()
    assert (
        other["transformer/diffusion_pytorch_model.safetensors"]
        != files(model_dir)["transformer/diffusion_pytorch_model.safetensors"]
    )


def test_loads_and_generates(built):
    name, model_dir = built
    pipe = DiffusionPipeline.from_pretrained(model_dir)
    assert type(pipe) is PIPELINE_CLASSES[name]
    pipe.set_progress_bar_config(disable=True)
    video = {"num_frames": 5} if name.startswith("wan") else {}  # a clip of 5 frames: 2 latent frames
    # Wan 2.1 I2V: a start image, and the text at 512 tokens (the image tokens are what precedes the last 512).
    start = {"image": Image.new("RGB", (48, 32), "red")} if name == "wan_i2v" else {}
    # FluxKontextPipeline scales any size to its max_area (a megapixel by default).
    area = {"max_area": 48 * 32} if name == "flux_kontext" else {}
    # QwenImageEditPlusPipeline needs its image (its text encoder sees it through the tiny model's processor).
    edited = {"image": Image.new("RGB", (24, 16), (200, 30, 90))} if name == "qwenimage_edit" else {}
    width = 64 if name == "wan_ti2v" else 48  # Wan 2.2 TI2V-5B's tokens are 32 pixels wide
    output = pipe(
        prompt="a photo of a cat",
        width=width,
        height=32,
        **area,
        **edited,
        # Not 1: Qwen-Image's `shift_terminal` stretch divides by zero on a single-step schedule (NaN image).
        num_inference_steps=2,
        max_sequence_length=512 if start else 64,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="pt",
        **video,
        **start,
    )
    image = output.frames[:, 0] if video else output.images
    assert image.shape == (1, 3, 32, width)
    assert torch.isfinite(image).all()


@pytest.mark.parametrize(
    "key, prompt, first",
    [
        ("qwenimage", "a photo of a cat", "a"),  # 34 tokens dropped
        ("qwenimage_edit", "Picture 1: a photo of a cat", "P"),  # 64 dropped; the images' "Picture n: ..." come first
    ],
)
def test_qwen_template_prefix_is_the_dropped_tokens(tmp_path, key, prompt, first):
    model_dir = TINY_MODELS[key](str(tmp_path), 0)
    pipe = PIPELINE_CLASSES[key].from_pretrained(model_dir, transformer=None, vae=None, text_encoder=None)
    ids = pipe.tokenizer(pipe.prompt_template_encode.format(prompt)).input_ids
    tokens = pipe.tokenizer.convert_ids_to_tokens(ids)
    # The pipelines keep the hidden states from `prompt_template_encode_start_idx` on: what the user part holds.
    assert tokens[pipe.prompt_template_encode_start_idx] == first
    assert tokens[pipe.prompt_template_encode_start_idx - 1] == "Ċ"  # the newline after "user"
