"""Qwen3-MoE and the dense Qwen3 (a source of upcycling): q/k RMSNorm per head, head_dim apart from hidden/heads;
Qwen3-MoE's dense layers by decoder_sparse_step / mlp_only_layers, norm_topk_prob."""

from __future__ import annotations

from moezero.hf.decoder import (
    DECODER,
    DENSE_WIDTH,
    NORM_TOPK_PROB,
    SWIGLU,
    Experts,
    GroupedQueryAttention,
    SparseStep,
    no_attention_bias,
    qk_norms,
)
from moezero.hf.family import Family
from moezero.hf.rope_fields import Rope

_QWEN3 = (  # what Qwen3 and Qwen3-MoE share
    *DECODER,
    SWIGLU,
    DENSE_WIDTH,
    GroupedQueryAttention(),
    Rope(),
    no_attention_bias(),
    qk_norms("head"),
)

QWEN3_MOE = Family(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    parts=(*_QWEN3, Experts("num_experts", "moe_intermediate_size"), NORM_TOPK_PROB, SparseStep()),
)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", parts=_QWEN3, dense=True)
