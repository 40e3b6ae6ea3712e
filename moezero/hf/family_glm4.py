"""GLM-4.5 / 4.6: GQA on part of each head with q/k/v biases, DeepSeek-V3's router, shared experts, dense first
layers, its multi-token-prediction layers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from moezero.config import GPTConfig, MoEConfig, is_moe_layer
from moezero.hf.family import (Family, UnsupportedModel, decoder_fields, decoder_hf_fields, mtp_layers, num_experts_of,
                               refuse_unsupported, rope_parameters, with_defaults)
from moezero.hf.family_deepseek import holds_sigmoid_router, sigmoid_router


@dataclass(frozen=True)
class Glm4MoeFamily(Family):
    """GLM-4.5 / 4.6: GQA rotating part of each head (partial_rotary_factor, 0.5 where the config gives none, as
    transformers' config class sets it), q/k/v biases (attention_bias: the output projection has none), per-head
    q/k norms (use_qk_norm), DeepSeek-V3's router, shared experts, the first first_k_dense_replace layers dense."""

    def configs(self, hf: Dict[str, Any]) -> Tuple[GPTConfig, MoEConfig]:
        hf = with_defaults(hf, self)
        refuse_unsupported(hf, self)
        if not hf.get("norm_topk_prob", True) or hf["num_experts_per_tok"] == 1:
            raise UnsupportedModel(f"{self.model_type} config norm_topk_prob=false or one expert per token: "
                                   "not supported by moezero")
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        rope = rope_parameters(hf)
        layers, first_dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace") or 0
        pattern = [int(i >= first_dense) for i in range(layers)]
        gpt = GPTConfig(
            **decoder_fields(hf, rope), kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
            group_query_attention=kv_heads != heads, num_query_groups=kv_heads,
            rotary_percent=float(rope.get("partial_rotary_factor", 0.5)), add_qkv_bias=bool(hf["attention_bias"]),
            qk_layernorm=bool(hf.get("use_qk_norm")), qk_layernorm_scope="head",
            moe_layer_freq=1 if all(pattern) else pattern, mtp_num_layers=mtp_layers(hf))
        shared = hf.get("n_shared_experts") or 0
        moe = MoEConfig(num_experts=num_experts_of(hf), top_k=hf["num_experts_per_tok"],
                        ffn_hidden_size=hf["moe_intermediate_size"],
                        shared_expert_intermediate_size=hf["moe_intermediate_size"] * shared if shared else None,
                        topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                        aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)), **sigmoid_router(hf))
        return gpt, moe

    def hf_config(self, gpt: GPTConfig, moe: MoEConfig, dtype: str) -> Dict[str, Any]:
        self.check_expressible(gpt, moe)
        pattern = [is_moe_layer(i, gpt.moe_layer_freq) for i in range(gpt.num_layers)]
        return {**decoder_hf_fields(gpt, self, dtype), "num_key_value_heads": gpt.query_groups,
                "head_dim": gpt.kv_channels, "partial_rotary_factor": gpt.rotary_percent,
                "rope_parameters": {"rope_type": "default", "rope_theta": gpt.rotary_base,
                                    "partial_rotary_factor": gpt.rotary_percent},
                "attention_bias": gpt.add_qkv_bias, "use_qk_norm": gpt.qk_layernorm,
                "moe_intermediate_size": moe.ffn_hidden_size or gpt.ffn_hidden_size,
                "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "n_shared_experts": (moe.shared_expert_intermediate_size or 0) // (moe.ffn_hidden_size or 1),
                "routed_scaling_factor": moe.topk_scaling_factor or 1.0, "n_group": moe.num_groups or 1,
                "topk_group": moe.group_topk or 1, "norm_topk_prob": True, "first_k_dense_replace": pattern.index(True),
                "router_aux_loss_coef": moe.aux_loss_coeff, "num_nextn_predict_layers": gpt.mtp_num_layers or 0}

    def _differences(self, gpt: GPTConfig, moe: Optional[MoEConfig]):
        if gpt.apply_layernorm_1p:
            yield "--apply-layernorm-1p (its norms hold their scale, not the scale - 1)"
        if gpt.multi_latent_attention or gpt.rope_type == "yarn" or gpt.position_embedding_type != "rope" \
                or gpt.rotary_seq_len_interpolation_factor is not None:
            yield "multi-latent attention, YaRN or another position embedding (it has RoPE on part of each head)"
        if gpt.rotary_dim % 2:
            yield f"an odd number of rotated dimensions ({gpt.rotary_dim})"
        if gpt.normalization != "RMSNorm" or not gpt.swiglu or not gpt.disable_bias_linear:
            yield "LayerNorm, GELU or biases other than q/k/v's (it has RMSNorm, SwiGLU, q/k/v biases only)"
        if gpt.qk_layernorm and gpt.qk_layernorm_scope != "head":
            yield "q/k norms over all heads' width (its are per head)"
        if moe is None:
            yield "no MoE layers (it is an MoE)"
            return
        pattern = [is_moe_layer(i, gpt.moe_layer_freq) for i in range(gpt.num_layers)]
        if True not in pattern or pattern != sorted(pattern):
            yield "dense layers after MoE ones (it has the first layers dense, the rest MoE)"
        if moe.shared_expert_intermediate_size and (moe.shared_expert_intermediate_size % (moe.ffn_hidden_size or 1)
                                                    or moe.shared_expert_gate):
            yield "a shared expert that is not whole experts wide, or gated"
        if not holds_sigmoid_router(moe):
            yield "a router other than sigmoid scores with an expert bias (groups by their two best)"
