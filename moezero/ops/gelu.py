"""The GELU of the MLPs and experts, fused with each expert's bias: the exact (erf) one, or its tanh approximation
(approximate="tanh", as torch's; Megatron's fused bias-GELU).

Forward writes gelu(h) in one pass over y (h = y + the bias of the row's expert) and saves h, as torch's GELU
does; the backward computes gelu'(h) in fp32 and rounds grad_a * gelu'(h) once, as torch's gelu_backward, with
the bias gradient's column sums in the same pass (instead of torch's bias add, gelu, gelu_backward and one sum
per expert; tools/bench_ops.py times both). An earlier version saved gelu'(h) rounded to bf16: a one-multiply
backward, but bf16 gradients rounded twice (up to 1.4 ulp off torch's, 27% of them differing). csrc/gelu.cpp has
the kernel, reference.py its oracle.

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
        a_MF, h_MF = _library.kernel("bias_gelu", y_MF.device)(y_MF.contiguous(), bias, counts, tanh)
        ctx.save_for_backward(h_MF)  # GELU's input, as torch's GELU saves: the backward computes gelu'(h) in fp32
        ctx.counts, ctx.tanh = counts, tanh
        ctx.bias_dtype = None if bias_LF is None else bias_LF.dtype
        return a_MF

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernel's backward builds no graph: double backward raises
    def backward(ctx, grad_a_MF: Tensor):
        (h_MF,) = ctx.saved_tensors
        with_bias = ctx.bias_dtype is not None and ctx.needs_input_grad[1]
        grad_h, grad_bias = _library.kernel("bias_gelu_backward", h_MF.device)(
            grad_a_MF.contiguous(), h_MF, ctx.counts, with_bias, ctx.tanh
        )
        return grad_h, grad_bias.to(ctx.bias_dtype) if with_bias else None, None, None


def bias_gelu(
    y: Tensor, bias_LF: Optional[Tensor] = None, counts: Optional[List[int]] = None, approximate: str = "none"
) -> Tensor:
    """gelu(y + bias_LF[l]) on the rows of expert l (rows grouped by expert, counts[l] of them; no bias: gelu(y)),
    over y's last dimension, `approximate` as torch's F.gelu; only where fused_gelu_applies(y, bias_LF)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate={approximate!r}: must be 'none' or 'tanh'")
    y_MF = y.reshape(-1, y.shape[-1])
    counts = [y_MF.shape[0]] if counts is None else list(counts)
    return _BiasGelu.apply(y_MF, bias_LF, counts, approximate == "tanh").view(y.shape)
