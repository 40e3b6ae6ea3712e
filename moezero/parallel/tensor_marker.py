"""The tag on tensor-parallel (TP / ETP) shards: "this param is a slice of a larger global tensor".

A column-parallel weight holds rows of the global weight, a row-parallel one columns, a vocab-parallel embedding
rows of the vocabulary. A fused weight ([gate | up] of a GLU fc1, [q | k | v] of attention) is several parts
along one dim, each split over the group: rank r holds block r of every part, so the local tensor has the fused
layout again at 1/tp of the width. The layer sets the tag; keyed init, the optimizer and checkpoints read it to
map the local tensor to global coordinates, so none of them imports the layers (as expert_marker.py).

A routed-expert stack split over expert tensor parallelism (ETP) carries both tags: its TensorShard describes the
rank's own experts (dim 0 is the local experts, whole), split along the ffn dim; its ExpertShard (expert_marker.py)
places those experts among the global ones along dim 0.

A second tag, `mark_tp_partial`, is for the opposite case: a param whole on every rank of the group whose
gradient is partial on each (a row-parallel bias under sequence parallelism: each rank adds it to its own
sequence shard), so the one-process gradient is the sum over the group; the optimizer sums it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

_ATTR = "_moezero_tensor_shard"
_PARTIAL_ATTR = "_moezero_tp_partial"


@dataclass(frozen=True)
class TensorShard:
    """Along `dim` of a global tensor shaped `global_shape`, this rank holds the global index ranges `blocks`
    ((lo, hi), half-open), concatenated in this order; every other dim whole."""

    global_shape: Tuple[int, ...]
    dim: int
    blocks: Tuple[Tuple[int, int], ...]

    def __post_init__(self):
        if not 0 <= self.dim < len(self.global_shape):
            raise ValueError(f"dim {self.dim} of a tensor shaped {self.global_shape}")
        extent = self.global_shape[self.dim]
        if not self.blocks or any(not 0 <= lo < hi <= extent for lo, hi in self.blocks):
            raise ValueError(f"blocks {self.blocks} do not lie in [0, {extent}) of dim {self.dim}")

    @classmethod
    def split(
        cls, global_shape: Sequence[int], dim: int, rank: int, size: int, parts: Optional[Sequence[int]] = None
    ) -> "TensorShard":
        """Rank `rank`'s shard of `global_shape` split over `size` ranks along `dim`: of each part (their sizes
        along `dim`, in order; default: one part, the whole dim) the rank's contiguous 1/size."""
        global_shape = tuple(int(n) for n in global_shape)
        parts = tuple(parts) if parts else (global_shape[dim],)
        if sum(parts) != global_shape[dim]:
            raise ValueError(f"parts {parts} do not add up to dim {dim} of {global_shape}")
        if any(p % size for p in parts):
            raise ValueError(f"parts {parts} of dim {dim} of {global_shape} do not split over {size} ranks")
        blocks, start = [], 0
        for part in parts:
            n = part // size
            blocks.append((start + rank * n, start + (rank + 1) * n))
            start += part
        return cls(global_shape, dim, tuple(blocks))

    @property
    def local_shape(self) -> Tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.dim] = sum(hi - lo for lo, hi in self.blocks)
        return tuple(shape)

    def item_shard(self) -> "TensorShard":
        """The shard of one index of dim 0 (one expert of a stack split along a later dim)."""
        if self.dim == 0:
            raise ValueError(f"a shard along dim 0 of {self.global_shape} has no whole items along it")
        return TensorShard(self.global_shape[1:], self.dim - 1, self.blocks)

    def local_of(self, global_tensor: torch.Tensor) -> torch.Tensor:
        """This shard's values cut out of the global tensor (a new contiguous tensor): keyed init draws the global
        tensor and keeps the shard, so every tp gives every element the same value."""
        if tuple(global_tensor.shape) != self.global_shape:
            raise ValueError(f"a global tensor shaped {tuple(global_tensor.shape)}, the shard's is {self.global_shape}")
        pieces = [global_tensor.narrow(self.dim, lo, hi - lo) for lo, hi in self.blocks]
        return torch.cat(pieces, self.dim).contiguous()

    def global_flat_ranges(self, lo: int, hi: int) -> List[Tuple[int, int]]:
        """The global flat ranges ((start, stop), in local order, adjacent ones merged) that hold the local flat
        range [lo, hi) of the contiguous local tensor.

        Along dim 0 (column-parallel rows, vocabulary rows) that is at most one range per block the local range
        crosses. Along a later dim (row-parallel columns) the local tensor's rows are short runs of the global
        rows: one range per outer index and block crossed (for a (out, in/tp) weight, one per row) — exact, but
        long; a compact form for checkpoints (boxes) is the caller's to build from these."""
        numel = math.prod(self.local_shape)
        if not 0 <= lo <= hi <= numel:
            raise ValueError(f"local range [{lo}, {hi}) outside a shard of {numel} elements")
        inner = math.prod(self.global_shape[self.dim + 1 :])
        local_row = self.local_shape[self.dim] * inner  # elements per outer index, locally
        global_row = self.global_shape[self.dim] * inner
        ranges: List[Tuple[int, int]] = []
        if lo == hi:
            return ranges
        for outer in range(lo // local_row, (hi - 1) // local_row + 1):
            local_start = outer * local_row
            for block_lo, block_hi in self.blocks:
                run = (block_hi - block_lo) * inner
                start, stop = max(lo, local_start), min(hi, local_start + run)
                if start < stop:
                    offset = outer * global_row + block_lo * inner - local_start
                    _append_merged(ranges, start + offset, stop + offset)
                local_start += run
        return ranges


def _append_merged(ranges: List[Tuple[int, int]], start: int, stop: int) -> None:
    if ranges and ranges[-1][1] == start:
        ranges[-1] = (ranges[-1][0], stop)
    else:
        ranges.append((start, stop))


def mark_tensor_parallel(param: torch.Tensor, shard: TensorShard) -> None:
    if tuple(param.shape) != shard.local_shape:
        raise ValueError(f"a tensor of shape {tuple(param.shape)} is not the shard {shard.local_shape} it is tagged")
    setattr(param, _ATTR, shard)


def tensor_shard_of(param: torch.Tensor) -> Optional[TensorShard]:
    """The TensorShard of a tensor-parallel param, None for a whole (replicated) one."""
    return getattr(param, _ATTR, None)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return tensor_shard_of(param) is not None


def mark_tp_partial(param: torch.Tensor) -> None:
    """`param` is replicated over the tensor-parallel group but each rank's gradient is its part of the sum."""
    if is_tensor_parallel(param):
        raise ValueError(f"a tensor-parallel shard of shape {tuple(param.shape)} cannot also be a partial replica")
    setattr(param, _PARTIAL_ATTR, True)


def is_tp_partial(param: torch.Tensor) -> bool:
    return getattr(param, _PARTIAL_ATTR, False)
