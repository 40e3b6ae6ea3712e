"""DeepSeek-V2 and DeepSeek-V3 / Kimi-K2: multi-latent attention and DeepSeekMoE; V3's sigmoid router (GLM-4.5's
too) and its multi-token-prediction layers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from moezero.config import GPTConfig, MoEConfig, is_moe_layer
from moezero.hf.family import (NO_MTP, Family, UnsupportedModel, decoder_fields, decoder_hf_fields, mtp_layers,
                               num_experts_of, refuse_unsupported, rope_hf_parameters, rope_parameters, with_defaults,
                               yarn_fields)


@dataclass(frozen=True)
class DeepSeekFamily(Family):
    """DeepSeek-V2 (version 2) and DeepSeek-V3 / Kimi-K2 (version 3): MLA and DeepSeekMoE."""

    version: int = 3

    def configs(self, hf: Dict[str, Any]) -> Tuple[GPTConfig, MoEConfig]:
        hf = with_defaults(hf, self)
        refuse_unsupported(hf, self)
        self._refuse_deepseek(hf)
        layers, rope = hf["num_hidden_layers"], rope_parameters(hf, yarn=True)
        first_dense, freq = hf.get("first_k_dense_replace") or 0, hf.get("moe_layer_freq") or 1
        pattern = [int(i >= first_dense and i % freq == 0) for i in range(layers)]
        gpt = GPTConfig(
            **decoder_fields(hf, rope), qk_layernorm=True, multi_latent_attention=True,
            q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
            qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], **yarn_fields(rope),
            moe_layer_freq=1 if all(pattern) else pattern, mtp_num_layers=mtp_layers(hf) if self.version == 3 else None)
        moe = MoEConfig(num_experts=num_experts_of(hf), top_k=hf["num_experts_per_tok"],
                        ffn_hidden_size=hf["moe_intermediate_size"],
                        shared_expert_intermediate_size=hf["moe_intermediate_size"] * hf["n_shared_experts"]
                        if hf.get("n_shared_experts") else None,
                        topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                        aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)), **self._router(hf))
        return gpt, moe

    def _holds_group_score(self, moe) -> bool:
        """DeepSeek-V2 scores a group by its best expert, V3 by its two best (Megatron's top_sum when k = 2 x
        groups)."""
        if self.version == 2:
            return moe.group_score == "max"
        return moe.group_score == "top2_sum" or (moe.group_score == "top_sum" and moe.top_k == 2 * moe.group_topk)

    def _router(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        if self.version == 3:
            return sigmoid_router(hf)
        groups = hf.get("n_group") or 1
        limits = dict(num_groups=groups, group_topk=hf["topk_group"]) \
            if groups > 1 and hf.get("topk_method") == "group_limited_greedy" else {}
        return dict(score_function="softmax", pre_softmax=True, group_score="max", **limits)

    def _refuse_deepseek(self, hf: Dict[str, Any]) -> None:
        heads = hf["num_attention_heads"]
        checks = [
            ((hf.get("num_key_value_heads") or heads) != heads, "num_key_value_heads apart from the heads"),
            (float(rope_parameters(hf, yarn=True).get("partial_rotary_factor", 1.0)) != 1.0,
             "partial_rotary_factor (transformers shortens the rotary frequencies but not the rotated part)"),
            (hf["rms_norm_eps"] != 1e-6, f"rms_norm_eps={hf['rms_norm_eps']} (its latent norms use 1e-6 whatever "
                                         "it says; moezero one epsilon for all)"),
            (self.version == 3 and hf.get("rope_interleave") is False, "rope_interleave=false"),
            (self.version == 3 and hf.get("scoring_func", "sigmoid") != "sigmoid",
             f"scoring_func={hf.get('scoring_func')!r}"),
            (self.version == 3 and not hf.get("norm_topk_prob", True) and hf["num_experts_per_tok"] > 1,
             "norm_topk_prob=false with sigmoid scores"),
            (self.version == 3 and hf["num_experts_per_tok"] == 1, "one expert per token"),
            (self.version == 2 and hf.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"),
             f"topk_method={hf.get('topk_method')!r}"),
        ]
        for failed, what in checks:
            if failed:
                raise UnsupportedModel(f"{self.model_type} config {what}: not supported by moezero")

    def hf_config(self, gpt: GPTConfig, moe: MoEConfig, dtype: str) -> Dict[str, Any]:
        self.check_expressible(gpt, moe)
        rope = rope_hf_parameters(gpt)
        pattern = [is_moe_layer(i, gpt.moe_layer_freq) for i in range(gpt.num_layers)]
        hf: Dict[str, Any] = {
            **decoder_hf_fields(gpt, self, dtype),
            "moe_intermediate_size": moe.ffn_hidden_size or gpt.ffn_hidden_size,
            "num_key_value_heads": gpt.num_attention_heads,
            "n_shared_experts": (moe.shared_expert_intermediate_size or 0) // (moe.ffn_hidden_size or 1),
            "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "routed_scaling_factor": moe.topk_scaling_factor or 1.0, "kv_lora_rank": gpt.kv_lora_rank,
            "q_lora_rank": gpt.q_lora_rank, "qk_rope_head_dim": gpt.qk_pos_emb_head_dim,
            "qk_nope_head_dim": gpt.qk_head_dim, "v_head_dim": gpt.v_head_dim,
            "n_group": moe.num_groups or 1, "topk_group": moe.group_topk or 1,
            "first_k_dense_replace": pattern.index(True), "moe_layer_freq": 1, "rope_parameters": rope,
            "attention_bias": False, "router_aux_loss_coef": moe.aux_loss_coeff,
        }
        if self.version == 3:
            hf.update(norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", rope_interleave=True,
                      num_nextn_predict_layers=gpt.mtp_num_layers or 0)
        else:
            hf.update(norm_topk_prob=False, topk_method="group_limited_greedy" if moe.num_groups else "greedy")
        return hf

    def _differences(self, gpt: GPTConfig, moe: Optional[MoEConfig]):
        if gpt.apply_layernorm_1p:
            yield "--apply-layernorm-1p (its norms hold their scale, not the scale - 1)"
        if self.version == 2 and gpt.mtp_num_layers:
            yield NO_MTP
        if moe is None:
            yield "no MoE layers (it is an MoE)"
            return
        pattern = [is_moe_layer(i, gpt.moe_layer_freq) for i in range(gpt.num_layers)]
        if not gpt.multi_latent_attention or not gpt.qk_layernorm:
            yield "attention other than multi-latent attention with its latent norms (--qk-layernorm)"
        if gpt.normalization != "RMSNorm" or not gpt.swiglu or not gpt.disable_bias_linear:
            yield "LayerNorm, GELU or biases (it has RMSNorm, SwiGLU, no biases)"
        if gpt.norm_epsilon != 1e-6:
            yield f"--norm-epsilon {gpt.norm_epsilon} (its latent norms are 1e-6)"
        if True not in pattern or pattern != sorted(pattern):
            yield "dense layers after MoE ones (it has the first layers dense, the rest MoE)"
        if moe.shared_expert_intermediate_size and (moe.shared_expert_intermediate_size % (moe.ffn_hidden_size or 1)
                                                    or moe.shared_expert_gate):
            yield "a shared expert that is not whole experts wide, or gated"
        if moe.bias or (moe.num_groups and not self._holds_group_score(moe)):
            yield "router biases or another group score"
        if self.version == 3 and (moe.score_function != "sigmoid" or not moe.enable_expert_bias or moe.top_k == 1):
            yield "a router other than sigmoid scores with an expert bias"
        if self.version == 2 and (moe.score_function != "softmax" or not moe.pre_softmax or moe.enable_expert_bias):
            yield "a router other than a softmax over all experts without renormalisation"


def sigmoid_router(hf: Dict[str, Any]) -> Dict[str, Any]:
    """DeepSeek-V3's router (and GLM-4.5's): sigmoid scores, a correction bias for the choice only, groups."""
    groups = hf.get("n_group") or 1
    limits = dict(num_groups=groups, group_topk=hf["topk_group"]) if groups > 1 else {}
    # transformers scores a group by its two best experts whatever top-k is (Megatron's top_sum when k = 2 x groups)
    two_per_group = hf["num_experts_per_tok"] == 2 * (hf.get("topk_group") or 1)
    return dict(score_function="sigmoid", enable_expert_bias=True,
                group_score="top_sum" if two_per_group else "top2_sum", **limits)


def holds_sigmoid_router(moe: MoEConfig) -> bool:
    return (moe.score_function == "sigmoid" and moe.enable_expert_bias and moe.top_k > 1 and not moe.bias
            and (not moe.num_groups or moe.group_score == "top2_sum"
                 or (moe.group_score == "top_sum" and moe.top_k == 2 * moe.group_topk)))
