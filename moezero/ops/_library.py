"""torch.library registration of the moezero ops: schemas, fake (meta) kernels and autograd.

Each op body picks its kernel per call: the compiled one (`moezero._C` / `moezero._C_cuda`) when
it is loaded *and* listed in `WIRED` for the device, else the reference in `reference.py`. Both
implement the same functions with the same signatures and ordering contract, so autograd and the
fake kernels are written once here.

`WIRED` lists, per device type, the ops whose compiled kernel beat the best pure-torch version
in tools/bench_ops.py. On CUDA that is what tools/gpu_check.sh showed correct and faster on an H200
(docs/benchmarks.md#cuda-kernels): the routing ops 2.1-5.0x and flatten_into 1.1-1.4x; sum_of_squares
(1.04-1.08x, within a run's noise) stays torch's _foreach_norm.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from moezero.ops import _loader, reference
from moezero.torch_internals import functorch_transforms_active

OPS = ("permute", "unpermute_combine", "unpermute_combine_backward", "flatten_into", "sum_of_squares")
# called from an autograd.Function (gelu.py, bias_add.py, rms_norm.py, swiglu.py), not registered as custom ops:
# a custom op's dispatch costs more per call than these element-wise kernels take on an expert's rows
DIRECT_OPS = (
    "bias_gelu",
    "bias_gelu_backward",
    "grouped_bias_add",
    "grouped_bias_grad",
    "rms_norm",
    "rms_norm_backward",
    "swiglu",
    "swiglu_backward",
    "quick_geglu",
    "quick_geglu_backward",
    "cross_entropy",
    "cross_entropy_backward",
)
WIRED = MappingProxyType(
    {
        "cpu": frozenset(OPS + DIRECT_OPS),
        "cuda": frozenset(("permute", "unpermute_combine", "unpermute_combine_backward", "flatten_into")),
    }
)


def direct_kernels_apply(t: Tensor) -> bool:
    """Whether the DIRECT_OPS' CPU kernels may run on `t`: on the CPU, float32 or bfloat16, in eager mode
    (torch.compile traces torch's ops instead, and torch.func's transforms refuse an autograd.Function without
    their rules), the extension loaded. Each op adds its own conditions."""
    return (
        t.device.type == "cpu"
        and t.dtype in (torch.float32, torch.bfloat16)
        and not torch.compiler.is_compiling()
        and not functorch_transforms_active()
        and _loader.load("cpu") is not None
    )


def kernel(name: str, device: torch.device) -> Callable:
    """The implementation of op `name` for tensors on `device`."""
    if name in WIRED.get(device.type, ()):
        module = _loader.load(device.type)
        if module is not None:
            return getattr(module, name)
    return getattr(reference, name)


# ---- permute ------------------------------------------------------------------------------


@torch.library.custom_op("moezero::permute", mutates_args=())
def permute(x_TD: Tensor, topk_ids_TK: Tensor, num_experts: int) -> Tuple[Tensor, Tensor, Tensor]:
    x_ND, counts_E, row_map_TK = kernel("permute", x_TD.device)(x_TD, topk_ids_TK, num_experts)
    return x_ND, counts_E, row_map_TK


@permute.register_fake
def _permute_fake(x_TD, topk_ids_TK, num_experts):
    # N (kept assignments) depends on the ids: fine for FakeTensors / torch.compile, an error on meta
    n = torch.library.get_ctx().new_dynamic_size()
    return (
        x_TD.new_empty(n, x_TD.shape[1]),
        topk_ids_TK.new_empty(num_experts, dtype=torch.int64),
        topk_ids_TK.new_empty(topk_ids_TK.shape, dtype=torch.int64),
    )


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(output[2])


def _permute_backward(ctx, grad_ND, _grad_counts, _grad_map):
    (row_map_TK,) = ctx.saved_tensors
    # the adjoint of a row gather is the unweighted sum of each token's rows
    return unpermute_combine(grad_ND.contiguous(), row_map_TK, None), None, None


permute.register_autograd(_permute_backward, setup_context=_permute_setup)


# ---- unpermute + weighted combine -----------------------------------------------------------


@torch.library.custom_op("moezero::unpermute_combine", mutates_args=())
def unpermute_combine(y_ND: Tensor, row_map_TK: Tensor, weights_TK: Optional[Tensor]) -> Tensor:
    return kernel("unpermute_combine", y_ND.device)(y_ND, row_map_TK, weights_TK)


@unpermute_combine.register_fake
def _unpermute_combine_fake(y_ND, row_map_TK, weights_TK):
    return y_ND.new_empty(row_map_TK.shape[0], y_ND.shape[1])


@torch.library.custom_op("moezero::unpermute_combine_backward", mutates_args=())
def unpermute_combine_backward(
    grad_TD: Tensor, y_ND: Tensor, row_map_TK: Tensor, weights_TK: Optional[Tensor]
) -> Tuple[Tensor, Tensor]:
    """(grad_y_ND, grad_weights_TK); grad_weights_TK is empty when weights_TK is None."""
    grad_y, grad_w = kernel("unpermute_combine_backward", y_ND.device)(grad_TD, y_ND, row_map_TK, weights_TK)
    return grad_y, grad_w if grad_w is not None else y_ND.new_empty(0)


@unpermute_combine_backward.register_fake
def _unpermute_combine_backward_fake(grad_TD, y_ND, row_map_TK, weights_TK):
    grad_w = y_ND.new_empty(0) if weights_TK is None else torch.empty_like(weights_TK)
    return torch.empty_like(y_ND), grad_w


def _combine_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _combine_backward(ctx, grad_TD):
    y_ND, row_map_TK, weights_TK = ctx.saved_tensors
    grad_y, grad_w = unpermute_combine_backward(grad_TD.contiguous(), y_ND, row_map_TK, weights_TK)
    return grad_y, None, None if weights_TK is None else grad_w


unpermute_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


# ---- gradient-bucket ops ------------------------------------------------------------------


@torch.library.custom_op("moezero::flatten_into", mutates_args={"flat"})
def flatten_into(flat: Tensor, tensors: List[Tensor], offsets: List[int], scale: float, accumulate: bool) -> None:
    kernel("flatten_into", flat.device)(flat, tensors, offsets, scale, accumulate)


@flatten_into.register_fake
def _flatten_into_fake(flat, tensors, offsets, scale, accumulate):
    return None


@torch.library.custom_op("moezero::sum_of_squares", mutates_args=())
def sum_of_squares(tensors: List[Tensor]) -> Tensor:
    """Squared L2 norm of a non-empty list of tensors on one device."""
    return kernel("sum_of_squares", tensors[0].device)(tensors)


@sum_of_squares.register_fake
def _sum_of_squares_fake(tensors):
    fp64 = any(t.dtype == torch.float64 for t in tensors)
    return tensors[0].new_empty((), dtype=torch.float64 if fp64 else torch.float32)
