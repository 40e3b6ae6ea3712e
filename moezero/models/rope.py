"""Rotary position embeddings: RoPE (Su et al. 2021) on the first `dim` dimensions of each head, optionally
with YaRN's context extension (Peng et al. 2023) as DeepSeek-V2/V3 and Kimi-K2 use it.

Pairing: rotate-half ((x_i, x_{i+dim/2}) rotate together), Megatron's and transformers' default. With
`deinterleave`, the dimensions are first reordered evens-then-odds, so pairs are (x_2i, x_2i+1): DeepSeek's
layout (transformers' rope_interleave, Megatron's MLA). The inverse frequencies are computed in fp32 as both
of them compute them; angles, cos and sin in the input's precision (at least fp32). Nothing is a buffer, so
casting the model never rounds the tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from moezero.config import GPTConfig


@dataclass(frozen=True)
class YarnScaling:
    """YaRN: frequencies interpolated by `factor` below the beta_slow..beta_fast rotation band, kept above it,
    ramped between; cos and sin scaled by the attention factor."""

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    round_to_int: bool = True  # the ramp's ends rounded out to whole dimensions (Megatron's default, DeepSeek's)

    def inverse_frequencies(self, dim: int, base: float) -> torch.Tensor:
        powers = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        extrapolated, interpolated = 1.0 / powers, 1.0 / (self.factor * powers)
        low, high = (
            _correction_dim(b, dim, base, self.original_max_positions) for b in (self.beta_fast, self.beta_slow)
        )
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no division by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp
        return interpolated * (1 - keep) + extrapolated * keep

    @property
    def attention_factor(self) -> float:
        """What cos and sin are scaled by: mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """MLA's correction of 1/sqrt(d): mscale(factor, mscale_all_dim) squared (1 without mscale_all_dim)."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


def yarn_of(config: GPTConfig) -> Optional[YarnScaling]:
    """The model's YaRN scaling (--rope-type yarn), else None."""
    if config.rope_type != "yarn":
        return None
    return YarnScaling(
        config.rotary_scaling_factor,
        config.yarn_original_max_position_embeddings,
        config.yarn_beta_fast,
        config.yarn_beta_slow,
        config.mscale,
        config.mscale_all_dim,
        round_to_int=not config.no_yarn_correction_range_round_to_int,
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The dimension whose wavelength fits `rotations` turns in `max_positions` tokens."""
    return dim * math.log(max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))


class Rotary(nn.Module):
    """`position_interpolation`: linear position interpolation (Megatron's --rotary-seq-len-interpolation-factor),
    each position divided by it."""

    def __init__(
        self,
        dim: int,
        base: float,
        yarn: Optional[YarnScaling] = None,
        deinterleave: bool = False,
        position_interpolation: Optional[float] = None,
    ):
        super().__init__()
        self.dim, self.base, self.yarn, self.deinterleave = dim, base, yarn, deinterleave
        self.position_interpolation = position_interpolation
        self._tables: dict = {}

    def tables(self, seq_length: int, dtype: torch.dtype, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        key = (seq_length, dtype, device)
        if key not in self._tables:
            if self.yarn is not None:
                inv_freq = self.yarn.inverse_frequencies(self.dim, self.base)
            else:
                inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))
            positions = torch.arange(seq_length, dtype=torch.float32)
            if self.position_interpolation is not None:
                positions *= 1 / self.position_interpolation  # in fp32, as Megatron scales its positions
            angles = torch.outer(positions.to(dtype), inv_freq.to(dtype))
            scale = self.yarn.attention_factor if self.yarn is not None else 1.0
            self._tables[key] = (angles.cos() * scale).to(device), (angles.sin() * scale).to(device)
        return self._tables[key]

    def forward(self, x_BHSh: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x rotated by its positions: 0, 1, ... along S, or `positions` (a context-parallel rank's)."""
        dtype = torch.promote_types(x_BHSh.dtype, torch.float32)
        if positions is None:
            cos, sin = self.tables(x_BHSh.shape[2], dtype, x_BHSh.device)
        else:  # each row of the tables depends on its position alone
            cos, sin = self.tables(int(positions.max()) + 1, dtype, x_BHSh.device)
            cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
        rotated, passed = x_BHSh[..., : self.dim].to(dtype), x_BHSh[..., self.dim :]
        if self.deinterleave:
            x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        else:
            x1, x2 = rotated.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BHSh.dtype)
        return torch.cat([out, passed], dim=-1) if passed.shape[-1] else out
