"""Multi-latent attention (DeepSeek-V2, Liu et al. 2024; DeepSeek-V3, Kimi-K2), as Megatron's MLA.

Queries come from the hidden state directly (q_proj) or through a low-rank latent (q_down -> q_norm -> q_up,
--q-lora-rank); keys and values from one latent of --kv-lora-rank (kv_down -> kv_norm -> kv_up). The latent
norms exist with --qk-layernorm, as in Megatron (DeepSeek's checkpoints have them). Each head's
query and key are a part without positions (--qk-head-dim) and a RoPE part (--qk-pos-emb-head-dim) whose key
is shared by all heads and comes straight from kv_down; values are --v-head-dim wide. RoPE pairs are DeepSeek's
interleaved ones, with YaRN when --rope-type yarn; the softmax scale is 1/sqrt(qk + pos dims) times YaRN's
mscale(factor, mscale_all_dim)^2.

Shapes: B batch, S sequence, D hidden, H heads, n/r/v the no-position, RoPE and value widths per head.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from moezero.config import GPTConfig
from moezero.keyed_random import SampleKeys
from moezero.models.attention import causal_attention, norm_layer, query_key_layer_scale, recomputing
from moezero.models.rope import Rotary, yarn_of


class MultiLatentAttention(nn.Module):
    def __init__(self, config: GPTConfig, site: str, layer_number: int = 0):
        super().__init__()
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
        q, k, v = self._heads(x_BSD)
        if self.recompute_core and recomputing(self):
            y = checkpoint(self._core, q, k, v, keys, use_reentrant=False)
        else:
            y = self._core(q, k, v, keys)
        return self.proj(rearrange(y, "B H S v -> B S (H v)"))

    def _core(self, q, k, v, keys):
        return causal_attention(
            q, k, v, self.dropout, self.training, keys, self.site, scale=self.scale, layer_scale=self.layer_scale
        )

    def _heads(self, x_BSD: torch.Tensor):
        """(q B H S n+r, k B H S n+r, v B H S v)."""
        q = self.q_proj(x_BSD) if self.q_proj is not None else self.q_up(self.q_norm(self.q_down(x_BSD)))
        q_nope, q_pos = rearrange(q, "B S (H d) -> B H S d", H=self.heads).split([self.nope, self.pos], dim=-1)
        latent, k_pos = self.kv_down(x_BSD).split([self.kv_rank, self.pos], dim=-1)
        kv = rearrange(self.kv_up(self.kv_norm(latent)), "B S (H d) -> B H S d", H=self.heads)
        k_nope, v = kv.split([self.nope, self.value], dim=-1)
        q_pos, k_pos = self.rotary(q_pos), self.rotary(k_pos.unsqueeze(1))
        q = torch.cat([q_nope, q_pos], dim=-1)
        k = torch.cat([k_nope, k_pos.expand(-1, self.heads, -1, -1)], dim=-1)
        return q, k, v
