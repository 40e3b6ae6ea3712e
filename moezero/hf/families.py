"""The Hugging Face families moezero reads and writes, one declaration each (family_*.py), and their lookups.

Every family here is a Llama-style decoder (RoPE, RMSNorm, SwiGLU, no biases but where noted) whose MoE
layers route with a top-k; they differ in a few settings:

  mixtral    Mixtral           experts under `block_sparse_moe`, w1/w3/w2; top-k weights renormalised
  qwen2_moe  Qwen1.5/2-MoE     q/k/v biases; a shared expert scaled by a sigmoid gate; dense layers by
                               decoder_sparse_step/mlp_only_layers; norm_topk_prob
  qwen3_moe  Qwen3-MoE         q/k RMSNorm per head; head_dim apart from hidden/heads; dense layers as Qwen2
  olmoe      OLMoE             q/k RMSNorm over all heads' width
  deepseek_v2  DeepSeek-V2     multi-latent attention (interleaved RoPE, YaRN); softmax routing, greedy or
                               group-limited by each group's best expert, scaled; shared experts; the first
                               first_k_dense_replace layers dense
  deepseek_v3  DeepSeek-V3,    as V2, routed by sigmoid scores with a correction bias for the choice only,
               Kimi-K2         groups scored by their top two, the top-k weights renormalised and scaled
  glm4_moe     GLM-4.5/4.6     GQA with RoPE on part of each head, q/k/v biases, optional per-head q/k norms;
                               DeepSeek-V3's router, shared experts and dense first layers
  gpt_oss      GPT-OSS         GQA with biases and attention sinks, sliding windows on alternate layers, YaRN;
                               experts with biases and a clamped quick GEGLU, stacked in the files (MXFP4 or not)
  llama, qwen3 (dense)         the dense sources of upcycling (--moe-use-upcycling): no MoE layers

`Family.configs(hf)` gives (GPTConfig, MoEConfig) from a config.json dict, `Family.hf_config(gpt, moe)` the
other way; a setting the family cannot express is an UnsupportedModel naming it.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from moezero.config import GPTConfig, MoEConfig
from moezero.hf.defaults import with_defaults
from moezero.hf.family import Family, UnsupportedModel
from moezero.hf.family_deepseek import DEEPSEEK_V2, DEEPSEEK_V3, mtp_layers
from moezero.hf.family_glm4 import GLM4_MOE
from moezero.hf.family_gpt_oss import GPT_OSS
from moezero.hf.family_llama import LLAMA
from moezero.hf.family_mixtral import MIXTRAL
from moezero.hf.family_olmoe import OLMOE
from moezero.hf.family_qwen2_moe import QWEN2_MOE
from moezero.hf.family_qwen3 import QWEN3, QWEN3_MOE

__all__ = [
    "ALIASES",
    "FAMILIES",
    "Family",
    "UnsupportedModel",
    "family_for",
    "family_of",
    "mtp_layers",
    "with_defaults",
]

FAMILIES: Dict[str, Family] = {
    f.model_type: f
    for f in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, DEEPSEEK_V2, DEEPSEEK_V3, GLM4_MOE, GPT_OSS, LLAMA, QWEN3)
}
ALIASES = {alias: f.model_type for f in FAMILIES.values() for alias in f.aliases}


def family_of(hf: Dict[str, Any]) -> Family:
    model_type = ALIASES.get(hf.get("model_type"), hf.get("model_type"))
    if model_type not in FAMILIES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported by moezero (supported: {', '.join(FAMILIES)})"
        )
    return FAMILIES[model_type]


def family_for(gpt: GPTConfig, moe: Optional[MoEConfig]) -> Family:
    """The first family that holds a model of these configs exactly."""
    for family in FAMILIES.values():
        if next(family.differences(gpt, moe), None) is None:
            return family
    reasons = "; ".join(f"{f.model_type}: {next(f.differences(gpt, moe))}" for f in FAMILIES.values())
    raise UnsupportedModel(f"no Hugging Face family holds this model ({reasons})")
