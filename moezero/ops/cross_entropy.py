"""Token cross-entropy, fused (Megatron's --cross-entropy-loss-fusion): each row's loss from bf16 or fp32 logits in
one pass, its gradient in another, all in fp32, without the fp32 copy of the logits, the log-softmax and the
one-hot gradient that F.cross_entropy on widened logits writes and reads back. The numbers are torch's to a few
ulp of fp32, not bitwise (another exp), which is why it is a flag. csrc/cross_entropy.cpp has the kernel,
reference.py its oracle.

Used where the compiled kernel is loaded, on CPU float32 / bfloat16 logits, outside torch.compile; elsewhere
`token_cross_entropy` runs F.cross_entropy on the logits widened to fp32 (Megatron's unfused loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moezero.ops import _library

IGNORE_INDEX = -100  # F.cross_entropy's default


def fused_cross_entropy_applies(logits: Tensor) -> bool:
    return _library.direct_kernels_apply(logits)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV: Tensor, labels_N: Tensor) -> Tensor:
        losses, stats = _library.kernel("cross_entropy", logits_NV.device)(logits_NV, labels_N, IGNORE_INDEX)
        ctx.save_for_backward(logits_NV, labels_N, stats)
        return losses

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_N: Tensor):
        logits_NV, labels_N, stats = ctx.saved_tensors
        grad = _library.kernel("cross_entropy_backward", logits_NV.device)(
            grad_N.float().contiguous(), logits_NV, labels_N, stats, IGNORE_INDEX
        )
        return grad, None


def token_cross_entropy(logits_NV: Tensor, labels_N: Tensor, fused: bool = False) -> Tensor:
    """Per-row cross-entropy in fp32 at least (fp64 logits: fp64) of logits (N, V) against labels (N,); `fused`
    (--cross-entropy-loss-fusion): the fused kernel where fused_cross_entropy_applies(logits)."""
    if fused and labels_N.dtype == torch.int64 and fused_cross_entropy_applies(logits_NV):  # uint8: torch's
        return _CrossEntropy.apply(logits_NV.contiguous(), labels_N.contiguous())
    wide = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))
    return F.cross_entropy(wide, labels_N, reduction="none", ignore_index=IGNORE_INDEX)
