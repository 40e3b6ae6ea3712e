"""Mixtral: every layer MoE, experts under block_sparse_moe (w1/w3/w2), the top-k weights always renormalised;
a sliding window wherever the config gives one."""

from __future__ import annotations

from typing import Any, Dict, Optional

from moezero.hf.decoder import DECODER, SWIGLU, Experts, GroupedQueryAttention, no_attention_bias
from moezero.hf.family import Family
from moezero.hf.parts import Fixed, Refuse
from moezero.hf.rope_fields import Rope


def _sliding_window(hf: Dict[str, Any]) -> Optional[str]:
    """transformers' Mixtral attends within sliding_window whenever it is set (no use_sliding_window switch)."""
    window = hf.get("sliding_window")
    return f"sliding_window={window}" if window is not None and window < hf["max_position_embeddings"] else None


MIXTRAL = Family(
    "mixtral",
    "MixtralForCausalLM",
    moe_block="block_sparse_moe",
    expert_projections=("w1", "w3", "w2"),
    parts=(
        *DECODER,
        SWIGLU,
        GroupedQueryAttention(),
        Rope(),
        no_attention_bias(written=False),
        Refuse(_sliding_window),
        Experts("num_local_experts", "intermediate_size", dense_width=True),
        Fixed({"moe.pre_softmax": False}),  # top-k weights always renormalised
    ),
)
