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

from typing import Any, Dict, Optional

from moezero.config import GPTConfig, MoEConfig
from moezero.hf.family import Family, UnsupportedModel, mtp_layers, with_defaults
from moezero.hf.family_deepseek import DeepSeekFamily
from moezero.hf.family_glm4 import Glm4MoeFamily
from moezero.hf.family_gpt_oss import GptOssFamily

__all__ = ["ALIASES", "FAMILIES", "Family", "UnsupportedModel", "family_for", "family_of", "mtp_layers",
           "with_defaults"]

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
