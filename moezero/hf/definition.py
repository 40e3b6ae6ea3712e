"""What a model's weights mean, field by field, and the words for where two models differ. A family holds a model
when the model its config.json reads back as has the same definition (Family.differences).

The definition is the configs' model-defining fields (defines_model=True) in one spelling each: a layer pattern
as a 0/1 per layer, grouped-query attention as its key/value heads, a group score as the experts it sums; a field
that the model's other settings make moot (MLA's ranks in standard attention, YaRN's without YaRN, the dense width
where every layer is MoE) is left out. Both sides of a comparison leave out the same fields unless a field that
decides it differs, and that one is named.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional, Set

from moezero.config import GPTConfig, MoEConfig, flag_of, is_moe_layer, is_window_layer, model_defining_fields

MLA_FIELDS = {"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"}
YARN_FIELDS = {
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "no_yarn_correction_range_round_to_int",
}
# named first where they differ, in this order: a setting that makes others moot comes before them
FIRST = (
    "mtp_num_layers",
    "rotary_percent",
    "apply_layernorm_1p",
    "multi_latent_attention",
    "rope_type",
    "position_embedding_type",
    "rotary_seq_len_interpolation_factor",
    "normalization",
    "swiglu",
    "quick_geglu",
    "disable_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "qk_layernorm_scope",
    "softmax_type",
    "window_size",
    "moe_layer_freq",
    "moe.shared_expert_intermediate_size",
    "moe.shared_expert_gate",
    "moe.score_function",
    "moe.pre_softmax",
)
WORDS = {"moe.bias": "router and expert biases"}  # fields without a flag


def definition(gpt: GPTConfig, moe: Optional[MoEConfig]) -> Dict[str, Any]:
    """The model of (gpt, moe) (moe None: dense), as {field: value}; MoEConfig's fields prefixed "moe."."""
    out = {name: getattr(gpt, name) for name in model_defining_fields(GPTConfig)}
    out["num_query_groups"] = gpt.query_groups
    out["add_qkv_bias"] = gpt.add_qkv_bias or not gpt.disable_bias_linear
    if gpt.multi_latent_attention and gpt.position_embedding_type == "none":
        out["position_embedding_type"] = "rope"  # MLA rotates its positional part either way
    windows = tuple(int(is_window_layer(i, gpt)) for i in range(gpt.num_layers))
    out["window_size"] = gpt.window_size if any(windows) else None
    out["window_attn_skip_freq"] = windows if any(windows) else None
    moot = {"group_query_attention"} | _moot_in_attention(gpt)
    if moe is None:
        moot.add("moe_layer_freq")
    else:
        out["moe_layer_freq"] = pattern = tuple(int(is_moe_layer(i, gpt.moe_layer_freq)) for i in range(gpt.num_layers))
        if all(pattern):
            moot.add("ffn_hidden_size")
        out.update(("moe." + name, value) for name, value in _moe_definition(gpt, moe).items())
    return {name: value for name, value in out.items() if name not in moot}


def _moot_in_attention(gpt: GPTConfig) -> Set[str]:
    moot = {"qk_layernorm_scope"} if not gpt.qk_layernorm else set()
    if gpt.multi_latent_attention:  # its own head widths and biases; RoPE on its positional part
        moot |= {"kv_channels", "num_query_groups", "qk_layernorm_scope", "rotary_percent", "add_qkv_bias"}
    else:
        moot |= MLA_FIELDS
    rotates = gpt.multi_latent_attention or gpt.position_embedding_type == "rope"
    if not rotates:
        moot |= {"rotary_base", "rotary_percent", "rope_type", "rotary_seq_len_interpolation_factor"}
    if not rotates or gpt.rope_type != "yarn":
        moot |= YARN_FIELDS
    return moot


def _moe_definition(gpt: GPTConfig, moe: MoEConfig) -> Dict[str, Any]:
    out = {name: getattr(moe, name) for name in model_defining_fields(MoEConfig)}
    out.update(
        ffn_hidden_size=moe.ffn_hidden_size or gpt.ffn_hidden_size,
        topk_scaling_factor=1.0 if moe.topk_scaling_factor is None else moe.topk_scaling_factor,
        bias=not gpt.disable_bias_linear if moe.bias is None else moe.bias,
    )
    moot = {"pre_softmax"} if moe.score_function != "softmax" else set()  # sigmoid weights: renormalised
    if not moe.shared_expert_intermediate_size:
        moot.add("shared_expert_gate")
    if moe.num_groups and moe.group_topk < moe.num_groups:
        summed = {"max": 1, "top2_sum": 2}.get(moe.group_score) or moe.top_k // moe.group_topk
        out["group_score"] = {1: "max", 2: "top2_sum"}.get(summed, "top_sum")
    else:  # every group kept: no limit
        out["num_groups"] = None
        moot |= {"group_topk", "group_score"}
    return {name: value for name, value in out.items() if name not in moot}


def differing(ours: Dict[str, Any], theirs: Dict[str, Any]) -> Iterator[str]:
    """Each field where the definition `ours` differs from `theirs`, as words: ours (it has theirs)."""
    order = [name for name in FIRST if name in ours] + [name for name in ours if name not in FIRST]
    for name in order:
        if name in theirs and ours[name] != theirs[name]:
            yield f"{_spelled(name, ours[name])} (it has {_spelled(name, theirs[name])})"


def _spelled(name: str, value: Any) -> str:
    """A field's value as the command line gives it: --flag, no --flag, --flag value."""
    config, field = (MoEConfig, name[4:]) if name.startswith("moe.") else (GPTConfig, name)
    flag = WORDS.get(name) or flag_of(config, field)
    if value is True:
        return flag
    if value is False or value is None:
        return f"no {flag}"
    if isinstance(value, tuple):
        value = "[" + ",".join(str(v) for v in value) + "]"
    return f"{flag} {value}"
