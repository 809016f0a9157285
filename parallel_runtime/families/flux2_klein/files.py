"""FLUX.2 [klein] as ComfyUI distributes it: three files, and the diffusers folder they make.

- the transformer (``flux-2-klein-4b.safetensors``, ``flux-2-klein-9b.safetensors``, their ``-base-`` and fp8
  versions, in ``models/diffusion_models``): FLUX.2's Black Forest Labs layout (``flux2/files.py``) without the
  guidance embedding (``guidance_in``), narrower and shallower than FLUX.2-dev's. [klein] 4B: 3072 wide, 5 double and
  20 single blocks, text 7680 wide (3 × Qwen3-4B's 2560); 9B: 4096 wide, 8 and 24 blocks, text 12288 wide (3 ×
  Qwen3-8B's 4096); FLUX.2-dev: 6144 wide, 8 and 48 blocks, text 15360 wide. FLUX.2-dev's layout takes a file with
  ``guidance_in``, this one a file without; the text width names the variant;
- the text encoder, Qwen3-4B ([klein] 4B) or Qwen3-8B (9B), the language model in transformers' key names
  (``model.layers.N...``, per-head ``q_norm`` / ``k_norm``: ``qwen_3_4b.safetensors`` / ``qwen_3_8b.safetensors``, or
  their fp8 versions, in ``models/text_encoders``), linked as it is into a transformers ``Qwen3Model`` (the pipeline
  only reads hidden states 9, 18 and 27, so no language head is made up);
- FLUX.2's VAE (``flux2-vae.safetensors``), converted as FLUX.2's.

The tokenizer is ComfyUI's own copy of Qwen's (``comfy/text_encoders/qwen25_tokenizer``, the vocabulary Qwen3 shares),
with Qwen3's chat template, which the pipeline renders with thinking off (ComfyUI's ``KleinTokenizer`` writes the
same text).

The weights do not tell a step-distilled [klein] (4 steps, no guidance) from its base model (about 50 steps with CFG):
their shapes are equal. The file's name does, as ComfyUI distributes them (``-base-``): the folder's ``is_distilled``
follows it, and the node's text says which was taken.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from ...errors import InvalidInput
from ..files import Component, FilesContents, FilesLayout, Shapes, SourceHeader, Tokenizer, count
from ..flux2 import files as flux2_files

# Flux2KleinPipeline's hidden states (``text_encoder_out_layers``): a text encoder of more layers than the last read,
# so that it is not the final-normalised one.
HIDDEN_STATES_LAYERS = (9, 18, 27)

# Qwen3's (Qwen/Qwen3-4B's and -8B's config; ComfyUI's ``Qwen3_4BConfig`` / ``Qwen3_8BConfig``): what the weights do not
# say. The head width is in them (the per-head q_norm).
QWEN3_ROPE_THETA = 1_000_000.0
QWEN3_RMS_NORM_EPS = 1e-6
QWEN3_MAX_POSITIONS = 40960

# Qwen3's chat template for what Flux2KleinPipeline sends (one user message, the generation prompt, thinking off; the
# real one also handles tools, reasoning turns and the system message's defaults). The tiny pipeline uses it too.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

TOKENIZER = Tokenizer(
    "tokenizer",
    "text_encoders/qwen25_tokenizer",
    ("vocab.json", "merges.txt", "tokenizer_config.json"),
    chat_template=CHAT_TEMPLATE,
)

# The variants by the transformer's text width (3 stacked Qwen3 hidden states): ComfyUI's own names.
VARIANTS = {3 * 2560: "FLUX.2 [klein] 4B", 3 * 4096: "FLUX.2 [klein] 9B"}


def model_index(distilled: bool) -> dict:
    return {
        "_class_name": "Flux2KleinPipeline",
        "_diffusers_version": "0.42.1",
        "is_distilled": distilled,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        # The language model alone (see the module's docstring); the pipeline's annotation names Qwen3ForCausalLM.
        "text_encoder": ["transformers", "Qwen3Model"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }


def is_qwen3(shapes: Shapes) -> bool:
    """Qwen3's language model in transformers' names: Mistral's keys and per-head q / k norms."""
    return "model.embed_tokens.weight" in shapes and "model.layers.0.self_attn.q_norm.weight" in shapes


def qwen3_config(shapes: Shapes) -> dict:
    """``Qwen3Model``'s config at the file's sizes."""
    vocab, hidden = shapes["model.embed_tokens.weight"]
    (head_dim,) = shapes["model.layers.0.self_attn.q_norm.weight"]
    return {
        "architectures": ["Qwen3Model"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": shapes["model.layers.0.mlp.gate_proj.weight"][0],
        "num_hidden_layers": count(shapes, r"model\.layers\.(\d+)\."),
        "num_attention_heads": shapes["model.layers.0.self_attn.q_proj.weight"][0] // head_dim,
        "num_key_value_heads": shapes["model.layers.0.self_attn.k_proj.weight"][0] // head_dim,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": QWEN3_MAX_POSITIONS,
        "rms_norm_eps": QWEN3_RMS_NORM_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": QWEN3_ROPE_THETA},
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }


class Flux2KleinFiles(FilesLayout):
    """FLUX.2 [klein] 4B / 9B: the BFL transformer without guidance embedding, Qwen3 (``text_encoder``), FLUX.2's
    VAE."""

    family = "flux2_klein"
    name = "FLUX.2 [klein]"
    text_encoder_widgets = ("text_encoder",)
    variants = "FLUX.2 [klein] 4B and 9B (distilled and base)"
    transformer_layout = "in Black Forest Labs' layout"
    # FLUX.2's: the same transformer layout (no tiny [klein] GGUF is tested).
    gguf_architectures = flux2_files.Flux2Files.gguf_architectures
    widget_files: ClassVar[Mapping[str, str]] = {
        "diffusion_model": "flux-2-klein-4b.safetensors",
        "text_encoder": "Qwen3 (qwen_3_4b.safetensors for [klein] 4B, qwen_3_8b.safetensors for 9B)",
        "vae": "flux2-vae.safetensors",
    }

    def variant(self, shapes: Shapes) -> str | None:
        if not flux2_files.is_transformer(shapes) or "guidance_in.in_layer.weight" in shapes:
            return None
        return VARIANTS.get(shapes["txt_in.weight"][1], self.name) if "txt_in.weight" in shapes else self.name

    def contents(
        self,
        variant: str,
        transformer: SourceHeader,
        text_encoders: list[SourceHeader],
        vae: SourceHeader,
        transformer_2: SourceHeader | None = None,
    ) -> FilesContents:
        (text_encoder,) = text_encoders
        if not is_qwen3(text_encoder.shapes):
            raise InvalidInput(
                text_encoder.widget,
                f"{text_encoder.name!r} is not Qwen3's language model; {self.name} takes qwen_3_4b.safetensors "
                "([klein] 4B) or qwen_3_8b.safetensors (9B), or their fp8 versions, from models/text_encoders",
            )
        layers = count(text_encoder.shapes, r"model\.layers\.(\d+)\.")
        if layers <= HIDDEN_STATES_LAYERS[-1]:
            raise InvalidInput(
                text_encoder.widget,
                f"{text_encoder.name!r} has {layers} layers, but {self.name} reads the hidden state after layer "
                f"{HIDDEN_STATES_LAYERS[-1]}, before the last layer's; pick the whole Qwen3 file (36 layers)",
            )
        configs, moves = flux2_files.checked_configs(
            self.name,
            transformer,
            text_encoder,
            qwen3_config,
            vae,
            f"pick the Qwen3 of {VARIANTS.get(transformer.shapes['txt_in.weight'][1], variant)} "
            "(qwen_3_4b.safetensors for [klein] 4B, qwen_3_8b.safetensors for 9B)",
        )
        # Equal shapes: the name tells the base model from the distilled one (see the module's docstring).
        distilled = "base" not in transformer.name.lower()
        return FilesContents(
            variant=variant if distilled else variant.replace("[klein]", "[klein] base"),
            model_index=model_index(distilled),
            scheduler=flux2_files.SCHEDULER,
            tokenizers=(TOKENIZER,),
            components=(
                # Linked as it is (transformers' own names).
                Component("text_encoder", text_encoder, configs["text_encoder"], weights="model.safetensors"),
                Component("transformer", transformer, configs["transformer"], moves=tuple(moves)),
                Component("vae", vae, configs["vae"], convert=flux2_files.vae_converter(configs["vae"])),
            ),
            text_encoders=(text_encoder,),
        )
