"""Multi-latent attention (DeepSeek-V2, Liu et al. 2024; DeepSeek-V3, Kimi-K2), as Megatron's MLA.

Queries come from the hidden state directly (q_proj) or through a low-rank latent (q_down -> q_norm -> q_up,
--q-lora-rank); keys and values from one latent of --kv-lora-rank (kv_down -> kv_norm -> kv_up). The latent
norms exist with --qk-layernorm, as in Megatron (DeepSeek's checkpoints have them). Each head's
query and key are a part without positions (--qk-head-dim) and a RoPE part (--qk-pos-emb-head-dim) whose key
is shared by all heads and comes straight from kv_down; values are --v-head-dim wide. RoPE pairs are DeepSeek's
interleaved ones, with YaRN when --rope-type yarn; the softmax scale is 1/sqrt(qk + pos dims) times YaRN's
mscale(factor, mscale_all_dim)^2.

Tensor parallelism (training/tensor_parallel.py, Megatron's layout) splits the heads: q_proj / q_up and kv_up
column-parallel, proj row-parallel, the down projections and latent norms whole on every rank (under sequence
parallelism on the rank's sequence shard); the shared RoPE key enters the tensor-parallel region through
`key_position_region` (all-gathered under sequence parallelism, else its gradient, each rank's heads' part, summed
over tp).
Context parallelism (moezero/context_parallel.py) runs as for CausalSelfAttention: RoPE at the rank's global
positions, keys and values all-gathered (the shared RoPE key once, not per head) or heads traded (a2a).

Shapes: B batch, S sequence, D hidden, H heads, n/r/v the no-position, RoPE and value widths per head.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from moezero.config import GPTConfig
from moezero.keyed_random import SampleKeys
from moezero.models.attention import causal_attention, norm_layer, query_key_layer_scale, recomputing
from moezero.models.rope import Rotary, yarn_of


class MultiLatentAttention(nn.Module):
    def __init__(self, config: GPTConfig, site: str, layer_number: int = 0, context_parallel: Optional[Any] = None):
        super().__init__()
        # moezero/context_parallel.py's ContextParallel: this rank holds a part of each sequence (None: all of it)
        self.context_parallel = context_parallel if context_parallel is not None and context_parallel.size > 1 else None
        self.cp_comm = None if self.context_parallel is None else self.context_parallel.comm_type(layer_number)
        # set by a tensor-parallel plan from outside: the keys of this module's block of heads' dropout masks, and
        # the shared RoPE key's way into the tensor-parallel region (None: all heads, one process)
        self.head_keys: Optional[Callable[[Any], Any]] = None
        self.key_position_region: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.layer_scale = query_key_layer_scale(config, layer_number)
        H, D = config.num_attention_heads, config.hidden_size
        self.heads, self.site, self.dropout = H, site, config.attention_dropout
        self.nope, self.pos, self.value = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.recompute_core = config.recomputes("core_attn")
        # only the output projection has a bias (without --disable-bias-linear): megatron-core's MLA builds every
        # other projection with bias=False, as transformers' DeepSeek does without attention_bias
        bias = not config.disable_bias_linear
        q_width = H * (self.nope + self.pos)
        self.q_proj = self.q_down = self.q_norm = self.q_up = None
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(D, q_width, bias=False)
        else:
            self.q_down = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_norm = norm_layer(config, config.q_lora_rank) if config.qk_layernorm else nn.Identity()
            self.q_up = nn.Linear(config.q_lora_rank, q_width, bias=False)
        self.kv_down = nn.Linear(D, self.kv_rank + self.pos, bias=False)
        self.kv_norm = norm_layer(config, self.kv_rank) if config.qk_layernorm else nn.Identity()
        self.kv_up = nn.Linear(self.kv_rank, H * (self.nope + self.value), bias=False)
        self.proj = nn.Linear(H * self.value, D, bias=bias)
        yarn = yarn_of(config)
        self.rotary = Rotary(self.pos, config.rotary_base, yarn, deinterleave=True)
        self.scale = (self.nope + self.pos) ** -0.5 * (yarn.softmax_scale_factor if yarn else 1.0)

    def projections(self) -> List[Tuple[str, nn.Linear]]:
        """The linear layers (QAT quantizes them as the attention group)."""
        names = ("q_proj", "q_down", "q_up", "kv_down", "kv_up", "proj")
        return [(n, getattr(self, n)) for n in names if getattr(self, n) is not None]

    def forward(self, x_BSD: torch.Tensor, keys: Optional[SampleKeys]) -> torch.Tensor:
        q, k_nope, k_pos, v = self._heads(x_BSD)
        cp, positions = self.context_parallel, None
        if cp is not None:  # this rank's global positions (of q's sequence: its cp part, also under SP)
            positions = cp.positions(q.shape[2], q.device)
            keys = cp.attention_keys(keys)
        q_nope, q_pos = q.split([self.nope, self.pos], dim=-1)
        q = torch.cat([q_nope, self.rotary(q_pos, positions)], dim=-1)
        k_pos = self.rotary(k_pos, positions)
        if self.cp_comm == "a2a":  # the whole sequence of 1/cp of the heads, attended as in one process
            q, k, v = (cp.heads_to_sequence(t) for t in (q, self._keys(k_nope, k_pos), v))
            positions, keys = None, cp.head_block_keys(keys, self.heads)
        elif cp is not None:  # queries at this rank's positions; keys and values of the whole sequence
            k_nope, k_pos, v = (cp.gather_sequence(t, dim=2) for t in (k_nope, k_pos, v))
            k = self._keys(k_nope, k_pos)
        else:
            k = self._keys(k_nope, k_pos)
        if self.head_keys is not None and keys is not None:  # tensor parallelism: the rank's heads
            keys = self.head_keys(keys)
        if self.cp_comm == "all_gather":
            keys = cp.query_row_keys(keys, q.shape[2])
        if self.recompute_core and recomputing(self):
            y = checkpoint(self._core, q, k, v, keys, positions, use_reentrant=False)
        else:
            y = self._core(q, k, v, keys, positions)
        if self.cp_comm == "a2a":
            y = cp.sequence_to_heads(y)
        return self.proj(rearrange(y, "B H S v -> B S (H v)"))

    def _core(self, q, k, v, keys, positions=None):
        """`positions`: the queries' (all_gather cp)."""
        return causal_attention(
            q,
            k,
            v,
            self.dropout,
            self.training,
            keys,
            self.site,
            scale=self.scale,
            layer_scale=self.layer_scale,
            query_positions=positions,
        )

    def _heads(self, x_BSD: torch.Tensor):
        """(q B H S n+r, k_nope B H S n, k_pos B 1 S r, v B H S v), before RoPE; H the heads this rank holds."""
        q = self.q_proj(x_BSD) if self.q_proj is not None else self.q_up(self.q_norm(self.q_down(x_BSD)))
        q = rearrange(q, "B S (H d) -> B H S d", H=self.heads)
        latent, k_pos = self.kv_down(x_BSD).split([self.kv_rank, self.pos], dim=-1)
        if self.key_position_region is not None:
            k_pos = self.key_position_region(k_pos)
        kv = rearrange(self.kv_up(self.kv_norm(latent)), "B S (H d) -> B H S d", H=self.heads)
        k_nope, v = kv.split([self.nope, self.value], dim=-1)
        return q, k_nope, k_pos.unsqueeze(1), v

    def _keys(self, k_nope: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Each head's key: its no-position part and the shared RoPE part."""
        return torch.cat([k_nope, k_pos.expand(-1, self.heads, -1, -1)], dim=-1)
