"""Public kernels used by the MoE dispatcher and the ZeRO reducer.

Each op runs the compiled extension when it is loaded for the tensor's device and otherwise
its pure-PyTorch reference (`moezero.ops.reference`); MOEZERO_DISABLE_EXT=1 forces the
reference. Autograd is defined here once, on top of either implementation.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from moezero.ops import reference


def _impl(device: torch.device):
    return reference


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, num_experts):
        x_ND, counts_E, row_map_TK = _impl(x_TD.device).permute(x_TD, topk_ids_TK, num_experts)
        ctx.save_for_backward(row_map_TK)
        ctx.mark_non_differentiable(counts_E, row_map_TK)
        return x_ND, counts_E, row_map_TK

    @staticmethod
    def backward(ctx, grad_ND, _grad_counts, _grad_map):
        (row_map_TK,) = ctx.saved_tensors
        grad_TD = _impl(grad_ND.device).unpermute_combine(grad_ND.contiguous(), row_map_TK, None)
        return grad_TD, None, None


class _UnpermuteCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, row_map_TK, weights_TK):
        ctx.save_for_backward(y_ND, row_map_TK, weights_TK)
        return _impl(y_ND.device).unpermute_combine(y_ND, row_map_TK, weights_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        y_ND, row_map_TK, weights_TK = ctx.saved_tensors
        grad_y, grad_w = _impl(grad_TD.device).unpermute_combine_backward(
            grad_TD.contiguous(), y_ND, row_map_TK, weights_TK)
        return grad_y, None, grad_w


def permute_tokens(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, num_experts: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_ND sorted by expert, counts_E, row_map_TK); see `reference.permute`. Differentiable in x."""
    return _Permute.apply(x_TD.contiguous(), topk_ids_TK.contiguous(), num_experts)


def unpermute_combine(y_ND: torch.Tensor, row_map_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Weighted top-k sum back in token order; differentiable in y and the weights."""
    return _UnpermuteCombine.apply(y_ND.contiguous(), row_map_TK.contiguous(), weights_TK.contiguous())


def flatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
                 scale: float = 1.0, accumulate: bool = False) -> None:
    """Copy (or add) a list of tensors, scaled and cast, into slices of a flat buffer."""
    _impl(flat.device).flatten_into(flat, tensors, offsets, scale, accumulate)


def sum_of_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm over a list of tensors, as one fp32 (or fp64) scalar."""
    device = tensors[0].device if len(tensors) else torch.device("cpu")
    return _impl(device).sum_of_squares(tensors)
