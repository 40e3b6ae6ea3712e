"""A short all-reduce on gloo (a flag, a norm's sum of squares, an agreement record) as an all-gather that every
rank then reduces itself.

Why: a short all-reduce costs its rounds, not its bytes, and gloo's ring takes twice the rounds of its
all-gather: from a few elements per rank on, gloo's all-reduce costs ~1.5-2x the CPU of this one
(`tools/bench_small_reduce.py`, docs/benchmarks.md#small-reduce), and a stage-3 step states ~10 agreement
records. Below 2 elements per rank gloo's own is the faster (it reduces them in one step), so it keeps those.
The reduction runs in rank order with exact elementwise ops, so every rank gets the same bits whatever its
CPU. gloo's own all-gather, not the point-to-point exchange of
`peer_exchange.py`: a gloo receive reports completion only once waited for, and a wait given a timeout ends it,
while waits watched in slices (`agreement.watched_wait`) and records checked as they arrive need both.
"""
from __future__ import annotations

import datetime
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from moezero.torch_internals import all_gather_single

SMALL_REDUCE_BYTES = 64 * 1024   # an all-reduce whose gathered copies (ranks x bytes) fit this travels as one
_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


def gather_copies(x: torch.Tensor, group: Any) -> Tuple[torch.Tensor, Any]:
    """(every rank's copy of the short CPU tensor `x`, flat in rank order, valid once the work completed; the
    async work of gloo's all-gather, which reports completion as soon as it completed)."""
    copies = torch.empty(dist.get_world_size(group) * x.numel(), dtype=x.dtype)
    return copies, all_gather_single(copies, x.reshape(-1), group=group, async_op=True)


def reduces_small(x: torch.Tensor, group: Any, op: Any) -> bool:
    """Whether GatheredReduce serves this all-reduce (a gloo group, a short CPU tensor of at least 2 elements
    per rank, SUM / MAX / MIN)."""
    if group is None or dist.get_backend(group) != "gloo" or x.device.type != "cpu" or op not in _OPS:
        return False
    world = dist.get_world_size(group)
    return x.numel() >= 2 * world and x.numel() * x.element_size() * world <= SMALL_REDUCE_BYTES


class GatheredReduce:
    """Every rank's copy of `x`, being gathered; once waited for, `x` holds their reduction (a work handle)."""

    def __init__(self, x: torch.Tensor, group: Any, op: Any):
        self.x, self.op = x, op
        self.copies, self.work = gather_copies(x, group)

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        """Block until reduced (`timeout`: RuntimeError after it, and a later wait resumes)."""
        if self.work is None:
            return True
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timeout)
        self.work = None
        self.x.copy_(_reduced(self.copies.view(-1, self.x.numel()), self.op).view_as(self.x))
        self.copies = None
        return True


def _reduced(copies: torch.Tensor, op: Any) -> torch.Tensor:
    """The copies reduced in rank order, one exact elementwise op per rank: the same bits on every rank."""
    total = copies[0].clone()
    for row in copies[1:]:
        if op == dist.ReduceOp.SUM:
            total.add_(row)
        else:
            keep = row > total if op == dist.ReduceOp.MAX else row < total
            total = torch.where(keep | row.isnan(), row, total)   # NaN wins, as in torch.maximum
    return total

