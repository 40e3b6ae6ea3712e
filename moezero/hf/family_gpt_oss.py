"""GPT-OSS: GQA with biases (attention_bias) and attention sinks, a sliding window on the layers layer_types names
(transformers' sliding_window W keys: Megatron's window W - 1, 0), YaRN (truncate false: the correction range
unrounded), every layer MoE: a router with a bias, softmax over the top-k logits, experts with biases and quick
GELU gated by a clamped, offset up projection (swiglu_limit; alpha 1.702), stacked in the files (MXFP4 or not)."""

from __future__ import annotations

import operator
from typing import Any, Dict, Optional

from moezero.config import is_window_layer
from moezero.hf.decoder import DECODER, Experts, GroupedQueryAttention
from moezero.hf.family import Family
from moezero.hf.parts import Fixed, Part, Refuse, Requires, Same
from moezero.hf.rope_fields import Rope


class Windows(Part):
    """sliding_window and layer_types: Megatron's --window-size and --window-attn-skip-freq (default: sliding,
    full, sliding, ..., as its config class fills them in)."""

    def read(self, hf):
        layers, window = hf["num_hidden_layers"], hf.get("sliding_window")
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
        ]
        pattern = [int(t == "sliding_attention") for t in types]
        if not window or not any(pattern):
            return {}
        every_other = [int((i + 1) % 2 != 0) for i in range(layers)]
        return dict(window_size=(window - 1, 0), window_attn_skip_freq=2 if pattern == every_other else pattern)

    def write(self, gpt, moe):
        windowed = [is_window_layer(i, gpt) for i in range(gpt.num_layers)]
        # with no windowed layer, the class's default window: transformers' model builds the sliding mask
        # whatever layer_types say and refuses sliding_window=null; no layer uses it
        return {
            "sliding_window": gpt.window_size[0] + 1 if gpt.window_size else UNUSED_WINDOW,
            "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
        }


UNUSED_WINDOW = 128  # GptOssConfig's default sliding_window


def _unclamped(hf: Dict[str, Any]) -> Optional[str]:
    return "swiglu_limit=null (its experts clamp)" if hf.get("swiglu_limit") is None else None


_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

GPT_OSS = Family(
    "gpt_oss",
    "GptOssForCausalLM",
    parts=(
        *DECODER,
        GroupedQueryAttention(),
        Rope(yarn=True, when_absent=_YARN),
        Windows(),
        Same("attention_bias", "disable_bias_linear", operator.not_, operator.not_, default=True),
        Fixed({"swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0, "softmax_type": "learnable"}),
        Requires("swiglu_alpha", 1.702, "quick GELU's is 1.702"),
        Refuse(_unclamped),
        Same("swiglu_limit", "activation_func_clamp_value", float),
        Experts("num_local_experts", "intermediate_size", dense_width=True),
        Fixed({"moe.pre_softmax": False, "moe.bias": True}),  # softmax over the top-k logits; biased router, experts
    ),
    expert_projections=("gate_up_proj", "gate_up_proj", "down_proj"),
    stacked_experts=True,
)
