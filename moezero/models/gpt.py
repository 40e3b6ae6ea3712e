"""A GPT decoder for one device; every `moe_layer_freq`-th MLP is an MoELayer.

Shapes: B batch, S sequence, D hidden, H heads, h head dim, V vocabulary.

The model is built from its configs alone and knows no parallel layout: expert parallelism comes
in from outside as the factory that builds its MoE layers (`moezero.moe.expert_parallel(groups)`),
and ZeRO wraps the finished model.
Dropout draws from keys (seed, iteration, global sample index, site) when `SampleKeys` are
passed, so its masks do not depend on the parallel layout and recompute redraws them exactly.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from moezero.config import GPTConfig, MoEConfig, is_moe_layer, moe_layer_config
from moezero.keyed_random import SampleKeys, init_keyed_, is_bias, keyed_dropout
from moezero.moe import MoELayer, MoEStats
from moezero.moe.experts import DenseMLP

MoELayerFactory = Callable[..., MoELayer]   # (config, layer_number=i) -> the MoE MLP of layer i


class Rotary(nn.Module):
    """RoPE on the first `dim` dimensions of each head (rotate-half pairing, Megatron's and HF's default).

    The inverse frequencies are computed in fp32 as Megatron and transformers compute them; angles, cos and
    sin in the input's precision (at least fp32). Nothing is a buffer, so casting the model never rounds them.
    """

    def __init__(self, dim: int, base: float):
        super().__init__()
        self.dim = dim
        self.base = base
        self._tables: dict = {}

    def tables(self, seq_length: int, dtype: torch.dtype, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        key = (seq_length, dtype, device)
        if key not in self._tables:
            inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))
            angles = torch.outer(torch.arange(seq_length, dtype=torch.float32).to(dtype), inv_freq.to(dtype))
            self._tables[key] = angles.cos().to(device), angles.sin().to(device)
        return self._tables[key]

    def forward(self, x_BHSh: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x_BHSh.dtype, torch.float32)
        cos, sin = self.tables(x_BHSh.shape[2], dtype, x_BHSh.device)
        rotated, passed = x_BHSh[..., : self.dim].to(dtype), x_BHSh[..., self.dim:]
        x1, x2 = rotated.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BHSh.dtype)
        return torch.cat([out, passed], dim=-1) if passed.shape[-1] else out


def _norm(config: GPTConfig, size: Optional[int] = None) -> nn.Module:
    size = config.hidden_size if size is None else size
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(size, eps=config.norm_epsilon)
    return nn.LayerNorm(size, eps=config.norm_epsilon)


class CausalSelfAttention(nn.Module):
    """Multi-head attention with G key/value groups (G = H: MHA; G < H: grouped-query attention).

    The fused projection `qkv` holds [queries (H h) | keys (G h) | values (G h)] along its output; with
    --qk-layernorm, queries and keys are normalised per head (q_norm/k_norm of width h) or over all their
    heads at once (full_width: H h and G h, OLMoE's) before RoPE.
    """

    def __init__(self, config: GPTConfig, site: str):
        super().__init__()
        self.heads, self.groups, self.head_dim = config.num_attention_heads, config.query_groups, config.kv_channels
        self.dropout = config.attention_dropout
        self.recompute_core = config.recompute_granularity == "selective"
        self.site = site
        bias = not config.disable_bias_linear
        q_width, kv_width = self.heads * self.head_dim, self.groups * self.head_dim
        self.qkv = nn.Linear(config.hidden_size, q_width + 2 * kv_width, bias=bias or config.add_qkv_bias)
        self.proj = nn.Linear(q_width, config.hidden_size, bias=bias)
        self.q_norm = self.k_norm = None
        self.full_width_norm = config.qk_layernorm and config.qk_layernorm_scope == "full_width"
        if config.qk_layernorm:
            self.q_norm = _norm(config, q_width if self.full_width_norm else self.head_dim)
            self.k_norm = _norm(config, kv_width if self.full_width_norm else self.head_dim)
        self.rotary = None
        if config.position_embedding_type == "rope":
            self.rotary = Rotary(config.rotary_dim, config.rotary_base)

    def forward(self, x_BSD: torch.Tensor, keys: Optional[SampleKeys]) -> torch.Tensor:
        q, k, v = self._heads(self.qkv(x_BSD))
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        if self.recompute_core and _recomputing(self):   # selective recompute: only this part is redone
            y = checkpoint(self._core, q, k, v, keys, use_reentrant=False)
        else:
            y = self._core(q, k, v, keys)
        return self.proj(rearrange(y, "B H S h -> B S (H h)"))

    def _heads(self, qkv_BSF: torch.Tensor):
        """(q B H S h, k B G S h, v B G S h), queries and keys normalised if asked."""
        q, k, v = qkv_BSF.split([self.heads * self.head_dim, self.groups * self.head_dim,
                                 self.groups * self.head_dim], dim=-1)
        if self.full_width_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (rearrange(t, "B S (H h) -> B H S h", h=self.head_dim) for t in (q, k, v))
        if self.q_norm is not None and not self.full_width_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _core(self, q, k, v, keys):
        """softmax(q k^T / sqrt(h)) v, causal, with dropout on the probabilities; each key/value group
        serves H/G consecutive query heads."""
        if self.training and self.dropout > 0 and keys is not None:
            return self._attention_with_keyed_dropout(q, k, v, keys)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
                                              enable_gqa=self.groups != self.heads)

    def _attention_with_keyed_dropout(self, q, k, v, keys):
        """Explicit attention: SDPA's fused dropout draws from the global RNG, not from keys."""
        S = q.shape[2]
        if self.groups != self.heads:
            k, v = (t.repeat_interleave(self.heads // self.groups, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        softmax_dtype = torch.promote_types(q.dtype, torch.float32)   # fp32 at least (Megatron's), fp64 kept
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")).to(softmax_dtype), -1).to(q.dtype)
        probs = keyed_dropout(probs, self.dropout, True, keys, self.site)
        return probs @ v


class TransformerLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP is dense or MoE."""

    def __init__(self, config: GPTConfig, mlp: nn.Module, layer_number: int):
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        self.site = f"layer{layer_number}"
        self.input_norm = _norm(config)
        self.attention = CausalSelfAttention(config, site=f"{self.site}.attention")
        self.mlp_norm = _norm(config)
        self.moe_recompute = config.moe_layer_recompute
        self.mlp = mlp  # registered last: the params' order (ZeRO's bucket order) is input_norm ... mlp

    def forward(self, x_BSD: torch.Tensor, keys: Optional[SampleKeys]):
        attn = self.attention(self.input_norm(x_BSD), keys)
        x_BSD = x_BSD + keyed_dropout(attn, self.hidden_dropout, self.training, keys, self.site + ".attn_out")
        h = self.mlp_norm(x_BSD)
        stats = None
        if isinstance(self.mlp, MoELayer) and self.moe_recompute and _recomputing(self):
            out, stats = checkpoint(self.mlp, h, keys, use_reentrant=False)
        elif isinstance(self.mlp, MoELayer):
            out, stats = self.mlp(h, keys)
        else:
            out = self.mlp(h)
        x_BSD = x_BSD + keyed_dropout(out, self.hidden_dropout, self.training, keys, self.site + ".mlp_out")
        return x_BSD, stats


class GPTModel(nn.Module):
    """Decoder-only language model.

    Args:
        config: sizes, positions, norms, dropout, recompute.
        moe_config: the MoE layers' settings (hidden size and activation are taken from `config`),
            or None for a dense model.
        seed: keys the layout-invariant init: each param from (seed, its name[, global expert]).
        moe_layer: builds each MoE layer (default: all experts on this device); expert parallelism
            passes `moezero.moe.expert_parallel(groups)`.

    forward(tokens_BS, keys=None) -> (logits_BSV, [MoEStats of each MoE layer])
    """

    def __init__(self, config: GPTConfig, moe_config: Optional[MoEConfig] = None, seed: int = 0,
                 moe_layer: MoELayerFactory = MoELayer):
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size must be set (the training script takes it from the tokenizer)")
        self.config = config
        layer_moe = moe_layer_config(config, moe_config, seed) if moe_config is not None else None
        self.moe_config = layer_moe   # what every MoE layer is built from (None: a dense model)
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList([TransformerLayer(config, self._mlp(i, layer_moe, moe_layer), i)
                                     for i in range(config.num_layers)])
        self.final_norm = _norm(config)
        self.output = None
        if config.untie_embeddings_and_output_weights:
            self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        init_keyed_(self, seed, self._init_std)

    def _mlp(self, layer_number: int, moe_config: Optional[MoEConfig], moe_layer: MoELayerFactory) -> nn.Module:
        if moe_config is not None and is_moe_layer(layer_number, self.config.moe_layer_freq):
            return moe_layer(moe_config, layer_number=layer_number)
        activation = "swiglu" if self.config.swiglu else "gelu"
        return DenseMLP(self.config.hidden_size, self.config.ffn_hidden_size, activation,
                        bias=not self.config.disable_bias_linear)

    def _init_std(self, name: str, param: torch.Tensor) -> Optional[float]:
        """Megatron's init: N(0, std) weights, output projections scaled by 1/sqrt(2L); biases zero, norm
        weights their ones."""
        if is_bias(name):
            return 0.0
        if param.ndim < 2:
            return None
        std = self.config.init_method_std
        if name.endswith(("attention.proj.weight", "mlp.fc2.weight", "experts.w2", "shared_expert.fc2.weight")):
            std /= math.sqrt(2.0 * self.config.num_layers)
        return std

    def forward(self, tokens_BS: torch.Tensor, keys: Optional[SampleKeys] = None):
        x = self.embedding(tokens_BS)
        if self.position_embedding is not None:
            x = x + self.position_embedding(torch.arange(tokens_BS.shape[1], device=tokens_BS.device))
        x = keyed_dropout(x, self.config.hidden_dropout, self.training, keys, "embedding")
        all_stats: List[MoEStats] = []
        for first, last, recompute in recompute_chunks(self.config):
            if recompute and _recomputing(self):
                x, stats = checkpoint(self._layers, first, last, x, keys, use_reentrant=False)
            else:
                x, stats = self._layers(first, last, x, keys)
            all_stats += stats
        x = self.final_norm(x)
        # an untied head is called as a module, so whatever wraps modules (ZeRO-3 engines) sees it run
        logits = F.linear(x, self.embedding.weight) if self.output is None else self.output(x)
        return logits, all_stats


    def _layers(self, first: int, last: int, x: torch.Tensor, keys: Optional[SampleKeys]):
        """Layers [first, last) in order; their MoE stats."""
        all_stats = []
        for layer in self.layers[first:last]:
            x, stats = layer(x, keys)
            if stats is not None:
                all_stats.append(stats)
        return x, all_stats


def recompute_chunks(config: GPTConfig) -> List[Tuple[int, int, bool]]:
    """(first, last, recomputed) runs of layers: Megatron's full recompute checkpoints chunks of
    --recompute-num-layers layers (uniform) or each of the first --recompute-num-layers layers (block)."""
    n, k = config.num_layers, config.recompute_num_layers
    if config.recompute_granularity != "full":
        return [(0, n, False)]
    if config.recompute_method == "uniform":
        return [(i, min(i + k, n), True) for i in range(0, n, k)]
    return [(i, i + 1, True) for i in range(k)] + ([(k, n, False)] if k < n else [])


def _recomputing(module: nn.Module) -> bool:
    """Activation checkpointing applies to training forwards that build a graph."""
    return module.training and torch.is_grad_enabled()


def language_model_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, loss_mask_BS: torch.Tensor
                        ) -> torch.Tensor:
    """Mean token cross-entropy of one micro-batch (fp32), over the positions the mask keeps."""
    logits = logits_BSV.to(torch.promote_types(logits_BSV.dtype, torch.float32))
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels_BS.reshape(-1), reduction="none")
    mask = loss_mask_BS.reshape(-1).to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)
