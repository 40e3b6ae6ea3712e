"""The parts of a declaration that the Llama-style families share: the decoder's sizes and norms, the settings
refused everywhere, grouped-query attention, the routed experts and Qwen-MoE's dense layers."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Dict

from moezero.config import is_moe_layer
from moezero.hf.parts import Fixed, Part, Requires, Same


class Positions(Part):
    """max_position_embeddings: the model's positions, and the sequence length an import trains at."""

    def read(self, hf):
        n = hf["max_position_embeddings"]
        return {"max_position_embeddings": n, "seq_length": n}

    def write(self, gpt, moe):
        return {"max_position_embeddings": gpt.max_position_embeddings}


def _float_or_zero(value: Any) -> float:
    return float(value or 0.0)


DECODER = (  # every family's: an RMSNorm decoder with RoPE
    Same("vocab_size", "vocab_size"),
    Same("hidden_size", "hidden_size"),
    Same("num_hidden_layers", "num_layers"),
    Same("num_attention_heads", "num_attention_heads"),
    Positions(),
    Same("rms_norm_eps", "norm_epsilon"),
    Same("tie_word_embeddings", "untie_embeddings_and_output_weights", operator.not_, operator.not_, default=False),
    Same("attention_dropout", "attention_dropout", _float_or_zero, default=0.0),
    Same("initializer_range", "init_method_std", default=0.02),
    Fixed(
        {
            "position_embedding_type": "rope",
            "normalization": "RMSNorm",
            "make_vocab_size_divisible_by": 1,
            "hidden_dropout": 0.0,
        }
    ),
    Requires("hidden_act", "silu", "SwiGLU with silu only"),
    Requires("clip_qkv", None, written=False),
    Requires("use_sliding_window", False, written=False),
    Requires("mlp_bias", False, written=False),
)
SWIGLU = Fixed({"swiglu": True, "disable_bias_linear": True})  # SwiGLU MLPs, no biases
DENSE_WIDTH = Same("intermediate_size", "ffn_hidden_size")


def no_attention_bias(written: bool = True) -> Requires:
    return Requires("attention_bias", False, "biases on q/k/v and the output projection", written=written)


def qk_norms(scope: str) -> Fixed:
    """RMSNorm of queries and keys, per head or over all heads' width."""
    return Fixed({"qk_layernorm": True, "qk_layernorm_scope": scope})


class GroupedQueryAttention(Part):
    """num_key_value_heads and head_dim: the key/value heads (grouped-query attention where fewer than the query
    heads) and each head's width (hidden / heads where the config gives none)."""

    def read(self, hf):
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        return {
            "group_query_attention": kv_heads != heads,
            "num_query_groups": kv_heads,
            "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        }

    def write(self, gpt, moe):
        return {"num_key_value_heads": gpt.query_groups, "head_dim": gpt.kv_channels}


@dataclass(frozen=True)
class Experts(Part):
    """The routed experts of every MoE family: how many (`count` names the field), top-k, their width (`width`;
    `dense_width`: the same field is the dense MLPs' width, in a family with no dense layer), the aux loss."""

    count: str
    width: str
    dense_width: bool = False

    def read(self, hf):
        out = {
            "moe.num_experts": num_experts_of(hf),
            "moe.top_k": hf["num_experts_per_tok"],
            "moe.ffn_hidden_size": hf[self.width],
            "moe.aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0)),
        }
        if self.dense_width:
            out["ffn_hidden_size"] = hf[self.width]
        return out

    def write(self, gpt, moe):
        # transformers' router_aux_loss_coef is one number, its loss over the batch: Megatron's aux_loss (a
        # sequence or global-batch loss, alone or beside it, has no field there)
        return {
            "num_experts_per_tok": moe.top_k,
            self.count: moe.num_experts,
            self.width: moe.ffn_hidden_size or gpt.ffn_hidden_size,
            "router_aux_loss_coef": moe.balancing_coefficients().get("aux_loss", 0.0),
        }


def num_experts_of(hf: Dict[str, Any]) -> int:
    return hf.get("n_routed_experts") or hf.get("num_experts") or hf["num_local_experts"]


# the top-k weights renormalised where norm_topk_prob (else the softmax over all experts)
NORM_TOPK_PROB = Same("norm_topk_prob", "moe.pre_softmax", operator.not_, operator.not_, default=False)


class SparseStep(Part):
    """Qwen-MoE's dense layers: decoder_sparse_step and mlp_only_layers, as Megatron's 0/1 per layer."""

    def read(self, hf):
        step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]
        return {"moe_layer_freq": 1 if all(pattern) else pattern}

    def write(self, gpt, moe):
        dense = [i for i in range(gpt.num_layers) if not is_moe_layer(i, gpt.moe_layer_freq)]
        return {"decoder_sparse_step": 1, "mlp_only_layers": dense}
