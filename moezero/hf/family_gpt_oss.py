"""GPT-OSS: attention sinks, sliding windows on alternate layers, YaRN unrounded, biased experts with the clamped
quick GEGLU, stacked in the files."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from moezero.config import GPTConfig, MoEConfig, is_moe_layer, is_window_layer
from moezero.hf.family import (NO_MTP, Family, UnsupportedModel, decoder_fields, decoder_hf_fields, num_experts_of,
                               refuse_unsupported, rope_hf_parameters, rope_parameters, with_defaults, yarn_fields)


@dataclass(frozen=True)
class GptOssFamily(Family):
    """GPT-OSS: GQA with biases (attention_bias) and attention sinks, a sliding window on the layers layer_types
    names (transformers' sliding_window W keys: Megatron's window W - 1, 0), YaRN (truncate false: the correction
    range unrounded), every layer MoE: a router with a bias, softmax over the top-k logits, experts with biases and
    quick GELU gated by a clamped, offset up projection (swiglu_limit; alpha 1.702), stacked in the files."""

    def configs(self, hf: Dict[str, Any]) -> Tuple[GPTConfig, MoEConfig]:
        hf = with_defaults(hf, self)
        refuse_unsupported(hf, self)
        if float(hf.get("swiglu_alpha", 1.702)) != 1.702:
            raise UnsupportedModel(f"{self.model_type} config swiglu_alpha={hf['swiglu_alpha']} (quick GELU's is "
                                   "1.702): not supported by moezero")
        if not (hf.get("rope_parameters") or hf.get("rope_scaling")):   # what its config class fills in
            hf = dict(hf, rope_parameters=dict(_GPT_OSS_ROPE, rope_theta=hf["rope_theta"]))
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        rope = rope_parameters(hf, yarn=True)
        fields = dict(decoder_fields(hf, rope), swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
                      activation_func_clamp_value=float(hf["swiglu_limit"]), softmax_type="learnable",
                      disable_bias_linear=not hf.get("attention_bias", True), kv_channels=hf.get("head_dim")
                      or hf["hidden_size"] // heads, group_query_attention=kv_heads != heads,
                      num_query_groups=kv_heads, **_windows(hf), **yarn_fields(rope))
        moe = MoEConfig(num_experts=num_experts_of(hf), top_k=hf["num_experts_per_tok"],
                        ffn_hidden_size=hf["intermediate_size"], pre_softmax=False, bias=True,
                        aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
        return GPTConfig(**fields), moe

    def hf_config(self, gpt: GPTConfig, moe: MoEConfig, dtype: str) -> Dict[str, Any]:
        self.check_expressible(gpt, moe)
        rope = rope_hf_parameters(gpt)
        windowed = [is_window_layer(i, gpt) for i in range(gpt.num_layers)]
        return {**decoder_hf_fields(gpt, self, dtype), "num_key_value_heads": gpt.query_groups,
                "head_dim": gpt.kv_channels, "attention_bias": not gpt.disable_bias_linear, "rope_parameters": rope,
                "sliding_window": gpt.window_size[0] + 1 if gpt.window_size else None,
                "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
                "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "intermediate_size": moe.ffn_hidden_size or gpt.ffn_hidden_size, "swiglu_alpha": 1.702,
                "swiglu_limit": gpt.activation_func_clamp_value, "router_aux_loss_coef": moe.aux_loss_coeff}

    def _differences(self, gpt: GPTConfig, moe: Optional[MoEConfig]):
        if gpt.mtp_num_layers:
            yield NO_MTP
        if gpt.apply_layernorm_1p or gpt.normalization != "RMSNorm":
            yield "LayerNorm or --apply-layernorm-1p (it has RMSNorm)"
        if gpt.multi_latent_attention or gpt.qk_layernorm or gpt.position_embedding_type != "rope" \
                or gpt.rotary_percent != 1.0 or gpt.rotary_seq_len_interpolation_factor is not None:
            yield "MLA, q/k norms or positions other than RoPE on whole heads"
        if gpt.add_qkv_bias and gpt.disable_bias_linear:
            yield "q/k/v biases without the output projection's (its attention_bias is all or none)"
        if not gpt.quick_geglu or gpt.glu_linear_offset != 1.0 or gpt.activation_func_clamp_value is None:
            yield "an MLP other than quick GEGLU with offset 1 and a clamp (its experts')"
        if gpt.softmax_type != "learnable":
            yield "attention without sinks (--softmax-type learnable)"
        if moe is None or moe.shared_expert_intermediate_size or not moe.bias or moe.pre_softmax \
                or moe.score_function != "softmax" or moe.num_groups or moe.enable_expert_bias \
                or moe.topk_scaling_factor not in (None, 1.0):
            yield "a router or experts other than softmax over the top-k logits, with biases, no shared expert"
        elif not all(is_moe_layer(i, gpt.moe_layer_freq) for i in range(gpt.num_layers)):
            yield "dense layers (every layer of it is MoE)"


_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def _windows(hf: Dict[str, Any]) -> Dict[str, Any]:
    """Megatron's --window-size and --window-attn-skip-freq of transformers' sliding_window and layer_types
    (default: sliding, full, sliding, ..., as its config class fills them in)."""
    layers, window = hf["num_hidden_layers"], hf.get("sliding_window")
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    pattern = [int(t == "sliding_attention") for t in types]
    if not window or not any(pattern):
        return {}
    every_other = [int((i + 1) % 2 != 0) for i in range(layers)]
    return dict(window_size=(window - 1, 0), window_attn_skip_freq=2 if pattern == every_other else pattern)
