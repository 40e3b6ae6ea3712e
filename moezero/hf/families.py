"""The Hugging Face MoE families moezero reads and writes, and how their config.json maps to moezero's configs.

Every family here is a Llama-style decoder (RoPE, RMSNorm, SwiGLU, no biases but where noted) whose MoE
layers route with a softmax top-k; they differ in a few switches:

  mixtral    Mixtral           experts under `block_sparse_moe`, w1/w3/w2; top-k weights renormalised
  qwen2_moe  Qwen1.5/2-MoE     q/k/v biases; a shared expert scaled by a sigmoid gate; dense layers by
                               decoder_sparse_step/mlp_only_layers; norm_topk_prob
  qwen3_moe  Qwen3-MoE         q/k RMSNorm per head; head_dim apart from hidden/heads; dense layers as Qwen2
  olmoe      OLMoE             q/k RMSNorm over all heads' width
  deepseek_v2  DeepSeek-V2     multi-latent attention (interleaved RoPE, YaRN); softmax routing, greedy or
                               group-limited by each group's best expert, scaled; shared experts; the first
                               first_k_dense_replace layers dense
  llama, qwen3 (dense)         the dense sources of upcycling (--moe-use-upcycling): no MoE layers
  deepseek_v3  DeepSeek-V3,    as V2, routed by sigmoid scores with a correction bias for the choice only,
               Kimi-K2         groups scored by their top two, the top-k weights renormalised and scaled
  glm4_moe     GLM-4.5/4.6     GQA with RoPE on part of each head, q/k/v biases, optional per-head q/k norms;
                               DeepSeek-V3's router, shared experts and dense first layers
  gpt_oss      GPT-OSS         GQA with biases and attention sinks, sliding windows on alternate layers, YaRN;
                               experts with biases and a clamped quick GEGLU, stacked in the files (MXFP4 or not)

`Family.configs(hf)` gives (GPTConfig, MoEConfig) from a config.json dict, `Family.hf_config(gpt, moe)` the
other way; a setting the family cannot express is an UnsupportedModel naming it.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from moezero.config import GPTConfig, MoEConfig, is_moe_layer, is_window_layer


class UnsupportedModel(ValueError):
    """A Hugging Face config (or a moezero model to export) uses something moezero or the family lacks."""


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    moe_block: str                         # the MoE MLP's module name in a layer
    expert_projections: Tuple[str, str, str]   # (gate, up, down) module names of one expert
    num_experts_field: str
    qk_norm: Optional[str] = None          # None, "head" or "full_width"
    qkv_bias_field: Optional[str] = None   # the config field of q/k/v biases (Qwen2-MoE)
    shared_expert: bool = False            # a gated shared expert in every MoE layer (Qwen2-MoE)
    sparse_step: bool = False              # dense layers by decoder_sparse_step / mlp_only_layers
    always_renormalises: bool = False      # top-k weights always renormalised (else norm_topk_prob)
    shared_expert_module: str = "shared_expert"
    dense: bool = False                    # a dense model (Llama, Qwen3): the source of upcycling
    fp32_modules: Tuple[str, ...] = ()     # transformers' _keep_in_fp32_modules_strict: fp32 in any model dtype
    stacked_experts: bool = False          # each layer's experts in stacked tensors (GPT-OSS), not one key each

    def keeps_fp32(self, hub_key: str) -> bool:
        """Whether transformers keeps the tensor of `hub_key` in fp32 whatever the model's dtype (matched as its
        modeling_utils matches those module names: anywhere in the key)."""
        return any(module in hub_key for module in self.fp32_modules)

    @property
    def expert_width_field(self) -> str:
        return "intermediate_size" if self.model_type in ("mixtral", "olmoe", "gpt_oss") else "moe_intermediate_size"

    # ---- Hugging Face config -> moezero configs

    def configs(self, hf: Dict[str, Any]) -> Tuple[GPTConfig, MoEConfig]:
        hf = with_defaults(hf, self)
        _refuse_unsupported(hf, self)
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        rope = _rope_parameters(hf)
        # rotary over the whole head: transformers' models of these families ignore partial_rotary_factor
        gpt = GPTConfig(
            **_decoder_fields(hf, rope), kv_channels=head_dim, group_query_attention=kv_heads != heads,
            num_query_groups=kv_heads, rotary_percent=1.0,
            add_qkv_bias=bool(hf.get(self.qkv_bias_field, False)) if self.qkv_bias_field else False,
            qk_layernorm=self.qk_norm is not None, qk_layernorm_scope=self.qk_norm or "head",
            moe_layer_freq=1 if self.dense else self._moe_layers(hf))
        if self.dense:
            return gpt, None
        renormalise = self.always_renormalises or bool(hf.get("norm_topk_prob", False))
        moe = MoEConfig(
            num_experts=_num_experts(hf), top_k=hf["num_experts_per_tok"],
            ffn_hidden_size=hf[self.expert_width_field], pre_softmax=not renormalise,
            aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") if self.shared_expert else None,
            shared_expert_gate=self.shared_expert)
        return gpt, moe

    def _moe_layers(self, hf: Dict[str, Any]):
        """Megatron's --moe-layer-freq for the family's dense/MoE pattern (1: every layer is MoE)."""
        if not self.sparse_step:
            return 1
        step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]
        return 1 if all(pattern) else pattern

    # ---- moezero configs -> Hugging Face config

    def hf_config(self, gpt: GPTConfig, moe: MoEConfig, dtype: str) -> Dict[str, Any]:
        self.check_expressible(gpt, moe)
        moe_layers = [is_moe_layer(i, gpt.moe_layer_freq) for i in range(gpt.num_layers)]
        hf: Dict[str, Any] = dict(_decoder_hf_fields(gpt, self, dtype), num_key_value_heads=gpt.query_groups,
                                  head_dim=gpt.kv_channels,
                                  rope_parameters={"rope_type": "default", "rope_theta": gpt.rotary_base})
        if self.qkv_bias_field:
            hf[self.qkv_bias_field] = gpt.add_qkv_bias
        if self.qk_norm or self.dense:
            hf["attention_bias"] = False
        if self.dense:
            return hf
        hf.update({"num_experts_per_tok": moe.top_k, self.num_experts_field: moe.num_experts,
                   self.expert_width_field: moe.ffn_hidden_size or gpt.ffn_hidden_size,
                   "router_aux_loss_coef": moe.aux_loss_coeff})
        if not self.always_renormalises:
            hf["norm_topk_prob"] = not moe.pre_softmax
        if self.sparse_step:
            hf["decoder_sparse_step"] = 1
            hf["mlp_only_layers"] = [i for i, sparse in enumerate(moe_layers) if not sparse]
        if self.shared_expert:
            hf["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
        return hf

    def check_expressible(self, gpt: GPTConfig, moe: Optional[MoEConfig]) -> None:
        """UnsupportedModel naming the first setting of (gpt, moe) this family cannot hold."""
        problem = next((why for why in self._differences(gpt, moe)), None)
        if problem:
            raise UnsupportedModel(f"{self.model_type} cannot hold this model: {problem}")

    def _differences(self, gpt: GPTConfig, moe: Optional[MoEConfig]):
        if gpt.mtp_num_layers:
            yield _NO_MTP
        if gpt.rotary_percent != 1.0:
            yield f"--rotary-percent {gpt.rotary_percent} (transformers rotates the whole head for this family)"
        if gpt.apply_layernorm_1p:
            yield "--apply-layernorm-1p (its norms hold their scale, not the scale - 1)"
        if gpt.multi_latent_attention or gpt.rope_type == "yarn":
            yield "multi-latent attention or YaRN (it has plain attention and RoPE)"
        if gpt.position_embedding_type != "rope":
            yield f"--position-embedding-type {gpt.position_embedding_type} (it uses rope)"
        if gpt.rotary_seq_len_interpolation_factor is not None:
            yield "--rotary-seq-len-interpolation-factor (it has no position interpolation)"
        if gpt.normalization != "RMSNorm":
            yield f"--normalization {gpt.normalization} (it uses RMSNorm)"
        if not gpt.swiglu:
            yield "GELU MLPs (it uses SwiGLU: --swiglu)"
        if not gpt.disable_bias_linear:
            yield "biases in the linear layers (it has none: --disable-bias-linear)"
        if gpt.add_qkv_bias and not self.qkv_bias_field:
            yield "--add-qkv-bias (it has no q/k/v biases)"
        if (self.qk_norm or None) != (gpt.qk_layernorm_scope if gpt.qk_layernorm else None):
            yield f"q/k norm {gpt.qk_layernorm_scope if gpt.qk_layernorm else 'off'} (it has {self.qk_norm or 'none'})"
        if (moe is None) != self.dense:
            yield "MoE layers (it is dense)" if self.dense else "no MoE layers (it is an MoE)"
            return
        if self.dense:
            return
        if bool(moe.shared_expert_intermediate_size) != self.shared_expert or moe.shared_expert_gate != self.shared_expert:
            yield "a gated shared expert" + (" is required" if self.shared_expert else " is not part of it")
        if self.always_renormalises and moe.pre_softmax:
            yield "--moe-router-pre-softmax (its top-k weights are always renormalised)"
        if (moe.score_function != "softmax" or moe.topk_scaling_factor not in (None, 1.0) or moe.enable_expert_bias
                or moe.num_groups):
            yield "a sigmoid router, a top-k scaling factor, an expert bias or expert groups (it routes by softmax alone)"
        if moe.bias:
            yield "router or expert biases"
        if not self.sparse_step and not all(is_moe_layer(i, gpt.moe_layer_freq) for i in range(gpt.num_layers)):
            yield "dense layers among the MoE ones (every layer of it is MoE)"


@dataclass(frozen=True)
class DeepSeekFamily(Family):
    """DeepSeek-V2 (version 2) and DeepSeek-V3 / Kimi-K2 (version 3): MLA and DeepSeekMoE."""

    version: int = 3

    def configs(self, hf: Dict[str, Any]) -> Tuple[GPTConfig, MoEConfig]:
        hf = with_defaults(hf, self)
        _refuse_unsupported(hf, self)
        self._refuse_deepseek(hf)
        layers, rope = hf["num_hidden_layers"], _rope_parameters(hf, yarn=True)
        first_dense, freq = hf.get("first_k_dense_replace") or 0, hf.get("moe_layer_freq") or 1
        pattern = [int(i >= first_dense and i % freq == 0) for i in range(layers)]
        yarn = rope.get("rope_type", rope.get("type")) == "yarn"
        gpt = GPTConfig(
            **_decoder_fields(hf, rope), qk_layernorm=True, multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
            qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], rope_type="yarn" if yarn else "rope",
            rotary_scaling_factor=float(rope.get("factor", 1.0)) if yarn else 1.0,
            mscale=float(rope.get("mscale") or 0.0) if yarn else 1.0,
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0) if yarn else 0.0,
            yarn_original_max_position_embeddings=rope.get("original_max_position_embeddings") if yarn else None,
            yarn_beta_fast=rope.get("beta_fast") if yarn else None, yarn_beta_slow=rope.get("beta_slow") if yarn else None,
            no_yarn_correction_range_round_to_int=yarn and rope.get("truncate", True) is False,
            moe_layer_freq=1 if all(pattern) else pattern, mtp_num_layers=mtp_layers(hf) if self.version == 3 else None)
        moe = MoEConfig(num_experts=_num_experts(hf), top_k=hf["num_experts_per_tok"],
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
            return _sigmoid_router(hf)
        groups = hf.get("n_group") or 1
        limits = dict(num_groups=groups, group_topk=hf["topk_group"]) \
            if groups > 1 and hf.get("topk_method") == "group_limited_greedy" else {}
        return dict(score_function="softmax", pre_softmax=True, group_score="max", **limits)

    def _refuse_deepseek(self, hf: Dict[str, Any]) -> None:
        heads = hf["num_attention_heads"]
        checks = [
            ((hf.get("num_key_value_heads") or heads) != heads, "num_key_value_heads apart from the heads"),
            (float(_rope_parameters(hf, yarn=True).get("partial_rotary_factor", 1.0)) != 1.0,
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
        rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": gpt.rotary_base}
        if gpt.rope_type == "yarn":
            rope.update(rope_type="yarn", factor=gpt.rotary_scaling_factor, mscale=gpt.mscale,
                        mscale_all_dim=gpt.mscale_all_dim, beta_fast=gpt.yarn_beta_fast,
                        beta_slow=gpt.yarn_beta_slow,
                        original_max_position_embeddings=gpt.yarn_original_max_position_embeddings)
            if gpt.no_yarn_correction_range_round_to_int:
                rope["truncate"] = False
        pattern = [is_moe_layer(i, gpt.moe_layer_freq) for i in range(gpt.num_layers)]
        hf: Dict[str, Any] = {
            **_decoder_hf_fields(gpt, self, dtype),
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
            yield _NO_MTP
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


_NO_MTP = "--mtp-num-layers (it has no multi-token prediction layers)"


def mtp_layers(hf: Dict[str, Any]) -> Optional[int]:
    """The MTP layers a DeepSeek-V3 / GLM-4.5 config declares (transformers' default: 1): Hub layers numbered on
    from num_hidden_layers, which transformers' models skip (hub_configs keeps them where the files hold them)."""
    return hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1)) or None


def _sigmoid_router(hf: Dict[str, Any]) -> Dict[str, Any]:
    """DeepSeek-V3's router (and GLM-4.5's): sigmoid scores, a correction bias for the choice only, groups."""
    groups = hf.get("n_group") or 1
    limits = dict(num_groups=groups, group_topk=hf["topk_group"]) if groups > 1 else {}
    # transformers scores a group by its two best experts whatever top-k is (Megatron's top_sum when k = 2 x groups)
    two_per_group = hf["num_experts_per_tok"] == 2 * (hf.get("topk_group") or 1)
    return dict(score_function="sigmoid", enable_expert_bias=True,
                group_score="top_sum" if two_per_group else "top2_sum", **limits)


def _holds_sigmoid_router(moe: MoEConfig) -> bool:
    return (moe.score_function == "sigmoid" and moe.enable_expert_bias and moe.top_k > 1 and not moe.bias
            and (not moe.num_groups or moe.group_score == "top2_sum"
                 or (moe.group_score == "top_sum" and moe.top_k == 2 * moe.group_topk)))


@dataclass(frozen=True)
class Glm4MoeFamily(Family):
    """GLM-4.5 / 4.6: GQA rotating part of each head (partial_rotary_factor, 0.5 where the config gives none, as
    transformers' config class sets it), q/k/v biases (attention_bias: the output projection has none), per-head
    q/k norms (use_qk_norm), DeepSeek-V3's router, shared experts, the first first_k_dense_replace layers dense."""

    def configs(self, hf: Dict[str, Any]) -> Tuple[GPTConfig, MoEConfig]:
        hf = with_defaults(hf, self)
        _refuse_unsupported(hf, self)
        if not hf.get("norm_topk_prob", True) or hf["num_experts_per_tok"] == 1:
            raise UnsupportedModel(f"{self.model_type} config norm_topk_prob=false or one expert per token: "
                                   "not supported by moezero")
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        rope = _rope_parameters(hf)
        layers, first_dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace") or 0
        pattern = [int(i >= first_dense) for i in range(layers)]
        gpt = GPTConfig(
            **_decoder_fields(hf, rope), kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
            group_query_attention=kv_heads != heads, num_query_groups=kv_heads,
            rotary_percent=float(rope.get("partial_rotary_factor", 0.5)), add_qkv_bias=bool(hf["attention_bias"]),
            qk_layernorm=bool(hf.get("use_qk_norm")), qk_layernorm_scope="head",
            moe_layer_freq=1 if all(pattern) else pattern, mtp_num_layers=mtp_layers(hf))
        shared = hf.get("n_shared_experts") or 0
        moe = MoEConfig(num_experts=_num_experts(hf), top_k=hf["num_experts_per_tok"],
                        ffn_hidden_size=hf["moe_intermediate_size"],
                        shared_expert_intermediate_size=hf["moe_intermediate_size"] * shared if shared else None,
                        topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                        aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)), **_sigmoid_router(hf))
        return gpt, moe

    def hf_config(self, gpt: GPTConfig, moe: MoEConfig, dtype: str) -> Dict[str, Any]:
        self.check_expressible(gpt, moe)
        pattern = [is_moe_layer(i, gpt.moe_layer_freq) for i in range(gpt.num_layers)]
        return {**_decoder_hf_fields(gpt, self, dtype), "num_key_value_heads": gpt.query_groups,
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
        if not _holds_sigmoid_router(moe):
            yield "a router other than sigmoid scores with an expert bias (groups by their two best)"


@dataclass(frozen=True)
class GptOssFamily(Family):
    """GPT-OSS: GQA with biases (attention_bias) and attention sinks, a sliding window on the layers layer_types
    names (transformers' sliding_window W keys: Megatron's window W - 1, 0), YaRN (truncate false: the correction
    range unrounded), every layer MoE: a router with a bias, softmax over the top-k logits, experts with biases and
    quick GELU gated by a clamped, offset up projection (swiglu_limit; alpha 1.702), stacked in the files."""

    def configs(self, hf: Dict[str, Any]) -> Tuple[GPTConfig, MoEConfig]:
        hf = with_defaults(hf, self)
        _refuse_unsupported(hf, self)
        if float(hf.get("swiglu_alpha", 1.702)) != 1.702:
            raise UnsupportedModel(f"{self.model_type} config swiglu_alpha={hf['swiglu_alpha']} (quick GELU's is "
                                   "1.702): not supported by moezero")
        if not (hf.get("rope_parameters") or hf.get("rope_scaling")):   # what its config class fills in
            hf = dict(hf, rope_parameters=dict(_GPT_OSS_ROPE, rope_theta=hf["rope_theta"]))
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        rope = _rope_parameters(hf, yarn=True)
        fields = dict(_decoder_fields(hf, rope), swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
                      activation_func_clamp_value=float(hf["swiglu_limit"]), softmax_type="learnable",
                      disable_bias_linear=not hf.get("attention_bias", True), kv_channels=hf.get("head_dim")
                      or hf["hidden_size"] // heads, group_query_attention=kv_heads != heads,
                      num_query_groups=kv_heads, **_windows(hf), **_yarn_fields(rope))
        moe = MoEConfig(num_experts=_num_experts(hf), top_k=hf["num_experts_per_tok"],
                        ffn_hidden_size=hf["intermediate_size"], pre_softmax=False, bias=True,
                        aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
        return GPTConfig(**fields), moe

    def hf_config(self, gpt: GPTConfig, moe: MoEConfig, dtype: str) -> Dict[str, Any]:
        self.check_expressible(gpt, moe)
        rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": gpt.rotary_base}
        if gpt.rope_type == "yarn":
            rope.update(rope_type="yarn", factor=gpt.rotary_scaling_factor, beta_fast=gpt.yarn_beta_fast,
                        beta_slow=gpt.yarn_beta_slow, truncate=not gpt.no_yarn_correction_range_round_to_int,
                        original_max_position_embeddings=gpt.yarn_original_max_position_embeddings)
        windowed = [is_window_layer(i, gpt) for i in range(gpt.num_layers)]
        return {**_decoder_hf_fields(gpt, self, dtype), "num_key_value_heads": gpt.query_groups,
                "head_dim": gpt.kv_channels, "attention_bias": not gpt.disable_bias_linear, "rope_parameters": rope,
                "sliding_window": gpt.window_size[0] + 1 if gpt.window_size else None,
                "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
                "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "intermediate_size": moe.ffn_hidden_size or gpt.ffn_hidden_size, "swiglu_alpha": 1.702,
                "swiglu_limit": gpt.activation_func_clamp_value, "router_aux_loss_coef": moe.aux_loss_coeff}

    def _differences(self, gpt: GPTConfig, moe: Optional[MoEConfig]):
        if gpt.mtp_num_layers:
            yield _NO_MTP
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


def _yarn_fields(rope: Dict[str, Any]) -> Dict[str, Any]:
    """The GPTConfig fields of a (standard-attention) YaRN rope_parameters; plain RoPE's where it is not YaRN."""
    if rope.get("rope_type", rope.get("type")) != "yarn":
        return dict(rope_type="rope")
    return dict(rope_type="yarn", rotary_scaling_factor=float(rope.get("factor", 1.0)),
                mscale=float(rope.get("mscale") or 0.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
                yarn_original_max_position_embeddings=rope.get("original_max_position_embeddings"),
                yarn_beta_fast=rope.get("beta_fast"), yarn_beta_slow=rope.get("beta_slow"),
                no_yarn_correction_range_round_to_int=rope.get("truncate", True) is False)


FAMILIES: Dict[str, Family] = {f.model_type: f for f in (
    Family("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), "num_local_experts",
           always_renormalises=True),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts",
           qkv_bias_field="qkv_bias", shared_expert=True, sparse_step=True),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts",
           qk_norm="head", sparse_step=True),
    Family("olmoe", "OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts",
           qk_norm="full_width"),
    DeepSeekFamily("deepseek_v2", "DeepseekV2ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
                   "n_routed_experts", shared_expert_module="shared_experts", version=2,
                   fp32_modules=("gate.weight",)),
    DeepSeekFamily("deepseek_v3", "DeepseekV3ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
                   "n_routed_experts", shared_expert_module="shared_experts", version=3,
                   fp32_modules=("e_score_correction_bias", "gate.weight")),
    Glm4MoeFamily("glm4_moe", "Glm4MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "n_routed_experts",
                  qk_norm="head", qkv_bias_field="attention_bias", shared_expert_module="shared_experts",
                  fp32_modules=("e_score_correction_bias", "gate.weight")),
    GptOssFamily("gpt_oss", "GptOssForCausalLM", "mlp", ("gate_up_proj", "gate_up_proj", "down_proj"),
                 "num_local_experts", qkv_bias_field="attention_bias", stacked_experts=True),
)}
DENSE = (Family("llama", "LlamaForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "", dense=True),
         Family("qwen3", "Qwen3ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "", qk_norm="head",
                dense=True))
FAMILIES.update({f.model_type: f for f in DENSE})
ALIASES = {"kimi_k2": "deepseek_v3"}   # Kimi-K2's config.json names its own type for DeepSeek-V3's architecture


def family_of(hf: Dict[str, Any]) -> Family:
    model_type = ALIASES.get(hf.get("model_type"), hf.get("model_type"))
    if model_type not in FAMILIES:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported by moezero (supported: "
                               f"{', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def family_for(gpt: GPTConfig, moe: Optional[MoEConfig]) -> Family:
    """The first family that holds a model of these configs exactly."""
    for family in FAMILIES.values():
        if not any(True for _ in family._differences(gpt, moe)):
            return family
    reasons = "; ".join(f"{f.model_type}: {next(f._differences(gpt, moe))}" for f in FAMILIES.values())
    raise UnsupportedModel(f"no Hugging Face family holds this model ({reasons})")


def _decoder_fields(hf: Dict[str, Any], rope: Dict[str, Any]) -> Dict[str, Any]:
    """The GPTConfig fields every family shares: a RoPE, RMSNorm, SwiGLU decoder without biases."""
    return dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"], seq_length=hf["max_position_embeddings"],
        max_position_embeddings=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
        make_vocab_size_divisible_by=1, position_embedding_type="rope", rotary_base=float(rope["rope_theta"]),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False), normalization="RMSNorm",
        norm_epsilon=hf["rms_norm_eps"], swiglu=True, disable_bias_linear=True, hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout") or 0.0), init_method_std=hf.get("initializer_range", 0.02))


def _decoder_hf_fields(gpt: GPTConfig, family: "Family", dtype: str) -> Dict[str, Any]:
    """The config.json fields every family shares."""
    return {"architectures": [family.architecture], "model_type": family.model_type, "vocab_size": gpt.vocab_size,
            "hidden_size": gpt.hidden_size, "intermediate_size": gpt.ffn_hidden_size,
            "num_hidden_layers": gpt.num_layers, "num_attention_heads": gpt.num_attention_heads, "hidden_act": "silu",
            "max_position_embeddings": gpt.max_position_embeddings, "rms_norm_eps": gpt.norm_epsilon,
            "rope_theta": gpt.rotary_base, "tie_word_embeddings": not gpt.untie_embeddings_and_output_weights,
            "attention_dropout": gpt.attention_dropout, "initializer_range": gpt.init_method_std,
            "dtype": dtype, "torch_dtype": dtype}


def _num_experts(hf: Dict[str, Any]) -> int:
    return hf.get("n_routed_experts") or hf.get("num_experts") or hf["num_local_experts"]


_DEFAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config_defaults.json")


@functools.lru_cache(maxsize=1)
def _declared_defaults() -> Dict[str, Dict[str, Any]]:
    with open(_DEFAULTS) as f:
        return json.load(f)["families"]


def with_defaults(hf: Dict[str, Any], family: "Family") -> Dict[str, Any]:
    """The config as transformers reads it: each field it omits takes the default its config class declares
    (config_defaults.json, from tools/hf_config_defaults.py), RoPE's base its `default_theta`; a derived field
    (head_dim) stays for the reader to derive."""
    defaults = _declared_defaults().get(family.model_type, {})
    aliases = defaults.get("attribute_map", {})
    named = set(hf) | {a for a, b in aliases.items() if b in hf} | {b for a, b in aliases.items() if a in hf}
    out = {k: v for k, v in defaults.items() if k not in ("default_theta", "attribute_map") and k not in named}
    out.update(hf)
    if "rope_theta" not in hf and not (hf.get("rope_parameters") or {}).get("rope_theta"):
        out["rope_theta"] = defaults.get("default_theta", 10000.0)
    return out


def _rope_parameters(hf: Dict[str, Any], yarn: bool = False) -> Dict[str, Any]:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in hf:
        rope.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    kind = rope.get("rope_type", rope.get("type", "default"))
    allowed = ("default", "yarn") if yarn else ("default",)
    if kind not in allowed:
        raise UnsupportedModel(f"rope_parameters.rope_type={kind!r}: not supported by moezero ({', '.join(allowed)})")
    if rope.get("attention_factor") is not None or (rope.get("truncate") is False and kind != "yarn"):
        raise UnsupportedModel("rope_parameters.attention_factor: not supported by moezero")
    return rope


def _refuse_unsupported(hf: Dict[str, Any], family: Family) -> None:
    """Config settings whose numbers moezero's model would not reproduce."""
    checks: List[Tuple[bool, str]] = [
        (hf.get("hidden_act", "silu") != "silu", f"hidden_act={hf.get('hidden_act')!r} (SwiGLU with silu only)"),
        (bool(hf.get("attention_bias")) and family.qkv_bias_field != "attention_bias",
         "attention_bias=true (biases on q/k/v and the output projection)"),
        (hf.get("clip_qkv") is not None, f"clip_qkv={hf.get('clip_qkv')}"),
        (bool(hf.get("use_sliding_window")), "use_sliding_window=true"),
        (family.model_type == "mixtral" and hf.get("sliding_window") is not None
         and hf["sliding_window"] < hf["max_position_embeddings"], f"sliding_window={hf.get('sliding_window')}"),
        (bool(hf.get("mlp_bias")), "mlp_bias=true"),
    ]
    for failed, what in checks:
        if failed:
            raise UnsupportedModel(f"{family.model_type} config {what}: not supported by moezero")

