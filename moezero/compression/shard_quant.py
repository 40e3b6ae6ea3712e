"""Fake quantization of a tensor-parallel shard with the whole weight's scales.

A quantization row (quantizer.py) is a contiguous run of the *global* flattened weight; a rank's shard holds
pieces of rows: whole rows or runs of them for a column-parallel weight, a column block of every global row for a
row-parallel one, several blocks for a fused weight ([q | k | v], [gate | up]). `ShardRows` maps each local element
to its global row. Each forward every rank takes its elements' max (min) per global row, a MAX all-reduce over
the weight's tp (etp) group gives the rows' ranges, and every rank quantizes its own elements on the grid one
process computes from the whole weight: the same scales, the same codes.

    rows = ShardRows(tensor_shard, units, groups)
    w_hat = fake_quantize_shard(w, bits, rows, symmetric, group, noise)   # collective over `group`
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from moezero.compression.quantizer import RowGrid, StraightThrough
from moezero.parallel import comm
from moezero.parallel.tensor_marker import TensorShard


class ShardRows:
    """The global quantization row of every element of a shard (`units` x `groups` rows of the global tensor of
    `shard`; for an expert stack split over etp, the shard's global tensor is the rank's own experts whole)."""

    def __init__(self, shard: TensorShard, units: int, groups: int):
        self.shard = shard
        self.num_rows = units * groups
        self.row_length = math.prod(shard.global_shape) // self.num_rows

    def ids(self, device: torch.device) -> torch.Tensor:
        """(numel,) int64: the global row of each element of the contiguous local tensor. Rebuilt at each call
        rather than kept: 8 bytes an element would outweigh the weight itself."""
        return (self._global_flat_index(device) // self.row_length).reshape(-1)

    def _global_flat_index(self, device: torch.device) -> torch.Tensor:
        shape, dim = self.shard.global_shape, self.shard.dim
        flat = torch.zeros((), dtype=torch.long, device=device)
        stride = 1
        for d in reversed(range(len(shape))):
            if d == dim:
                index = torch.cat([torch.arange(lo, hi, device=device) for lo, hi in self.shard.blocks])
            else:
                index = torch.arange(shape[d], device=device)
            view = [1] * len(shape)
            view[d] = -1
            flat = flat + index.view(view) * stride
            stride *= shape[d]
        return flat


def shard_grid(
    w_flat: torch.Tensor, ids: torch.Tensor, num_rows: int, bits: int, symmetric: bool, group: Any
) -> RowGrid:
    """The grid of the `num_rows` global rows from the rank's fp32 elements and their rows `ids` (collective over
    `group`, the ranks of the shards)."""
    zeros = torch.zeros(num_rows, dtype=w_flat.dtype, device=w_flat.device)
    # initial 0s: the range always includes 0 (quantizer.py), and a row this rank has no element of stays neutral
    if symmetric:
        ranges = zeros.scatter_reduce(0, ids, w_flat.abs(), "amax")
    else:
        w_max = zeros.scatter_reduce(0, ids, w_flat, "amax")
        ranges = torch.cat([w_max, -zeros.scatter_reduce(0, ids, w_flat, "amin")])
    comm.all_reduce(ranges, group, op=dist.ReduceOp.MAX)
    w_max, w_min = (ranges, zeros) if symmetric else (ranges[:num_rows], -ranges[num_rows:])
    return RowGrid.of_range(w_max, w_min, bits, symmetric)


def quantize_shard(
    w: torch.Tensor, bits: int, rows: ShardRows, symmetric: bool, group: Any, noise: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(w_hat fp32 shaped like w, and w in fp32) on the whole weight's grid; collective over `group`."""
    w_flat = w.detach().reshape(-1).float()
    ids = rows.ids(w.device)
    grid = shard_grid(w_flat, ids, rows.num_rows, bits, symmetric, group)
    scale, zero = grid.scale_R[ids], grid.zero_point_R[ids]
    q = grid.codes(w_flat, scale, zero, None if noise is None else noise.reshape(-1))
    return ((q - zero) * scale).view(w.shape), w_flat.view(w.shape)


def fake_quantize_shard(
    w: torch.Tensor, bits: int, rows: ShardRows, symmetric: bool, group: Any, noise: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """w_hat (w's shape and dtype) with the gradient passed straight through to w; collective over `group`."""
    with torch.no_grad():
        w_hat = quantize_shard(w, bits, rows, symmetric, group, noise)[0].to(w.dtype)
    return StraightThrough.apply(w, w_hat)
