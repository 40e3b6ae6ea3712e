"""Causal self-attention: multi-head and grouped-query, with optional q/k norms and RoPE; and the core
(softmax(q k^T * scale) v, causal) that multi-latent attention shares.

Shapes: B batch, S sequence, D hidden, H query heads, G key/value groups, h head width.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from moezero.config import GPTConfig
from moezero.keyed_random import SampleKeys, keyed_dropout
from moezero.models.rope import Rotary, yarn_of
from moezero.ops.rms_norm import rms_norm


def recomputing(module: nn.Module) -> bool:
    """Activation checkpointing applies to training forwards that build a graph."""
    return module.training and torch.is_grad_enabled()


def norm_layer(config: GPTConfig, size: Optional[int] = None) -> nn.Module:
    """--normalization's norm over `size` (default the model width) with --norm-epsilon (zero-centred with
    --apply-layernorm-1p)."""
    size = config.hidden_size if size is None else size
    if config.normalization == "RMSNorm":
        return (RMSNorm1p if config.apply_layernorm_1p else RMSNorm)(size, eps=config.norm_epsilon)
    return (LayerNorm1p if config.apply_layernorm_1p else nn.LayerNorm)(size, eps=config.norm_epsilon)


class LayerNorm1p(nn.LayerNorm):
    """Megatron's zero-centred gamma (--apply-layernorm-1p): the weight holds gamma - 1, starts at 0, and the norm
    scales by weight + 1."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm module, computed by moezero's kernel on the CPU (moezero/ops/rms_norm.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, list(self.normalized_shape), self.weight, self.eps)


class RMSNorm1p(RMSNorm):
    """RMSNorm with Megatron's zero-centred gamma (Transformer Engine's zero_centered_gamma)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, list(self.normalized_shape), self.weight + 1, self.eps)


class CausalSelfAttention(nn.Module):
    """Multi-head attention with G key/value groups (G = H: MHA; G < H: grouped-query attention).

    The fused projection `qkv` holds [queries (H h) | keys (G h) | values (G h)] along its output; with
    --qk-layernorm, queries and keys are normalised per head (q_norm/k_norm of width h) or over all their
    heads at once (full_width: H h and G h, OLMoE's) before RoPE.
    """

    def __init__(
        self,
        config: GPTConfig,
        site: str,
        window: Optional[int] = None,
        layer_number: int = 0,
        context_parallel: Optional[Any] = None,
    ):
        super().__init__()
        # moezero/context_parallel.py's ContextParallel: this rank holds a part of each sequence (None: all of it)
        self.context_parallel = context_parallel if context_parallel is not None and context_parallel.size > 1 else None
        self.cp_comm = None if self.context_parallel is None else self.context_parallel.comm_type(layer_number)
        self.heads, self.groups, self.head_dim = config.num_attention_heads, config.query_groups, config.kv_channels
        self.layer_scale = query_key_layer_scale(config, layer_number)
        self.dropout = config.attention_dropout
        # keys -> the keys of this module's heads' dropout masks, where it holds a block of the model's heads (a
        # tensor-parallel plan sets it from outside; None: all of them)
        self.head_keys: Optional[Callable[[Any], Any]] = None
        self.window = window  # a sliding window: each query sees itself and the `window` keys before it
        offset = softmax_offset(config)
        if offset is None or isinstance(offset, nn.Parameter):
            self.softmax_offset = offset
        else:  # a constant: a buffer, so that moving or casting the model moves it too
            self.register_buffer("softmax_offset", offset, persistent=False)
        self.recompute_core = config.recomputes("core_attn")
        self.site = site
        bias = not config.disable_bias_linear
        q_width, kv_width = self.heads * self.head_dim, self.groups * self.head_dim
        self.qkv = nn.Linear(config.hidden_size, q_width + 2 * kv_width, bias=bias or config.add_qkv_bias)
        self.proj = nn.Linear(q_width, config.hidden_size, bias=bias)
        self.q_norm = self.k_norm = None
        self.full_width_norm = config.qk_layernorm and config.qk_layernorm_scope == "full_width"
        if config.qk_layernorm:
            self.q_norm = norm_layer(config, q_width if self.full_width_norm else self.head_dim)
            self.k_norm = norm_layer(config, kv_width if self.full_width_norm else self.head_dim)
        self.rotary = None
        if config.position_embedding_type == "rope":
            self.rotary = Rotary(
                config.rotary_dim,
                config.rotary_base,
                yarn_of(config),
                position_interpolation=config.rotary_seq_len_interpolation_factor,
            )

    def forward(self, x_BSD: torch.Tensor, keys: Optional[SampleKeys]) -> torch.Tensor:
        q, k, v = self._heads(self.qkv(x_BSD))
        cp, positions, heads = self.context_parallel, None, None
        if cp is not None:  # this rank's global positions (of q's sequence: its cp part, also under SP)
            positions = cp.positions(q.shape[2], q.device)
            keys = cp.attention_keys(keys)
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if self.cp_comm == "a2a":  # the whole sequence of 1/cp of the heads, attended as in one process
            q, k, v = (cp.heads_to_sequence(t) for t in (q, k, v))
            heads, positions = cp.head_block(self.heads), None
            keys = cp.head_block_keys(keys, self.heads)
        elif cp is not None:  # queries at this rank's positions; keys and values of the whole sequence
            k, v = cp.gather_sequence(k, dim=2), cp.gather_sequence(v, dim=2)
        if self.head_keys is not None and keys is not None:  # tensor parallelism: the rank's heads
            keys = self.head_keys(keys)
        if self.cp_comm == "all_gather":
            keys = cp.query_row_keys(keys, q.shape[2])
        if self.recompute_core and recomputing(self):  # selective recompute: only this part is redone
            y = checkpoint(self._core, q, k, v, keys, positions, heads, use_reentrant=False)
        else:
            y = self._core(q, k, v, keys, positions, heads)
        if self.cp_comm == "a2a":
            y = cp.sequence_to_heads(y)
        return self.proj(rearrange(y, "B H S h -> B S (H h)"))

    def _heads(self, qkv_BSF: torch.Tensor):
        """(q B H S h, k B G S h, v B G S h), queries and keys normalised if asked."""
        q, k, v = qkv_BSF.split(
            [self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim], dim=-1
        )
        if self.full_width_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (rearrange(t, "B S (H h) -> B H S h", h=self.head_dim) for t in (q, k, v))
        if self.q_norm is not None and not self.full_width_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _core(self, q, k, v, keys, positions=None, heads=None):
        """`positions`: the queries' (all_gather cp); `heads`: the block of heads q holds (a2a cp)."""
        sinks = self.softmax_offset
        if sinks is not None and heads is not None:
            sinks = sinks[heads]
        return causal_attention(
            q,
            k,
            v,
            self.dropout,
            self.training,
            keys,
            self.site,
            window=self.window,
            sinks=sinks,
            layer_scale=self.layer_scale,
            query_positions=positions,
        )


def query_key_layer_scale(config: GPTConfig, layer_number: int) -> Optional[int]:
    """--apply-query-key-layer-scaling: the layer's number as megatron-core's DotProductAttention counts it (from 1,
    the MTP depths' layers after the decoder's), which the scores are divided by and multiplied back by."""
    return layer_number + 1 if config.apply_query_key_layer_scaling else None


def softmax_offset(config: GPTConfig) -> Optional[torch.Tensor]:
    """--softmax-type's logit per head in each softmax denominator: learnable, a param (GPT-OSS's sinks);
    off-by-one, zeros (a constant); vanilla, none."""
    if config.softmax_type == "learnable":
        return nn.Parameter(torch.zeros(config.num_attention_heads))
    if config.softmax_type == "off-by-one":
        return torch.zeros(config.num_attention_heads)
    return None


# SDPA's CPU flash kernel (forward and backward) is slower than two GEMMs and a softmax for short sequences in bf16,
# and much faster for long ones; the two break even a little above this length. In fp32 the explicit path gains
# nothing. In fp16, on a CPU without fp16 units (AVX-512 without AVX512-FP16/AMX-FP16), SDPA is the faster at every
# length.
EXPLICIT_CPU_MAX_SEQ = 128


def causal_attention(
    q_BHSh,
    k_BGSh,
    v_BGSv,
    dropout: float,
    training: bool,
    keys: Optional[SampleKeys],
    site: str,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    layer_scale: Optional[int] = None,
    query_positions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v, causal (scale default 1/sqrt(h)); each key/value group serves H/G consecutive
    query heads; dropout on the probabilities, drawn from `keys` when given (SDPA's fused dropout draws from the
    global RNG, so that case runs the explicit path, as do short bf16 sequences on the CPU). With `window`, a
    query sees only itself and the `window` keys before it; with `sinks` (H), each head's softmax has that logit
    in its denominator too (Megatron's SoftmaxOne); with `layer_scale` L, the scores are q k^T * scale / L in the
    inputs' dtype, multiplied back by L in fp32 (Megatron's --apply-query-key-layer-scaling): all three run the
    explicit path. With `query_positions` (context parallelism), the queries are those positions of a sequence
    whose keys and values are all given: the masks come from the positions (`keys` then a cp rank's,
    moezero/context_parallel.py), SDPA taking the causal one as a boolean mask where no other reason asks for the
    explicit path (its CPU kernel never forms the scores: docs/benchmarks.md#tp-cp)."""
    dropout = dropout if training else 0.0
    keyed = dropout > 0 and keys is not None
    short = (
        q_BHSh.device.type == "cpu"
        and q_BHSh.dtype == torch.bfloat16
        and q_BHSh.shape[2] <= EXPLICIT_CPU_MAX_SEQ
        and (dropout == 0 or keyed)
    )
    if keyed or short or any(x is not None for x in (window, sinks, layer_scale)):
        return _explicit_attention(
            q_BHSh, k_BGSh, v_BGSv, dropout, keys, site, scale, window, sinks, layer_scale, query_positions
        )
    causal = None  # a cp rank's queries: each sees the keys at or before its global position
    if query_positions is not None:
        causal = query_positions[:, None] >= torch.arange(k_BGSh.shape[2], device=q_BHSh.device)[None, :]
    return F.scaled_dot_product_attention(
        q_BHSh,
        k_BGSh,
        v_BGSv,
        attn_mask=causal,
        is_causal=causal is None,
        scale=scale,
        dropout_p=dropout,
        enable_gqa=k_BGSh.shape[1] != q_BHSh.shape[1],
    )


def _explicit_attention(
    q, k, v, dropout, keys, site, scale, window=None, sinks=None, layer_scale=None, query_positions=None
):
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if layer_scale is None:
        q = q * scale  # before the product: fp16's range
        scores = q @ k.transpose(-1, -2)
    else:
        scores = _layer_scaled_scores(q, k, scale, layer_scale)
    # softmax in fp32 at least (Megatron's): torch's bf16/fp16 softmax accumulates in fp32 and rounds once, the
    # same probabilities as an fp32 softmax cast back (bitwise, measured on the CPU) without two casts of S x S
    if query_positions is not None:
        scores = _mask_outside_window(scores, window, query_positions)
    else:
        scores = mask_future_(scores) if window is None else _mask_outside_window(scores, window)
    if sinks is None:
        probs = torch.softmax(scores, -1)
    else:  # the sink's column joins each row's softmax and is dropped after it
        sink = sinks.to(scores).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), -1)[..., :-1]
    probs = probs.to(v.dtype)
    if query_positions is not None and keys is not None and dropout > 0:  # the whole sequence's mask, our rows
        mask = keys.query_rows_dropout_mask(site, probs.shape[1], dropout, probs.device)
        return (probs * mask.to(v.dtype)) @ v
    return keyed_dropout(probs, dropout, True, keys, site) @ v


def _layer_scaled_scores(q, k, scale: float, layer_scale: int) -> torch.Tensor:
    """megatron-core's DotProductAttention with apply_query_key_layer_scaling: one batched GEMM with alpha =
    scale / L in the inputs' dtype (fp16 keeps its range), then FusedScaleMaskSoftmax's multiplication by L in
    fp32 (at least), where the softmax runs."""
    B, H, S, h = q.shape
    out = torch.empty(B * H, S, k.shape[2], dtype=q.dtype, device=q.device)
    scores = torch.baddbmm(
        out, q.reshape(B * H, S, h), k.reshape(B * H, -1, h).transpose(1, 2), beta=0.0, alpha=scale / layer_scale
    ).view(B, H, S, -1)
    return scores.to(torch.promote_types(scores.dtype, torch.float32)) * layer_scale


def _mask_outside_window(
    scores: torch.Tensor, window: Optional[int], query_positions: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """-inf where a key lies after its query or more than `window` places before it (Megatron's window L,0; None:
    no window); queries at `query_positions` (default 0, 1, ...) of the keys' sequence."""
    queries, keys = scores.shape[-2:]
    position = torch.arange(queries, device=scores.device) if query_positions is None else query_positions
    offset = position[:, None] - torch.arange(keys, device=scores.device)[None, :]  # query - key
    outside = offset < 0
    if window is not None:
        outside = outside | (offset > window)
    return scores.masked_fill(outside, float("-inf"))


def mask_future_(scores: torch.Tensor) -> torch.Tensor:
    """-inf where a key lies after its query (the last two dims, square: query, key), in place: the product's
    backward needs q and k, not its output, so the masked scores need no copy. Adding a 0 / -inf bias is faster
    than masked_fill_, needs no op in backward and gives the same bits for finite scores; fp16 keeps masked_fill_,
    as there a score can overflow to +inf, which the bias would turn into NaN where masked_fill_ writes -inf."""
    queries, keys = scores.shape[-2:]
    if scores.dtype == torch.float16:
        causal = torch.ones(queries, keys, dtype=torch.bool, device=scores.device).tril()
        return scores.masked_fill_(~causal, float("-inf"))
    future = torch.full((queries, keys), float("-inf"), dtype=scores.dtype, device=scores.device).triu_(1)
    return scores.add_(future)
