"""Group-wise uniform integer quantization of weights, and its straight-through fake-quant.

Shapes: U units (1 for a dense tensor, the experts for a stacked expert tensor), G groups per
unit, R = U * G rows, N elements per row.

A tensor is cut into rows: each unit (a whole dense tensor, or one expert of a stacked expert
tensor) is flattened row-major and split into G equal contiguous groups. So the groups of an
expert never straddle two experts, and an expert's groups do not depend on how many experts a
rank stacks (ep). Each row gets a scale (and a zero point when asymmetric):

    symmetric:  q = clamp(round(w / s), -(2^(b-1) - 1), 2^(b-1) - 1),  s = max|w| / (2^(b-1) - 1)
    asymmetric: q = clamp(round(w / s) + z, 0, 2^b - 1),  s = (max - min) / (2^b - 1),  z = round(-min / s)
                (min <= 0 <= max is forced, so 0 is exact and z fits in b bits)
    w_hat = (q - z) * s        (z = 0 when symmetric)

"round" is nearest (half to even) or stochastic: floor(w / s + u) with u ~ U[0, 1) from the caller,
which keeps the rounding unbiased (Gupta et al. 2015). Fake quantization returns w_hat in the
weight's dtype and passes the gradient straight through (the STE of Bengio et al. 2013, as in
DeepSpeed MoQ and torch.ao's FakeQuantize): the master weights keep learning in full precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class RowQuant:
    """Integer codes and per-row parameters of a quantized (R, N) tensor (see the module docstring)."""

    q_RN: torch.Tensor  # fp32 holding integers: signed for symmetric, in [0, 2^b) for asymmetric
    scale_R: torch.Tensor  # fp32
    zero_point_R: torch.Tensor  # fp32 integers (all 0 when symmetric)
    bits: int
    symmetric: bool

    def dequantize(self) -> torch.Tensor:
        return (self.q_RN - self.zero_point_R[:, None]) * self.scale_R[:, None]


def to_rows(w: torch.Tensor, units: int, groups: int) -> torch.Tensor:
    """(R, N) fp32 view of w (a copy only when w is not fp32); units * groups must divide w.numel()."""
    return w.reshape(units * groups, -1).float()


def qmax_symmetric(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def quantize_rows(w_RN: torch.Tensor, bits: int, symmetric: bool, noise_RN: Optional[torch.Tensor] = None) -> RowQuant:
    """Quantize each row of fp32 w_RN; `noise_RN` (uniform in [0, 1)) selects stochastic rounding."""
    zeros = torch.zeros(w_RN.shape[0], dtype=w_RN.dtype, device=w_RN.device)
    if symmetric:
        w_max, w_min = w_RN.abs().amax(dim=1), zeros
    else:
        w_max, w_min = w_RN.amax(dim=1).clamp(min=0.0), w_RN.amin(dim=1).clamp(max=0.0)
    grid = RowGrid.of_range(w_max, w_min, bits, symmetric)
    q = grid.codes(w_RN, grid.scale_R[:, None], grid.zero_point_R[:, None], noise_RN)
    return RowQuant(q, grid.scale_R, grid.zero_point_R, bits, symmetric)


@dataclass(frozen=True)
class RowGrid:
    """The quantization grid of each row: its scale, zero point and code range (see the module docstring)."""

    scale_R: torch.Tensor
    zero_point_R: torch.Tensor
    lo: int
    hi: int

    @classmethod
    def of_range(cls, w_max_R: torch.Tensor, w_min_R: torch.Tensor, bits: int, symmetric: bool) -> "RowGrid":
        """From each row's max (of |w| when symmetric) and min, both already including 0."""
        if symmetric:
            qmax = qmax_symmetric(bits)
            scale = w_max_R / qmax
            lo, hi, zero = -qmax, qmax, torch.zeros_like(scale)
        else:
            lo, hi = 0, 2**bits - 1
            scale = (w_max_R - w_min_R) / hi
        # an all-zero row has scale 0: any positive scale gives q = z and w_hat = 0 exactly
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        if not symmetric:
            zero = torch.round(-w_min_R / scale).clamp(lo, hi)
        return cls(scale, zero, lo, hi)

    def codes(
        self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, noise: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """The codes of `w` given each element's scale and zero point (broadcast against w)."""
        x = w / scale
        x = torch.floor(x + noise) if noise is not None else torch.round(x)
        return (x + zero).clamp(self.lo, self.hi)


def fake_quantize(
    w: torch.Tensor, bits: int, units: int, groups: int, symmetric: bool, noise: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """w_hat (same shape and dtype as w) with the gradient passed straight through to w."""
    with torch.no_grad():
        noise_RN = None if noise is None else noise.reshape(units * groups, -1)
        w_hat = quantize_rows(to_rows(w.detach(), units, groups), bits, symmetric, noise_RN).dequantize()
        w_hat = w_hat.to(w.dtype).view(w.shape)
    return StraightThrough.apply(w, w_hat)


class StraightThrough(torch.autograd.Function):
    """Forward returns `w_hat` exactly; backward hands the gradient to `w` unchanged.

    A custom Function rather than `w + (w_hat - w).detach()`: that expression rounds, so the
    forward would not use exactly the values on the quantization grid.
    """

    @staticmethod
    def forward(ctx, w, w_hat):
        return w_hat

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quantize_per_token(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric dynamic fake-quant of activations, one scale per token (last dim), with the STE.

    Per token rather than per tensor: a token's scale then does not depend on which other tokens
    share its batch or reach its rank, so expert-parallel layouts see identical activations.
    """
    if x.numel() == 0:
        return x
    with torch.no_grad():
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        x_hat = quantize_rows(rows, bits, symmetric=True).dequantize().to(x.dtype).view(x.shape)
    return StraightThrough.apply(x, x_hat)
