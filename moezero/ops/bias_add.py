"""Each expert's bias added to its rows (rows grouped by expert, counts[l] of them): the experts' b2, and b1 where
the activation is not the fused GELU (SwiGLU: GPT-OSS).

On the CPU in fp32 / bf16 one kernel pass over the rows (csrc/bias_add.cpp) does it, and one the bias gradient;
elsewhere (a GPU, fp64: the HF oracles, torch.compile) a few torch ops whatever the number of experts (one add and
one sum per expert were 2-4 x E ops a layer: thousands of kernel launches a step at GPT-OSS's 128 experts). Both
give the same bits: one rounded add, and each expert's column sums in row order, in fp32 (fp64 for fp64 rows),
as the fused bias-GELU's.
"""

from __future__ import annotations

from typing import List

import torch
from torch import Tensor

from moezero.ops import _library, reference
from moezero.torch_internals import functorch_transforms_active


def fused_bias_add_applies(y_MF: Tensor) -> bool:
    """Whether add_expert_bias() runs the kernels for these rows."""
    return _library.direct_kernels_apply(y_MF)


def add_expert_bias(y_MF: Tensor, b_LF: Tensor, counts: List[int]) -> Tensor:
    """y + b_LF[l] on expert l's rows, in y's dtype; differentiable in both."""
    if fused_bias_add_applies(y_MF):
        return _FusedExpertBias.apply(y_MF, b_LF, counts)
    if functorch_transforms_active():  # torch.func refuses an autograd.Function without its rules: plain ops
        return y_MF + _rows_of(b_LF.to(y_MF.dtype), counts)
    return _ExpertBiasOps.apply(y_MF, b_LF, counts)


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
        if torch.is_grad_enabled():  # create_graph: a graph through the sums (the kernel builds none)
            return grad_MF, _segment_sums(grad_MF, ctx.counts).to(ctx.bias_dtype), None
        sums = _library.kernel("grouped_bias_grad", grad_MF.device)(grad_MF.contiguous(), ctx.counts)
        return grad_MF, sums.to(ctx.bias_dtype), None


class _ExpertBiasOps(torch.autograd.Function):
    """The same with torch ops, on any device: the biases repeated to the rows and added (one add, as the kernel's),
    the gradient summed in row order (reference.grouped_bias_grad off the CPU), in fp32 at least."""

    @staticmethod
    def forward(ctx, y_MF, b_LF, counts):
        ctx.counts, ctx.bias_dtype = counts, b_LF.dtype
        return y_MF + _rows_of(b_LF.to(y_MF.dtype), counts)

    @staticmethod
    def backward(ctx, grad_MF):
        if not ctx.needs_input_grad[1]:
            return grad_MF, None, None
        return grad_MF, _segment_sums(grad_MF, ctx.counts).to(ctx.bias_dtype), None


def _rows_of(b_LF: Tensor, counts: List[int]) -> Tensor:
    """(L, F) -> (M, F): expert l's row repeated counts[l] times."""
    return reference._expert_rows(b_LF, counts)


def _segment_sums(grad_MF: Tensor, counts: List[int]) -> Tensor:
    """Each expert's column sums of its rows, in row order, in fp32 (fp64 for fp64 rows)."""
    if grad_MF.device.type != "cpu" or torch.compiler.is_compiling():
        return reference.grouped_bias_grad(grad_MF, counts)
    # eager index_add_ adds the rows in order on the CPU, faster there than segment_reduce (on CUDA it adds
    # with atomics: not in a fixed order)
    wide = grad_MF.to(torch.promote_types(grad_MF.dtype, torch.float32))
    experts = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts), output_size=wide.shape[0])
    return wide.new_zeros(len(counts), wide.shape[1]).index_add_(0, experts, wide)
