"""Each expert's bias added to its rows (rows grouped by expert, counts[l] of them): the experts' b2, and b1 where
the activation is not the fused GELU (SwiGLU: GPT-OSS).

On the CPU in fp32 / bf16 one kernel pass over the rows (csrc/bias_add.cpp) does it, and one the bias gradient (each
expert's column sums, in fp32 and row order, as the fused bias-GELU's); elsewhere (a GPU, fp64: the HF oracles,
torch.compile) one broadcast add per expert and one sum per expert. The forward's bits are the same either way
(one rounded add); the gradient's sums differ in order (torch's `sum` is a cascade), within fp32 rounding.
"""
from __future__ import annotations

from typing import List

import torch
from torch import Tensor

from moezero.ops import _library, _loader

_DTYPES = (torch.float32, torch.bfloat16)


def fused_bias_add_applies(y_MF: Tensor) -> bool:
    """Whether add_expert_bias() runs the kernels for these rows."""
    return (y_MF.device.type == "cpu" and y_MF.dtype in _DTYPES and not torch.compiler.is_compiling()
            and _loader.load("cpu") is not None)


def add_expert_bias(y_MF: Tensor, b_LF: Tensor, counts: List[int]) -> Tensor:
    """y + b_LF[l] on expert l's rows, in y's dtype; differentiable in both."""
    if fused_bias_add_applies(y_MF):
        return _FusedExpertBias.apply(y_MF, b_LF, counts)
    return _ExpertBiasLoop.apply(y_MF, b_LF, counts)


class _FusedExpertBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MF, b_LF, counts):
        ctx.counts, ctx.bias_dtype = counts, b_LF.dtype
        add = _library.kernel("grouped_bias_add", y_MF.device)
        return add(y_MF.contiguous(), b_LF.to(y_MF.dtype).contiguous(), counts)

    @staticmethod
    def backward(ctx, grad_MF):
        if not ctx.needs_input_grad[1]:
            return grad_MF, None, None
        if torch.is_grad_enabled():   # create_graph: a graph through the sums (the kernel builds none)
            return grad_MF, _block_sums(grad_MF, ctx.counts, ctx.bias_dtype), None
        sums = _library.kernel("grouped_bias_grad", grad_MF.device)(grad_MF.contiguous(), ctx.counts)
        return grad_MF, sums.to(ctx.bias_dtype), None


class _ExpertBiasLoop(torch.autograd.Function):
    """One broadcast add per expert; the bias gradient is each block's row sum (a repeat_interleave of the biases
    would write an M x F tensor, and its backward scatter-adds it back)."""

    @staticmethod
    def forward(ctx, y_MF, b_LF, counts):
        ctx.counts, ctx.bias_dtype = counts, b_LF.dtype
        out = torch.empty_like(y_MF)
        bias = b_LF.to(y_MF.dtype)
        for l, (rows, into) in enumerate(zip(torch.split(y_MF, counts), torch.split(out, counts))):
            torch.add(rows, bias[l], out=into)
        return out

    @staticmethod
    def backward(ctx, grad_MF):
        return grad_MF, _block_sums(grad_MF, ctx.counts, ctx.bias_dtype), None


def _block_sums(grad_MF: Tensor, counts: List[int], dtype: torch.dtype) -> Tensor:
    return torch.stack([block.sum(0, dtype=dtype) for block in torch.split(grad_MF, counts)])
