"""GLM-4.5 / 4.6: GQA rotating part of each head (partial_rotary_factor, 0.5 where the config gives none, as
transformers' config class sets it), q/k/v biases (attention_bias: the output projection has none), per-head q/k
norms (use_qk_norm), DeepSeek-V3's router, shared experts, the first first_k_dense_replace layers dense, its
multi-token-prediction layers."""

from __future__ import annotations

from moezero.hf.decoder import DECODER, DENSE_WIDTH, SWIGLU, GroupedQueryAttention
from moezero.hf.family import Family
from moezero.hf.family_deepseek import DEEPSEEK_MOE, FirstDenseLayers, MultiTokenPrediction, SigmoidRouter
from moezero.hf.parts import Fixed, Same
from moezero.hf.rope_fields import Rope

GLM4_MOE = Family(
    "glm4_moe",
    "Glm4MoeForCausalLM",
    parts=(
        *DECODER,
        SWIGLU,
        DENSE_WIDTH,
        GroupedQueryAttention(),
        Rope(partial=0.5),
        Same("attention_bias", "add_qkv_bias", bool),
        Same("use_qk_norm", "qk_layernorm", bool, default=False),
        Fixed({"qk_layernorm_scope": "head"}),
        *DEEPSEEK_MOE,
        SigmoidRouter(),
        FirstDenseLayers(),
        MultiTokenPrediction(),
    ),
    shared_expert_module="shared_experts",
    fp32_modules=("e_score_correction_bias", "gate.weight"),
)
