"""The Hugging Face family declaration (`Family`: the switches a Llama-style MoE family differs by) and what every
family shares: a config.json completed with transformers' defaults, its RoPE, the decoder's fields both ways,
the settings no family reproduces. The families that need more are one file each (family_deepseek.py,
family_glm4.py, family_gpt_oss.py); `families.py` lists them all."""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from moezero.config import GPTConfig, MoEConfig, is_moe_layer


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
        refuse_unsupported(hf, self)
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        rope = rope_parameters(hf)
        # rotary over the whole head: transformers' models of these families ignore partial_rotary_factor
        gpt = GPTConfig(
            **decoder_fields(hf, rope), kv_channels=head_dim, group_query_attention=kv_heads != heads,
            num_query_groups=kv_heads, rotary_percent=1.0,
            add_qkv_bias=bool(hf.get(self.qkv_bias_field, False)) if self.qkv_bias_field else False,
            qk_layernorm=self.qk_norm is not None, qk_layernorm_scope=self.qk_norm or "head",
            moe_layer_freq=1 if self.dense else self._moe_layers(hf))
        if self.dense:
            return gpt, None
        renormalise = self.always_renormalises or bool(hf.get("norm_topk_prob", False))
        moe = MoEConfig(
            num_experts=num_experts_of(hf), top_k=hf["num_experts_per_tok"],
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
        hf: Dict[str, Any] = dict(decoder_hf_fields(gpt, self, dtype), num_key_value_heads=gpt.query_groups,
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
            yield NO_MTP
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


NO_MTP = "--mtp-num-layers (it has no multi-token prediction layers)"


def mtp_layers(hf: Dict[str, Any]) -> Optional[int]:
    """The MTP layers a DeepSeek-V3 / GLM-4.5 config declares (transformers' default: 1): Hub layers numbered on
    from num_hidden_layers, which transformers' models skip (hub_configs keeps them where the files hold them)."""
    return hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1)) or None


def rope_hf_parameters(gpt: GPTConfig) -> Dict[str, Any]:
    """transformers' rope_parameters of a model's RoPE (YaRN's with its fields; truncate only where false)."""
    rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": gpt.rotary_base}
    if gpt.rope_type == "yarn":
        rope.update(rope_type="yarn", factor=gpt.rotary_scaling_factor, mscale=gpt.mscale,
                    mscale_all_dim=gpt.mscale_all_dim, beta_fast=gpt.yarn_beta_fast, beta_slow=gpt.yarn_beta_slow,
                    original_max_position_embeddings=gpt.yarn_original_max_position_embeddings)
        if gpt.no_yarn_correction_range_round_to_int:
            rope["truncate"] = False
    return rope


def yarn_fields(rope: Dict[str, Any]) -> Dict[str, Any]:
    """The GPTConfig fields of a (standard-attention) YaRN rope_parameters; plain RoPE's where it is not YaRN."""
    if rope.get("rope_type", rope.get("type")) != "yarn":
        return dict(rope_type="rope")
    return dict(rope_type="yarn", rotary_scaling_factor=float(rope.get("factor", 1.0)),
                mscale=float(rope.get("mscale") or 0.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
                yarn_original_max_position_embeddings=rope.get("original_max_position_embeddings"),
                yarn_beta_fast=rope.get("beta_fast"), yarn_beta_slow=rope.get("beta_slow"),
                no_yarn_correction_range_round_to_int=rope.get("truncate", True) is False)


def decoder_fields(hf: Dict[str, Any], rope: Dict[str, Any]) -> Dict[str, Any]:
    """The GPTConfig fields every family shares: a RoPE, RMSNorm, SwiGLU decoder without biases."""
    return dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"], seq_length=hf["max_position_embeddings"],
        max_position_embeddings=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
        make_vocab_size_divisible_by=1, position_embedding_type="rope", rotary_base=float(rope["rope_theta"]),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False), normalization="RMSNorm",
        norm_epsilon=hf["rms_norm_eps"], swiglu=True, disable_bias_linear=True, hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout") or 0.0), init_method_std=hf.get("initializer_range", 0.02))


def decoder_hf_fields(gpt: GPTConfig, family: "Family", dtype: str) -> Dict[str, Any]:
    """The config.json fields every family shares."""
    return {"architectures": [family.architecture], "model_type": family.model_type, "vocab_size": gpt.vocab_size,
            "hidden_size": gpt.hidden_size, "intermediate_size": gpt.ffn_hidden_size,
            "num_hidden_layers": gpt.num_layers, "num_attention_heads": gpt.num_attention_heads, "hidden_act": "silu",
            "max_position_embeddings": gpt.max_position_embeddings, "rms_norm_eps": gpt.norm_epsilon,
            "rope_theta": gpt.rotary_base, "tie_word_embeddings": not gpt.untie_embeddings_and_output_weights,
            "attention_dropout": gpt.attention_dropout, "initializer_range": gpt.init_method_std,
            "dtype": dtype, "torch_dtype": dtype}


def num_experts_of(hf: Dict[str, Any]) -> int:
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


def rope_parameters(hf: Dict[str, Any], yarn: bool = False) -> Dict[str, Any]:
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


def refuse_unsupported(hf: Dict[str, Any], family: Family) -> None:
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
