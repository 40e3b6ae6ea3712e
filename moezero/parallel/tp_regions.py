"""Tensor-parallel regions: Megatron's mapping functions (megatron.core.tensor_parallel.mappings), as autograd
functions over comm.py's collectives, so every exchange goes through the group's transport.

Each takes its `group` explicitly (None or a group of one: the identity, no autograd node) and, where it cuts or
joins a dimension, that dimension: moezero's activations are (B, S, D), so the sequence-parallel shard is dim 1
(Megatron's are (S, B, D), dim 0). A shard along `dim` is the rank's contiguous slice of it, in rank order.

| function | forward | backward |
|---|---|---|
| copy_to_tp | identity | all-reduce |
| reduce_from_tp | all-reduce | identity |
| scatter_to_sp | this rank's slice of `dim` | all-gather along `dim` |
| gather_from_sp | all-gather along `dim` | reduce-scatter along `dim` |
| reduce_scatter_to_sp | reduce-scatter along `dim` | all-gather along `dim` |
| gather_last_dim | all-gather along the last dim | this rank's slice of it |
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from moezero.parallel import comm

__all__ = [
    "copy_to_tp",
    "reduce_from_tp",
    "scatter_to_sp",
    "gather_from_sp",
    "reduce_scatter_to_sp",
    "gather_last_dim",
]


def _is_identity(group: Optional[Any]) -> bool:
    return comm.group_size(group) == 1


def _dim_of(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim()


def _summed(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of every rank's `x` (a new tensor: the all-reduce runs in place)."""
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group)
    return out


def _slice(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """This rank's contiguous slice of `dim`."""
    size, dim = comm.group_size(group), _dim_of(x, dim)
    if x.shape[dim] % size:
        raise ValueError(
            f"dim {dim} of a {tuple(x.shape)} tensor does not split over a tensor-parallel group of {size}"
        )
    n = x.shape[dim] // size
    return x.narrow(dim, comm.group_rank(group) * n, n).contiguous()


def _gathered(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Every rank's `x` joined along `dim`, in rank order (the collective joins dim 0: `dim` is moved there)."""
    size, dim = comm.group_size(group), _dim_of(x, dim)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((size * front.shape[0],) + tuple(front.shape[1:]))
    comm.all_gather(out, front, group)
    return out.movedim(0, dim).contiguous() if dim else out


def _reduce_scattered(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """This rank's slice of `dim` of the sum of every rank's `x`."""
    size, dim = comm.group_size(group), _dim_of(x, dim)
    if x.shape[dim] % size:
        raise ValueError(
            f"dim {dim} of a {tuple(x.shape)} tensor does not split over a tensor-parallel group of {size}"
        )
    front = x.movedim(dim, 0).clone(memory_format=torch.contiguous_format)  # scratch the reduce-scatter overwrites
    _, mine = comm.reduce_scatter_in_place(front.view(-1), group)
    out = mine.view((front.shape[0] // size,) + tuple(front.shape[1:]))
    return out.movedim(0, dim).contiguous() if dim else out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _summed(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _slice(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gathered(grad, ctx.group, ctx.dim), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gathered(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scattered(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scattered(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gathered(grad, ctx.group, ctx.dim), None, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gathered(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, ctx.group, -1), None


def copy_to_tp(x: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: identity; the gradient is summed over the group
    (each rank's partial gradient from its shard of the next layer)."""
    return x if _is_identity(group) else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """Leave a tensor-parallel region: the partial outputs summed over the group; the gradient passes as is."""
    return x if _is_identity(group) else _ReduceFromTP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group: Optional[Any], dim: int = 1) -> torch.Tensor:
    """This rank's slice of `dim` (the sequence for sequence parallelism; the last dim for a row-parallel layer's
    replicated input); the gradient all-gathered back to the full `dim`."""
    return x if _is_identity(group) else _ScatterToSP.apply(x, group, dim)


def gather_from_sp(x: torch.Tensor, group: Optional[Any], dim: int = 1) -> torch.Tensor:
    """Every rank's sequence shard joined along `dim` (a column-parallel layer's input under sequence
    parallelism); the gradient, partial on each rank, reduce-scattered back to the shards."""
    return x if _is_identity(group) else _GatherFromSP.apply(x, group, dim)


def reduce_scatter_to_sp(x: torch.Tensor, group: Optional[Any], dim: int = 1) -> torch.Tensor:
    """Partial outputs summed over the group, each rank keeping its slice of `dim` (a row-parallel layer's output
    under sequence parallelism); the gradient all-gathered along `dim`."""
    return x if _is_identity(group) else _ReduceScatterToSP.apply(x, group, dim)


def gather_last_dim(x: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """Every rank's shard of the last dim joined (a column-parallel layer's gathered output); the gradient
    sliced back to this rank's shard."""
    return x if _is_identity(group) else _GatherLastDim.apply(x, group)
