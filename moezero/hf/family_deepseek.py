"""DeepSeek-V2 and DeepSeek-V3 / Kimi-K2: multi-latent attention (interleaved RoPE, YaRN) and DeepSeekMoE (shared
experts, the first layers dense); V2's softmax router, V3's sigmoid one (GLM-4.5's too) and its multi-token-
prediction layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from moezero.config import is_moe_layer
from moezero.hf.decoder import DECODER, DENSE_WIDTH, SWIGLU, Experts, no_attention_bias
from moezero.hf.family import Family
from moezero.hf.parts import Fixed, Part, Refuse, Requires, Same, Written
from moezero.hf.rope_fields import Rope, rope_parameters


class OwnKeyValueHeads(Part):
    """Every head has its own keys and values (num_key_value_heads = the heads), as MLA's up projection makes."""

    def refusal(self, hf):
        heads = hf["num_attention_heads"]
        return "num_key_value_heads apart from the heads" if (hf.get("num_key_value_heads") or heads) != heads else None

    def write(self, gpt, moe):
        return {"num_key_value_heads": gpt.num_attention_heads}


def _partial_rotary(hf: Dict[str, Any]) -> Optional[str]:
    if float(rope_parameters(hf, yarn=True).get("partial_rotary_factor", 1.0)) != 1.0:
        return "partial_rotary_factor (transformers shortens the rotary frequencies but not the rotated part)"
    return None


LATENT_ATTENTION = (
    Fixed({"multi_latent_attention": True, "qk_layernorm": True}),
    OwnKeyValueHeads(),
    Same("q_lora_rank", "q_lora_rank", default=None),
    Same("kv_lora_rank", "kv_lora_rank"),
    Same("qk_nope_head_dim", "qk_head_dim"),
    Same("qk_rope_head_dim", "qk_pos_emb_head_dim"),
    Same("v_head_dim", "v_head_dim"),
    Rope(yarn=True),
    Refuse(_partial_rotary),
    Requires(
        "rms_norm_eps", 1e-6, "its latent norms use 1e-6 whatever it says; moezero one epsilon for all", written=False
    ),
)


@dataclass(frozen=True)
class FirstDenseLayers(Part):
    """first_k_dense_replace: the first layers dense, the rest MoE (`every` names DeepSeek's moe_layer_freq, which
    keeps every n-th of those)."""

    every: Optional[str] = None

    def read(self, hf):
        first, freq = hf.get("first_k_dense_replace") or 0, (hf.get(self.every) or 1) if self.every else 1
        pattern = [int(i >= first and i % freq == 0) for i in range(hf["num_hidden_layers"])]
        return {"moe_layer_freq": 1 if all(pattern) else pattern}

    def write(self, gpt, moe):
        pattern = [is_moe_layer(i, gpt.moe_layer_freq) for i in range(gpt.num_layers)]
        out = {"first_k_dense_replace": pattern.index(True) if True in pattern else gpt.num_layers}
        return dict(out, **{self.every: 1}) if self.every else out


class SharedExperts(Part):
    """n_shared_experts: the shared expert's width in routed experts (moe_intermediate_size each), no gate."""

    def read(self, hf):
        shared = hf.get("n_shared_experts") or 0
        return {"moe.shared_expert_intermediate_size": hf["moe_intermediate_size"] * shared if shared else None}

    def write(self, gpt, moe):
        width = moe.ffn_hidden_size or gpt.ffn_hidden_size
        return {"n_shared_experts": (moe.shared_expert_intermediate_size or 0) // width}


def _one_if_none(value: Optional[float]) -> float:
    return value or 1.0


DEEPSEEK_MOE = (
    Experts("n_routed_experts", "moe_intermediate_size"),
    SharedExperts(),
    Same("routed_scaling_factor", "moe.topk_scaling_factor", float, _one_if_none, default=1.0),
)


class GreedyRouter(Part):
    """DeepSeek-V2's router: a softmax over all experts, not renormalised; topk_method group_limited_greedy keeps
    the topk_group groups with the best expert."""

    def refusal(self, hf):
        method = hf.get("topk_method", "greedy")
        return None if method in ("greedy", "group_limited_greedy") else f"topk_method={method!r}"

    def read(self, hf):
        groups = hf.get("n_group") or 1
        limits = (
            {"moe.num_groups": groups, "moe.group_topk": hf["topk_group"]}
            if groups > 1 and hf.get("topk_method") == "group_limited_greedy"
            else {}
        )
        return {"moe.score_function": "softmax", "moe.pre_softmax": True, "moe.group_score": "max", **limits}

    def write(self, gpt, moe):
        return {
            "n_group": moe.num_groups or 1,
            "topk_group": moe.group_topk or 1,
            "norm_topk_prob": False,
            "topk_method": "group_limited_greedy" if moe.num_groups else "greedy",
        }


class SigmoidRouter(Part):
    """DeepSeek-V3's router (GLM-4.5's too): sigmoid scores, a correction bias for the choice only, the top-k
    weights renormalised, groups scored by their two best experts whatever top-k is."""

    def refusal(self, hf):
        if hf["num_experts_per_tok"] == 1:
            return (
                "num_experts_per_tok=1 with sigmoid scores (transformers renormalises the one weight to 1.0, "
                "Megatron keeps the score)"
            )
        return None if hf.get("norm_topk_prob", True) else "norm_topk_prob=false with sigmoid scores"

    def read(self, hf):
        return {"moe." + name: value for name, value in sigmoid_router(hf).items()}

    def write(self, gpt, moe):
        return {"n_group": moe.num_groups or 1, "topk_group": moe.group_topk or 1, "norm_topk_prob": True}


def sigmoid_router(hf: Dict[str, Any]) -> Dict[str, Any]:
    groups = hf.get("n_group") or 1
    limits = dict(num_groups=groups, group_topk=hf["topk_group"]) if groups > 1 else {}
    # transformers scores a group by its two best experts whatever top-k is (Megatron's top_sum when k = 2 x groups)
    two_per_group = hf["num_experts_per_tok"] == 2 * (hf.get("topk_group") or 1)
    return dict(
        score_function="sigmoid",
        enable_expert_bias=True,
        group_score="top_sum" if two_per_group else "top2_sum",
        **limits,
    )


def mtp_layers(hf: Dict[str, Any]) -> Optional[int]:
    """The MTP layers a DeepSeek-V3 / GLM-4.5 config declares (transformers' default: 1): Hub layers numbered on
    from num_hidden_layers, which transformers' models skip (hub_configs keeps them where the files hold them)."""
    return hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1)) or None


class MultiTokenPrediction(Part):
    def read(self, hf):
        return {"mtp_num_layers": mtp_layers(hf)}

    def write(self, gpt, moe):
        return {"num_nextn_predict_layers": gpt.mtp_num_layers or 0}


_DEEPSEEK = (
    *DECODER,
    SWIGLU,
    DENSE_WIDTH,
    no_attention_bias(),
    *LATENT_ATTENTION,
    *DEEPSEEK_MOE,
    FirstDenseLayers(every="moe_layer_freq"),
)
_FILES = dict(shared_expert_module="shared_experts")

DEEPSEEK_V2 = Family(
    "deepseek_v2", "DeepseekV2ForCausalLM", parts=(*_DEEPSEEK, GreedyRouter()), fp32_modules=("gate.weight",), **_FILES
)
DEEPSEEK_V3 = Family(
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    parts=(
        *_DEEPSEEK,
        SigmoidRouter(),
        Requires("scoring_func", "sigmoid"),
        Written("topk_method", "noaux_tc"),
        Requires("rope_interleave", True),
        MultiTokenPrediction(),
    ),
    aliases=("kimi_k2",),  # Kimi-K2's config.json names its own type for DeepSeek-V3's architecture
    fp32_modules=("e_score_correction_bias", "gate.weight"),
    **_FILES,
)
