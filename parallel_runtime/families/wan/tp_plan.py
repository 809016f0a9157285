"""The tensor-parallel plan the pack writes for Wan's transformer (``WanTransformer3DModel``), which diffusers 0.42.1
ships without one (it has a ``_cp_plan`` only).

It follows diffusers' own plans (FLUX.1's, Qwen-Image's): in every block, each attention's query, key and value
projections are split by columns (each rank computes its own heads) and the output projection by rows (the partial
outputs are summed over the ranks); the feed-forward's first layer by columns, its second by rows. Wan 2.1 I2V's
cross-attention also projects the CLIP image tokens (``add_k_proj`` / ``add_v_proj``): split by columns like the text
key and value, its output added before the same rowwise ``to_out``. What stays whole on every rank: the patch
embedding, the condition embedders, the blocks' AdaLN tables and LayerNorms, the final norm and projection — small,
and they index the whole hidden width.

What diffusers' plan form cannot say, and Wan needs:

- ``norm_q`` / ``norm_k`` (and I2V's ``norm_added_k``) are RMSNorms over the whole projection width (heads ×
  head_dim, ``qk_norm="rms_norm_across_heads"``), applied before the heads are split. After a column split each rank
  holds only its heads, so the norm's mean square must be summed over the TP ranks (``head_norms``); a rank that
  normalised its own columns alone would run, and be wrong (``tests/test_wan_tp.py`` shows how far).
- Wan's attention processor reshapes a projection by ``attn.heads`` (not by the head size, as FLUX.1's does), so each
  attention's ``heads`` becomes the rank's share (``head_counts``).
- The feed-forward's width (``ffn_dim``) is its own config key: the strategy checks that it splits too.
"""

from __future__ import annotations

from ..base import TensorParallelPlan

_ATTENTIONS = ("blocks.*.attn1", "blocks.*.attn2")

WAN_TP_PLAN = TensorParallelPlan(
    layers={
        # self-attention
        "blocks.*.attn1.to_q": "colwise",
        "blocks.*.attn1.to_k": "colwise",
        "blocks.*.attn1.to_v": "colwise",
        "blocks.*.attn1.to_out.0": "rowwise",
        # cross-attention: the text tokens' key and value, and (Wan 2.1 I2V) the CLIP image tokens'
        "blocks.*.attn2.to_q": "colwise",
        "blocks.*.attn2.to_k": "colwise",
        "blocks.*.attn2.to_v": "colwise",
        "blocks.*.attn2.add_k_proj": "colwise",
        "blocks.*.attn2.add_v_proj": "colwise",
        "blocks.*.attn2.to_out.0": "rowwise",
        # feed-forward (GELU(tanh) between the two)
        "blocks.*.ffn.net.0.proj": "colwise",
        "blocks.*.ffn.net.2": "rowwise",
    },
    head_norms=tuple(f"{attn}.{norm}" for attn in _ATTENTIONS for norm in ("norm_q", "norm_k"))
    + ("blocks.*.attn2.norm_added_k",),
    head_counts=_ATTENTIONS,
    widths={"ffn_dim": "feed-forward width (ffn_dim)"},
)
