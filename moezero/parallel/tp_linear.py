"""Column- and row-parallel linear layers (Megatron's ColumnParallelLinear / RowParallelLinear) on moezero's
(B, S, D) activations, over an explicit tensor-parallel group.

Their weights are plain nn.Parameters shaped as the rank's shard and tagged with a TensorShard
(tensor_marker.py), not DTensors: ZeRO keeps parameters as views of its flat buffers, which a DTensor's local
tensor silently ignores (docs: the tensor-parallel design note). The regions (tp_regions.py) carry the
exchanges. A column-parallel layer followed by a row-parallel one (an MLP) exchanges once each way: an
all-reduce of the output and of the input's gradient, or under sequence parallelism an all-gather of the
sequence shards in and a reduce-scatter out.

They live in parallel/ rather than models/: the model's own modules know no parallel layout (the layering test),
so layers that cut tensors over a group sit beside the group code, as the MoE layer's dispatch does in moe/.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moezero.parallel import comm
from moezero.parallel.tensor_marker import TensorShard, mark_tensor_parallel, mark_tp_partial, tensor_shard_of
from moezero.parallel.tp_regions import (
    copy_to_tp,
    gather_from_sp,
    gather_last_dim,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
)


def global_linear_init(
    in_features: int, out_features: int, bias: bool, dtype: Optional[torch.dtype] = None
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The global weight and bias as nn.Linear(in_features, out_features) draws them from torch's generator (the
    same calls, in the same order), so at one rank the layers start as nn.Linear does and at any tp as its
    slices. The model's keyed init overwrites them (through TensorShard.local_of)."""
    weight = torch.empty(out_features, in_features, dtype=dtype)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if not bias:
        return weight, None
    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
    return weight, torch.empty(out_features, dtype=dtype).uniform_(-bound, bound)


def _shard_param(global_tensor: torch.Tensor, shard: TensorShard) -> nn.Parameter:
    param = nn.Parameter(shard.local_of(global_tensor))
    mark_tensor_parallel(param, shard)
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split over `group`: each rank computes its slice of the output features.

    parts: the sizes of fused row blocks of W ([gate | up] of a GLU fc1, [q | k | v]); each is split over the
    group and rank r holds block r of each, so its local output has the fused layout at 1/tp of the width.
    gather_output: join the output features over the group (in the global order, parts included); otherwise
    each rank keeps its slice (the input of a row-parallel layer). sequence_parallel: the input is the rank's
    shard of `sequence_dim`, all-gathered before the product (its gradient reduce-scattered back).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Optional[Any],
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        parts: Optional[Sequence[int]] = None,
        sequence_dim: int = 1,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.gather_output, self.sequence_parallel, self.sequence_dim = gather_output, sequence_parallel, sequence_dim
        size, rank = comm.group_size(group), comm.group_rank(group)
        self.shard = TensorShard.split((out_features, in_features), 0, rank, size, parts)
        weight, bias_values = global_linear_init(in_features, out_features, bias, dtype)
        self.weight = _shard_param(weight, self.shard)
        if bias:
            self.bias = _shard_param(bias_values, TensorShard((out_features,), 0, self.shard.blocks))
        else:
            self.register_parameter("bias", None)
        # the gathered output's features in global order, where fused parts interleave the ranks' slices
        global_order = None
        if gather_output and len(self.shard.blocks) > 1:
            gathered = [
                i
                for r in range(size)
                for lo, hi in TensorShard.split((out_features, in_features), 0, r, size, parts).blocks
                for i in range(lo, hi)
            ]
            global_order = torch.argsort(torch.tensor(gathered))
        self.register_buffer("_global_order", global_order, persistent=False)  # moves with the module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sp(x, self.group, self.sequence_dim)
        else:
            x = copy_to_tp(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if not self.gather_output:
            return y
        y = gather_last_dim(y, self.group)
        return y if self._global_order is None else y.index_select(-1, self._global_order)

    @torch.no_grad()
    def copy_from_global_(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "ColumnParallelLinear":
        """Set the rank's shard from the global weight (out_features, in_features) and bias."""
        _copy_from_global(self.weight, weight, self.bias, bias)
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (local {self.weight.shape[0]}), "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over `group`: each rank multiplies its slice of the input
    features and the partial outputs are summed over the group (all-reduce; under sequence_parallel a
    reduce-scatter leaving each rank its shard of `sequence_dim`). The bias, whole on every rank, is added after
    the sum (once, not once per rank).

    input_is_parallel: the input is already the rank's slice of the features (a column-parallel layer's output);
    otherwise the whole input is sliced here. Sequence parallelism needs it (as Megatron's).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Optional[Any],
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("a row-parallel layer under sequence parallelism needs input_is_parallel=True")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.sequence_dim = sequence_dim
        size, rank = comm.group_size(group), comm.group_rank(group)
        self.shard = TensorShard.split((out_features, in_features), 1, rank, size)
        weight, bias_values = global_linear_init(in_features, out_features, bias, dtype)
        self.weight = _shard_param(weight, self.shard)
        self.bias = None if bias_values is None else nn.Parameter(bias_values)
        if self.bias is not None and sequence_parallel:  # added to the rank's sequence shard only
            mark_tp_partial(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_sp(x, self.group, dim=-1)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(y, self.group, self.sequence_dim)
        else:
            y = reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def copy_from_global_(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "RowParallelLinear":
        """Set the rank's shard from the global weight (out_features, in_features) and the (whole) bias."""
        _copy_from_global(self.weight, weight, self.bias, bias)
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


def _copy_from_global(
    weight: nn.Parameter, global_weight: torch.Tensor, bias: Optional[nn.Parameter], global_bias: Optional[torch.Tensor]
) -> None:
    weight.copy_(tensor_shard_of(weight).local_of(global_weight))
    if (bias is None) != (global_bias is None):
        raise ValueError("a global bias is given exactly when the layer has one")
    if bias is not None:
        shard = tensor_shard_of(bias)
        bias.copy_(global_bias if shard is None else shard.local_of(global_bias))
