"""FLOPs of one global batch as Megatron counts them for `--log-throughput` (its
num_floating_point_operations; tests/assets/megatron_flops.json holds its figures).

Every GEMM counts 2 FLOPs per multiply-add (FMA) and runs 3 times (forward, and the data and weight
gradients in backward): QKV and output projections, causal attention (QK^T and its product with V, half
of each under the mask), the dense MLPs, per MoE layer the top-k experts a token is routed to and the
shared expert (routing, norms and element-wise work are not counted), and the logits.
"""

from __future__ import annotations

from typing import Optional

from moezero.config import GPTConfig, MoEConfig, is_moe_layer

_FORWARD_AND_BACKWARD, _FMA = 3, 2


def flops_per_batch(model: GPTConfig, moe: Optional[MoEConfig], vocab_size: int, batch_size: int) -> float:
    """FLOPs of one step over `batch_size` sequences of --seq-length tokens (`vocab_size`: the padded one)."""
    h, depths = model.hidden_size, model.mtp_num_layers or 0
    layers = model.num_layers + depths  # Megatron's: an MTP depth's layer is of the last layer's kind
    tokens = batch_size * model.seq_length
    # SwiGLU: gate and up projections, then down; else up, down. Megatron's formula asks --swiglu only: it counts
    # --quick-geglu's three GEMMs as two, and windowed attention as full (its figure is what this reproduces)
    gemms_per_ffn = 3 if model.swiglu else 2
    kinds = [is_moe_layer(min(i, model.num_layers - 1), model.moe_layer_freq) for i in range(layers)]
    moe_layers = sum(kinds) if moe is not None else 0
    mlp = model.ffn_hidden_size * gemms_per_ffn * (layers - moe_layers)
    if moe_layers:
        expert_width = moe.ffn_hidden_size or model.ffn_hidden_size
        shared_width = moe.shared_expert_intermediate_size or 0
        mlp += (expert_width * moe.top_k + shared_width) * gemms_per_ffn * moe_layers
    projections, core = _latent_attention(model) if model.multi_latent_attention else _attention(model)
    mtp = depths * (3 * h + 2 * h * h)  # each depth's two norms and final norm, its projection of 2h to h
    per_token = h * mlp + layers * projections + h * vocab_size * (1 + depths) + mtp
    attention = layers * batch_size * model.seq_length**2 * core  # QK^T and scores x V, each halved by the mask
    return _FORWARD_AND_BACKWARD * _FMA * (tokens * per_token + attention)


def _attention(model: GPTConfig):
    """(per-token projection FMAs, per-(query, key) core FMAs) of one layer: Q, K, V, output; QK^T and PV."""
    h, queries, keys = (
        model.hidden_size,
        model.num_attention_heads * model.kv_channels,
        model.query_groups * model.kv_channels,
    )
    return h * (queries + 2 * keys) + queries * h, queries


def _latent_attention(model: GPTConfig):
    """The same for MLA, as Megatron counts it (the latent norms are the +1s)."""
    h, heads = model.hidden_size, model.num_attention_heads
    qk, pos, v = model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim
    if model.q_lora_rank is None:
        queries = h * heads * (qk + pos)
    else:
        queries = model.q_lora_rank * (h + heads * (qk + pos) + 1)
    projections = queries + model.kv_lora_rank * (h + heads * (qk + v) + 1) + h * pos + heads * v * h
    return projections, heads * (qk + pos) / 2 + heads * v / 2


def tflops_per_rank(flops: float, step_seconds: float, world_size: int) -> float:
    """Megatron's 'throughput per GPU (TFLOP/s/GPU)'."""
    return flops / (step_seconds * 10**12 * world_size)
