"""The gated activations of rows [gate | up], one kernel pass forward and one backward on the CPU (csrc/swiglu.cpp)
instead of torch's chain of ops and their backward ops: SwiGLU, silu(gate) * up (Megatron's --swiglu, the HF
families' experts), and GPT-OSS's clamped quick GEGLU, g sigmoid(alpha g) (u + offset) with g = min(gate, c) and
u = clamp(up, -c, c) (--quick-geglu --glu-linear-offset --activation-func-clamp-value).

The SwiGLU kernel rounds where torch's two ops do (silu's output, then the product), so bf16 values equal torch's
but where its sigmoid (one exp of its own) differs from torch's in the last fp32 bit at a rounding boundary, and
fp32 ones agree to an ulp or two; reference.py has its float64 oracle. It saves only its input rows (torch's mul
also keeps silu's output). The quick GEGLU rounds where torch's seven ops do, its clamp bound and offset rounded to
the rows' dtype as torch's clamp and add round them (so bf16 values equal torch's but where a sigmoid's last fp32
bit moves a rounding, or underflows: 0 below alpha gate = -87, torch's ~1e-38) and saves its input rows only
(torch's chain also keeps four tensors of the output's size). Elsewhere (a GPU, fp64: the HF oracles, torch.compile,
no extension) the torch ops run.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from moezero.ops import _library


def fused_glu_applies(h: Tensor) -> bool:
    """Whether swiglu() and quick_geglu() run their kernels for these rows."""
    return h.numel() > 0 and _library.direct_kernels_apply(h)


def swiglu(h: Tensor) -> Tensor:
    """silu(gate) * up of h = [gate | up] along its last dimension; only where fused_glu_applies(h)."""
    rows = h.reshape(-1, h.shape[-1])
    return _SwiGLU.apply(rows).view(*h.shape[:-1], h.shape[-1] // 2)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_M2F: Tensor) -> Tensor:
        h_M2F = h_M2F.contiguous()
        ctx.save_for_backward(h_M2F)
        return _library.kernel("swiglu", h_M2F.device)(h_M2F)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernel's backward builds no graph: double backward raises
    def backward(ctx, grad_MF: Tensor):
        (h_M2F,) = ctx.saved_tensors
        return _library.kernel("swiglu_backward", h_M2F.device)(grad_MF.contiguous(), h_M2F)


def quick_geglu(h: Tensor, alpha: float, offset: float, clamp: Optional[float]) -> Tensor:
    """g sigmoid(alpha g) (u + offset) of h = [gate | up] along its last dimension, g = min(gate, clamp) and
    u = clamp(up, -clamp, clamp) (no clamp where clamp is None, no add where offset is 0); only where
    fused_glu_applies(h)."""
    rows = h.reshape(-1, h.shape[-1])
    return _QuickGEGLU.apply(rows, alpha, offset, clamp).view(*h.shape[:-1], h.shape[-1] // 2)


class _QuickGEGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_M2F: Tensor, alpha: float, offset: float, clamp: Optional[float]) -> Tensor:
        h_M2F = h_M2F.contiguous()
        ctx.save_for_backward(h_M2F)
        ctx.parameters = (alpha, offset, clamp)
        return _library.kernel("quick_geglu", h_M2F.device)(h_M2F, alpha, offset, clamp)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_MF: Tensor):
        (h_M2F,) = ctx.saved_tensors
        kernel = _library.kernel("quick_geglu_backward", h_M2F.device)
        return kernel(grad_MF.contiguous(), h_M2F, *ctx.parameters), None, None, None
