"""SwiGLU of rows [gate | up]: silu(gate) * up, one kernel pass forward and one backward on the CPU
(csrc/swiglu.cpp), instead of torch's chunk, silu and mul and their backward ops.

The kernel rounds where torch's two ops do (silu's output, then the product), so bf16 values equal torch's but
where its sigmoid (one exp of its own) differs from torch's in the last fp32 bit at a rounding boundary, and fp32
ones agree to an ulp or two; reference.py has its float64 oracle. It saves only its input rows (torch's mul also
keeps silu's output). Elsewhere (a GPU, fp64: the HF oracles, torch.compile, no extension) the torch ops run.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moezero.ops import _library, _loader

_DTYPES = (torch.float32, torch.bfloat16)


def fused_swiglu_applies(h: Tensor) -> bool:
    """Whether swiglu() runs the kernel for these rows."""
    return (h.device.type == "cpu" and h.dtype in _DTYPES and h.numel() > 0 and not torch.compiler.is_compiling()
            and _loader.load("cpu") is not None)


def swiglu(h: Tensor) -> Tensor:
    """silu(gate) * up of h = [gate | up] along its last dimension; only where fused_swiglu_applies(h)."""
    rows = h.reshape(-1, h.shape[-1])
    return _SwiGLU.apply(rows).view(*h.shape[:-1], h.shape[-1] // 2)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_M2F: Tensor) -> Tensor:
        h_M2F = h_M2F.contiguous()
        ctx.save_for_backward(h_M2F)
        return _library.kernel("swiglu", h_M2F.device)(h_M2F)

    @staticmethod
    @torch.autograd.function.once_differentiable   # the kernel's backward builds no graph: double backward raises
    def backward(ctx, grad_MF: Tensor):
        (h_M2F,) = ctx.saved_tensors
        return _library.kernel("swiglu_backward", h_M2F.device)(grad_MF.contiguous(), h_M2F)
