"""The public ops' eager path: the kernels called straight from Python, their autograd an autograd.Function.

A `torch.library` custom op costs Python per call (schema checks, the autograd wrapper, the dispatch back into
Python) and its generated backward node more again: across the routing ops and the gradient buckets, more than
the kernels themselves take at small widths (docs/benchmarks.md#dispatch, tools/bench_ops.py --only dispatch). Outside
torch.compile, on plain tensors of a real device, the public ops (ops/__init__.py) call the
same kernels (`_library.kernel`: the compiled one where wired, else the reference) through this file; traced
code, FakeTensors, meta tensors and tensor subclasses keep the custom ops (`_library.py`), which stay the
contract for torch.compile and torch.library's checks. Both paths give the same bits (tests/ops/test_library.py).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from moezero.ops._library import kernel

_DEVICE_TYPES = ("cpu", "cuda")


def applies(*tensors: Optional[Tensor]) -> bool:
    """Whether these inputs take the eager path: not traced, plain tensors (no FakeTensor or other subclass) on a
    device that runs kernels."""
    if torch.compiler.is_compiling():
        return False
    return all(t is None or (type(t) is Tensor and t.device.type in _DEVICE_TYPES) for t in tensors)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: Tensor, topk_ids_TK: Tensor, num_experts: int):
        x_ND, counts_E, row_map_TK = kernel("permute", x_TD.device)(x_TD, topk_ids_TK, num_experts)
        ctx.save_for_backward(row_map_TK)
        ctx.mark_non_differentiable(counts_E, row_map_TK)
        return x_ND, counts_E, row_map_TK

    @staticmethod
    def backward(ctx, grad_ND: Tensor, _grad_counts, _grad_map):
        (row_map_TK,) = ctx.saved_tensors
        # the adjoint of a row gather is the unweighted sum of each token's rows
        return unpermute_combine(grad_ND.contiguous(), row_map_TK, None), None, None


class _UnpermuteCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND: Tensor, row_map_TK: Tensor, weights_TK: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(y_ND, row_map_TK, weights_TK)
        return kernel("unpermute_combine", y_ND.device)(y_ND, row_map_TK, weights_TK)

    @staticmethod
    @torch.autograd.function.once_differentiable  # as the custom op, whose backward op has no autograd
    def backward(ctx, grad_TD: Tensor):
        y_ND, row_map_TK, weights_TK = ctx.saved_tensors
        grad_y, grad_w = kernel("unpermute_combine_backward", y_ND.device)(
            grad_TD.contiguous(), y_ND, row_map_TK, weights_TK
        )
        return grad_y, None, None if weights_TK is None else grad_w


def permute(x_TD: Tensor, topk_ids_TK: Tensor, num_experts: int) -> Tuple[Tensor, Tensor, Tensor]:
    return _Permute.apply(x_TD, topk_ids_TK, num_experts)


def unpermute_combine(y_ND: Tensor, row_map_TK: Tensor, weights_TK: Optional[Tensor]) -> Tensor:
    return _UnpermuteCombine.apply(y_ND, row_map_TK, weights_TK)


def flatten_into(flat: Tensor, tensors: List[Tensor], offsets: List[int], scale: float, accumulate: bool) -> None:
    kernel("flatten_into", flat.device)(flat, tensors, offsets, scale, accumulate)
    torch.autograd.graph.increment_version(flat)  # as the custom op's in-place mutation does


def sum_of_squares(tensors: Sequence[Tensor]) -> Tensor:
    return kernel("sum_of_squares", tensors[0].device)(list(tensors))
