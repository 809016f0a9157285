"""Test-only ComfyUI nodes, linked into the tests' ComfyUI server beside the pack (never shipped: tests/ is not the
pack's node code): ComfyUI's own loaders for the tests' tiny models in ComfyUI's file layouts.

ComfyUI's DualCLIPLoader and VAELoader build the full-size architectures from fixed configs (CLIP-L 768 wide, T5-XXL
4096 wide, a 128-channel VAE), so they cannot load a tiny file. These nodes run the same ComfyUI code on the tiny
file with the config reduced to the tiny model's (read from its diffusers folder):

- TinyDualCLIPLoader: ``comfy.sd.load_clip`` exactly as DualCLIPLoader calls it, plus ComfyUI's own per-model config
  override (``model_options["<name>_model_config"]``, which ``comfy.sd1_clip.SDClipModel`` applies) and float32;
  the tokenizers are ComfyUI's own (the tiny files use their vocabularies).
- TinyQwenImageCLIPLoader: what CLIPLoader (type qwen_image) builds for a Qwen2.5-VL file — ComfyUI's
  ``qwen_image.te`` model and ``QwenImageTokenizer`` in a ``comfy.sd.CLIP`` — on the tiny text config, float32.
  CLIPLoader itself cannot take the tiny file: ``comfy.sd.detect_te_model`` tells Qwen2.5-VL 7B by its four 128-wide
  key/value heads (the tiny model has one) and the config is the 7B's. ComfyUI's model also builds a fixed 1280-wide
  vision tower (~630M parameters), which the tiny file's narrower one cannot fill: the file's ``visual.*`` weights stay
  out and ComfyUI's tower stays as built, uninitialised and never run — only the text path runs for a prompt without
  an image (CLIPTextEncode, TextEncodeQwenImageEdit without one).
- TinyVAELoader: ``comfy.sd.VAE`` with an explicit config (ComfyUI's AutoencoderKL on the tiny VAE's channels and
  blocks); FLUX.1's VAE has no quant convs, which ComfyUI's AutoencoderKL always has: they are given as identity 1×1
  convolutions, exactly what their absence means. FLUX.2's file (BFL's layout: quant convs inside the encoder and
  decoder, batch-norm statistics) gets what ``comfy.sd.VAE``'s own detection gives it: the quant convs renamed, the
  batch-norm latent (2×2 patches normalised: 4× the channels, a 16× downscale).
"""

from __future__ import annotations

import json
import os

import comfy.sd
import comfy.supported_models_base
import comfy.text_encoders.qwen_image
import comfy.utils
import folder_paths
import torch


def _config(folder: str, part: str) -> dict:
    with open(os.path.join(folder, part, "config.json")) as f:
        return json.load(f)


class TinyDualCLIPLoader:
    @classmethod
    def INPUT_TYPES(cls):
        names = folder_paths.get_filename_list("text_encoders")
        return {
            "required": {
                "clip_name1": (names,),
                "clip_name2": (names,),
                "type": (["flux"],),
                "config_folder": ("STRING", {"default": ""}),
            }
        }

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load_clip"
    CATEGORY = "testing"

    def load_clip(self, clip_name1, clip_name2, type, config_folder):
        clip, t5 = _config(config_folder, "text_encoder"), _config(config_folder, "text_encoder_2")
        clip_l = {
            key: clip[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
        }
        options = {
            "dtype": torch.float32,
            # SDClipModel reads "<its model name>_model_config": "t5xxl" for T5. CLIP-L's ("clip_l") is rebuilt by
            # load_clip's long-CLIP check from "model_config" plus the file's position count.
            "model_config": clip_l,
            "t5xxl_model_config": {key: t5[key] for key in ("d_ff", "d_kv", "d_model", "num_heads", "num_layers")},
        }
        paths = [folder_paths.get_full_path_or_raise("text_encoders", name) for name in (clip_name1, clip_name2)]
        return (comfy.sd.load_clip(ckpt_paths=paths, clip_type=comfy.sd.CLIPType.FLUX, model_options=options),)


class TinyQwenImageCLIPLoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "clip_name": (folder_paths.get_filename_list("text_encoders"),),
                "config_folder": ("STRING", {"default": ""}),
            }
        }

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load_clip"
    CATEGORY = "testing"

    def load_clip(self, clip_name, config_folder):
        text = _config(config_folder, "text_encoder")["text_config"]
        sd = comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise("text_encoders", clip_name))
        sd = {key: value for key, value in sd.items() if not key.startswith("visual.")}
        # QwenImageTEModel's SDClipModel reads "qwen25_7b_model_config"; head_dim (128) and the rotary sections are
        # the 7B's in ComfyUI's config class, as in the tiny model. te(dtype_llama=...) is how load_clip passes the
        # file's dtype; float32 here, as the pack's encoder runs on the CPU.
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        options = {"dtype": torch.float32, "qwen25_7b_model_config": {key: text[key] for key in keys}}
        target = comfy.supported_models_base.ClipTarget(
            comfy.text_encoders.qwen_image.QwenImageTokenizer,
            comfy.text_encoders.qwen_image.te(dtype_llama=torch.float32),
        )
        clip = comfy.sd.CLIP(target, parameters=comfy.utils.calculate_parameters(sd), model_options=options)
        missing, unexpected = clip.load_sd(sd)
        text_missing = [key for key in missing if not key.startswith("visual.")]
        if text_missing or unexpected:
            raise ValueError(f"the tiny Qwen2.5-VL file does not fit: missing {text_missing}, unexpected {unexpected}")
        return (clip,)


class TinyVAELoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "vae_name": (folder_paths.get_filename_list("vae"),),
                "config_folder": ("STRING", {"default": ""}),
            }
        }

    RETURN_TYPES = ("VAE",)
    FUNCTION = "load_vae"
    CATEGORY = "testing"

    def load_vae(self, vae_name, config_folder):
        config = _config(config_folder, "vae")
        channels, widths = config["latent_channels"], config["block_out_channels"]
        sd = comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise("vae", vae_name))
        sd = comfy.utils.state_dict_prefix_replace(
            sd, {"decoder.post_quant_conv.": "post_quant_conv.", "encoder.quant_conv.": "quant_conv."}
        )
        identity = torch.eye(2 * channels).reshape(2 * channels, 2 * channels, 1, 1)
        sd.setdefault("quant_conv.weight", identity)
        sd.setdefault("quant_conv.bias", torch.zeros(2 * channels))
        sd.setdefault("post_quant_conv.weight", torch.eye(channels).reshape(channels, channels, 1, 1))
        sd.setdefault("post_quant_conv.bias", torch.zeros(channels))
        ddconfig = {
            "double_z": True,
            "z_channels": channels,
            "resolution": 256,
            "in_channels": 3,
            "out_ch": 3,
            "ch": widths[0],
            "ch_mult": [width // widths[0] for width in widths],
            "num_res_blocks": config["layers_per_block"],
            "attn_resolutions": [],
            "dropout": 0.0,
            "batch_norm_latent": "bn.running_mean" in sd,
        }
        vae = comfy.sd.VAE(sd=sd, config={"params": {"ddconfig": ddconfig, "embed_dim": channels}}, dtype=torch.float32)
        vae.latent_channels = channels
        if ddconfig["batch_norm_latent"]:
            vae.latent_channels *= 4
            vae.downscale_ratio *= 2
            vae.upscale_ratio *= 2
        return (vae,)


NODE_CLASS_MAPPINGS = {
    "TinyDualCLIPLoader": TinyDualCLIPLoader,
    "TinyQwenImageCLIPLoader": TinyQwenImageCLIPLoader,
    "TinyVAELoader": TinyVAELoader,
}
