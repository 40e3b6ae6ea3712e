"""OLMoE: q/k RMSNorm over all heads' width, every layer MoE, norm_topk_prob."""

from __future__ import annotations

from moezero.hf.decoder import (
    DECODER,
    NORM_TOPK_PROB,
    SWIGLU,
    Experts,
    GroupedQueryAttention,
    no_attention_bias,
    qk_norms,
)
from moezero.hf.family import Family
from moezero.hf.rope_fields import Rope

OLMOE = Family(
    "olmoe",
    "OlmoeForCausalLM",
    parts=(
        *DECODER,
        SWIGLU,
        GroupedQueryAttention(),
        Rope(),
        no_attention_bias(),
        qk_norms("full_width"),
        Experts("num_experts", "intermediate_size", dense_width=True),
        NORM_TOPK_PROB,
    ),
)
