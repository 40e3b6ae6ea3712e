"""The GELU of the MLPs and experts, fused with each expert's bias, saving its derivative: the exact (erf) one, or
its tanh approximation (approximate="tanh", as torch's; Megatron's fused bias-GELU).

Forward writes gelu(h) and gelu'(h) in one pass over y (h = y + the bias of the row's expert), and saves
gelu'(h) where torch's GELU saves h: the same activation memory, and the backward is one multiply (and the
bias gradient's column sums in the same pass) instead of a second erf and exp: faster than torch's bias add,
gelu and gelu_backward in bf16 and fp32 (tools/bench_ops.py times both). csrc/gelu.cpp has the kernel,
reference.py its oracle.

Used where the compiled kernel is loaded, on CPU float32 / bfloat16 tensors that need a gradient, outside
torch.compile; elsewhere the callers run torch's GELU on the biased input.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from moezero.ops import _library


def fused_gelu_applies(y: Tensor, bias: Optional[Tensor] = None) -> bool:
    """Whether bias_gelu() runs the fused kernel for these inputs (else the caller runs torch's GELU)."""
    needs_grad = y.requires_grad or (bias is not None and bias.requires_grad)
    return needs_grad and torch.is_grad_enabled() and _library.direct_kernels_apply(y)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MF: Tensor, bias_LF: Optional[Tensor], counts: List[int], tanh: bool) -> Tensor:
        bias = None if bias_LF is None else bias_LF.to(y_MF.dtype).contiguous()
        a_MF, d_MF = _library.kernel("bias_gelu", y_MF.device)(y_MF.contiguous(), bias, counts, tanh)
        ctx.save_for_backward(d_MF)
        ctx.counts = counts
        ctx.bias_dtype = None if bias_LF is None else bias_LF.dtype
        return a_MF

    @staticmethod
    @torch.autograd.function.once_differentiable   # the kernel's backward builds no graph: double backward raises
    def backward(ctx, grad_a_MF: Tensor):
        (d_MF,) = ctx.saved_tensors
        with_bias = ctx.bias_dtype is not None
        grad_h, grad_bias = _library.kernel("bias_gelu_backward", d_MF.device)(
            grad_a_MF.contiguous(), d_MF, ctx.counts, with_bias)
        return grad_h, grad_bias.to(ctx.bias_dtype) if with_bias else None, None, None


def bias_gelu(y: Tensor, bias_LF: Optional[Tensor] = None, counts: Optional[List[int]] = None,
              approximate: str = "none") -> Tensor:
    """gelu(y + bias_LF[l]) on the rows of expert l (rows grouped by expert, counts[l] of them; no bias: gelu(y)),
    over y's last dimension, `approximate` as torch's F.gelu; only where fused_gelu_applies(y, bias_LF)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate={approximate!r}: must be 'none' or 'tanh'")
    y_MF = y.reshape(-1, y.shape[-1])
    counts = [y_MF.shape[0]] if counts is None else list(counts)
    return _BiasGelu.apply(y_MF, bias_LF, counts, approximate == "tanh").view(y.shape)
