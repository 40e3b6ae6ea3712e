"""Qwen1.5-MoE / Qwen2-MoE: q/k/v biases, a shared expert scaled by a sigmoid gate in every MoE layer, dense layers
by decoder_sparse_step / mlp_only_layers, norm_topk_prob."""

from __future__ import annotations

from typing import Any, Dict, Optional

from moezero.hf.decoder import (
    DECODER,
    DENSE_WIDTH,
    NORM_TOPK_PROB,
    SWIGLU,
    Experts,
    GroupedQueryAttention,
    SparseStep,
    no_attention_bias,
)
from moezero.hf.family import Family
from moezero.hf.parts import Fixed, Refuse, Same, hub_text
from moezero.hf.rope_fields import Rope


def _no_shared_expert(hf: Dict[str, Any]) -> Optional[str]:
    width = hf.get("shared_expert_intermediate_size")
    return None if width else f"shared_expert_intermediate_size={hub_text(width)} (every MoE layer has a shared expert)"


QWEN2_MOE = Family(
    "qwen2_moe",
    "Qwen2MoeForCausalLM",
    parts=(
        *DECODER,
        SWIGLU,
        DENSE_WIDTH,
        GroupedQueryAttention(),
        Rope(),
        no_attention_bias(written=False),
        Same("qkv_bias", "add_qkv_bias", bool, default=False),
        Experts("num_experts", "moe_intermediate_size"),
        NORM_TOPK_PROB,
        SparseStep(),
        Refuse(_no_shared_expert),
        Same("shared_expert_intermediate_size", "moe.shared_expert_intermediate_size", default=None),
        Fixed({"moe.shared_expert_gate": True}),
    ),
)
