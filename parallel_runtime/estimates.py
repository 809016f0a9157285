"""What a denoise holds and moves per step, from the transformer's shape, the size and the plan: the one home of the
arithmetic that the ranks' memory checks (``worker/memory.py``), the strategy advisor (``advisor.py``) and
``bench/network.py`` share. Plain numbers in, bytes out: no torch, no device.

Memory (measured on the tiny models in fp32 on CPU: peak RSS growth over the loaded model, 1024² to 2048²):

- a transformer step holds about ``ACTIVATION_COPIES`` copies of the hidden state per token at its peak (q, k, v, the
  attention output, the MLP's 4× hidden layer, norms and modulation; measured 28 to 31). Context parallelism splits
  the tokens over its degree; tensor parallelism splits everything but the residual stream
  (``TP_REPLICATED_COPIES``); data parallelism gives each rank its share of the batch;
- tensor parallelism splits each model's own share of its weights (its plan's layers: ``families.tp_sharded_share``),
  the rest is replicated;
- a VAE decode holds about ``VAE_COPIES`` copies of its first-level feature map per pixel (measured 5 to 7).

Traffic (bf16 activations, batch 1, one pass) in the collectives diffusers 0.42 runs, read from its code:

- Ulysses: 4 all-to-alls per attention layer (query, key, value before; the output after), each over the rank's
  slice of the whole sequence (image + text tokens × heads × head_dim); a rank sends (P-1)/P of what it holds.
- Ring: one all-gather of key and value per attention layer (``TemplatedRingAttention``): a rank sends its slice to
  each of the P-1 others.
- Tensor parallel: an all-reduce after every rowwise layer of the ``_tp_plan`` (a double-stream block: attention out
  and feed-forward out of the image and the text stream; a single-stream block: ``proj_out``), each over the whole
  sequence × hidden size; a ring all-reduce sends 2(P-1)/P of it per rank.
- Data parallel: nothing per step (each rank makes whole images; only the final latents travel).
"""

from __future__ import annotations

import math

from .gguf_files import block_shape
from .strategy import StrategyPlan

ACTIVATION_COPIES = 32
TP_REPLICATED_COPIES = 8
VAE_COPIES = 8
HEADROOM = 0.9  # of the free memory an estimate may use
BF16 = 2


def hidden_size(config: dict) -> int:
    """The transformer's hidden size (heads × head_dim) from its config.json."""
    return config["num_attention_heads"] * config["attention_head_dim"]


def activation_bytes(plan: StrategyPlan, hidden: int, tokens: int, images: int, itemsize: int) -> int:
    """Bytes a transformer step holds at its peak on one rank of ``plan`` for ``images`` of ``tokens`` each (image
    and text tokens), activations of ``itemsize`` bytes."""
    copies = ACTIVATION_COPIES
    if plan.shards_weights:
        copies = TP_REPLICATED_COPIES + (ACTIVATION_COPIES - TP_REPLICATED_COPIES) / plan.tp_degree
    return int(images * math.ceil(tokens / plan.cp_degree) * hidden * itemsize * copies)


def weights_share(plan: StrategyPlan, sharded: float) -> float:
    """The share of the transformer's weights one rank of ``plan`` holds (1: a whole replica), ``sharded`` being the
    share its tensor-parallel plan splits (``families.tp_sharded_share``)."""
    if plan.shards_weights:
        return 1 - sharded + sharded / plan.tp_degree
    return 1.0


def decode_bytes(
    decoder_channels: int, images: int, width: int, height: int, itemsize: int, copies: int | None = None
) -> int:
    """Bytes a VAE decode of ``images`` of ``width`` × ``height`` (a clip's: one frame's) holds at its peak: its
    first-level feature maps, ``copies`` of them (the family's ``decode_copies``; ``VAE_COPIES`` by default)."""
    return images * height * width * decoder_channels * itemsize * (copies or VAE_COPIES)


def step_bytes(config: dict, tokens: int, text_tokens: int, ranks: int) -> dict[str, float]:
    """Bytes each of ``ranks`` ranks sends per denoising step of one bf16 pass over ``tokens`` image and
    ``text_tokens`` text tokens, by strategy (``ulysses``, ``ring``, ``tensor_parallel``, ``data_parallel``)."""
    hidden = hidden_size(config)
    single = config.get("num_single_layers", 0)
    attention_layers = config["num_layers"] + single
    sequence = tokens + text_tokens
    share = (ranks - 1) / ranks
    slice_bytes = sequence / ranks * hidden * BF16  # one rank's slice of q, k, v or the output
    ulysses = attention_layers * 4 * slice_bytes * share
    ring = attention_layers * 2 * slice_bytes * (ranks - 1)
    reduced = (config["num_layers"] * 2 + single) * sequence * hidden * BF16
    tp = reduced * 2 * share
    return {"ulysses": ulysses, "ring": ring, "tensor_parallel": tp, "data_parallel": 0.0}


def gguf_bytes(parameters: int, qtype: str) -> int:
    """Bytes of ``parameters`` packed as GGUF ``qtype`` ("Q8_0": 34 bytes per 32 values, "Q4_K": 144 per 256): what
    each rank holds of a GGUF transformer under the strategies that keep a replica (the few tensors a GGUF file keeps
    in F32, norms and biases, are left out)."""
    values, size = block_shape(qtype)
    return math.ceil(parameters * size / values)
