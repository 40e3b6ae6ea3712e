"""RMSNorm over the last dimension: one kernel pass forward and one backward on the CPU (csrc/rms_norm.cpp).

torch's CPU RMSNorm is a composite of ~10 ops whose autograd adds as many (its fused backward is CUDA-only),
4-7x the time of its own LayerNorm; every family of HF MoE models and most Megatron MoE scripts use it, in the
layers' norms and in the q/k norms. The kernel computes in fp32 and rounds once, as torch's forward and its
autograd do, so values agree with torch's to fp32 rounding in the row's sums (in bf16 an ulp where that flips a
rounding); reference.py has its float64 oracle. Elsewhere (a GPU, fp64: the HF oracles, torch.compile, no
extension) torch's F.rms_norm runs.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moezero.ops import _library


def fused_rms_norm_applies(x: Tensor, weight: Optional[Tensor]) -> bool:
    """Whether rms_norm() runs the kernel for these inputs."""
    if weight is not None and (weight.dtype != x.dtype or weight.device.type != "cpu"):
        return False
    return _library.direct_kernels_apply(x)


def rms_norm(x: Tensor, normalized_shape: List[int], weight: Optional[Tensor], eps: Optional[float]) -> Tensor:
    """F.rms_norm(x, normalized_shape, weight, eps), by the kernel where fused_rms_norm_applies()."""
    trailing = tuple(x.shape[max(0, x.dim() - len(normalized_shape)) :])
    shaped = weight is None or tuple(weight.shape) == tuple(normalized_shape)  # else torch's error
    if x.numel() == 0 or trailing != tuple(normalized_shape) or not shaped or not fused_rms_norm_applies(x, weight):
        return F.rms_norm(x, normalized_shape, weight, eps)
    eps = torch.finfo(torch.float32).eps if eps is None else eps  # torch's: its computation dtype's, fp32
    width = math.prod(normalized_shape)
    w = None if weight is None else weight.reshape(width)
    return _RMSNorm.apply(x.reshape(-1, width), w, eps).view(x.shape)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH: Tensor, weight_H: Optional[Tensor], eps: float) -> Tensor:
        x_NH = x_NH.contiguous()
        weight_H = None if weight_H is None else weight_H.contiguous()
        y, rstd = _library.kernel("rms_norm", x_NH.device)(x_NH, weight_H, eps)
        ctx.save_for_backward(x_NH, rstd, weight_H)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernel's backward builds no graph: double backward raises
    def backward(ctx, grad_NH: Tensor):
        x_NH, rstd, weight_H = ctx.saved_tensors
        weight_grad = weight_H is not None and ctx.needs_input_grad[1]
        grad_x, grad_w = _library.kernel("rms_norm_backward", x_NH.device)(
            grad_NH.contiguous(), x_NH, rstd, weight_H, weight_grad
        )
        return grad_x, grad_w.to(weight_H.dtype) if weight_grad else None, None
