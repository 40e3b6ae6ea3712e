"""A tensor-parallel param's global tensor, from its slices on the ranks of its group (--save-hf at tp or etp > 1).

Rank i of a group of n holds, of each part of the split dim (one part, or a fused weight's q/k/v or gate/up), the
contiguous i-th n-th (parallel/tensor_marker.py TensorShard.split): so from one rank's own blocks the blocks of
every other follow, and the global tensor is every rank's local one laid back at its blocks. Only the tensor
being written is gathered, by the ranks of one group, so no rank holds more than that tensor beyond its own.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.distributed as dist

from moezero.parallel import comm
from moezero.parallel.tensor_marker import TensorShard


def group_ranks(group: Any) -> Tuple[int, ...]:
    """The global ranks of `group`, in the group's rank order."""
    return tuple(sorted(dist.get_process_group_ranks(group)))


def gather_slices(tensor: torch.Tensor, shard: TensorShard, group: Any) -> torch.Tensor:
    """The global tensor (on the CPU) whose slice `shard` is this rank's `tensor`: collective over `group`, the
    ranks holding its other slices."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    local = tensor.detach().contiguous()
    every = torch.empty((size,) + tuple(local.shape), dtype=local.dtype, device=local.device)
    comm.all_gather(every.view(-1), local.view(-1), group)
    every = every.cpu()
    whole = torch.empty(shard.global_shape, dtype=local.dtype)
    for rank in range(size):
        offset = 0
        for lo, hi in blocks_of(shard, me, rank):
            whole.narrow(shard.dim, lo, hi - lo).copy_(every[rank].narrow(shard.dim, offset, hi - lo))
            offset += hi - lo
    return whole


def blocks_of(shard: TensorShard, me: int, rank: int) -> Tuple[Tuple[int, int], ...]:
    """The blocks of group rank `rank`, from `shard`, group rank `me`'s: the same part of each, shifted."""
    return tuple((lo + (rank - me) * (hi - lo), hi + (rank - me) * (hi - lo)) for lo, hi in shard.blocks)
