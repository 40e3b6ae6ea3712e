"""A short all-reduce (a flag, a norm's sum of squares, the step's metrics) as every rank's copy sent to every
rank, which then reduces the copies itself. The copies travel as the group's transport carries them
(transport.py): through pipes when its ranks share a host (local_transport.py, any length), else as gloo's
all-gather (from 2 elements per rank).

Why: a short all-reduce costs its rounds, not its bytes, and gloo's ring takes twice the rounds of its
all-gather: from a few elements per rank on, gloo's all-reduce costs more CPU than this one
(`tools/bench_small_reduce.py`, docs/benchmarks.md#small-reduce), and a stage-3 step states ~10 agreement
records. Below 2 elements per rank gloo's own is the faster of the two (it reduces them in one step), so
without pipes it keeps those.
The reduction runs in rank order with exact elementwise ops, so every rank gets the same bits whatever its
CPU.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist

from moezero.parallel.transport import transport_of
from moezero.parallel.work import Work

SMALL_REDUCE_BYTES = 64 * 1024  # an all-reduce whose gathered copies (ranks x bytes) fit this travels as one
_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


def gather_copies(x: torch.Tensor, group: Any) -> Work:
    """Every rank's copy of the short CPU tensor `x`, launched now: a work (is_completed, wait(timeout)) whose
    `copies`, once waited for, holds them flat in rank order; as the group's transport carries them."""
    return transport_of(group).gather_copies(x)


def reduces_small(x: torch.Tensor, group: Any, op: Any) -> bool:
    """Whether GatheredReduce serves this all-reduce (SUM / MAX / MIN of a short CPU tensor, as the group's
    transport decides for its length: `Transport.reduces_by_copies`)."""
    if group is None or x.device.type != "cpu" or op not in _OPS or x.numel() == 0:
        return False
    world = dist.get_world_size(group)
    if x.numel() * x.element_size() * world > SMALL_REDUCE_BYTES:
        return False
    return transport_of(group).reduces_by_copies(x.numel())


class GatheredReduce:
    """Every rank's copy of `x`, being gathered as the group's transport carries it; once waited for, `x` holds
    their reduction (a work)."""

    def __init__(self, x: torch.Tensor, group: Any, op: Any):
        self.x, self.op = x, op
        self.work = gather_copies(x, group)

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        """Block until reduced (`timeout`: RuntimeError after it, and a later wait resumes)."""
        if self.work is None:
            return True
        self.work.wait(timeout)
        copies, self.work = self.work.copies, None
        self.x.copy_(_reduced(copies.view(-1, self.x.numel()), self.op).view_as(self.x))
        return True


def _reduced(copies: torch.Tensor, op: Any) -> torch.Tensor:
    """The copies reduced in rank order, one exact elementwise op per rank: the same bits on every rank."""
    total = copies[0].clone()
    for row in copies[1:]:
        if op == dist.ReduceOp.SUM:
            total.add_(row)
        else:
            keep = row > total if op == dist.ReduceOp.MAX else row < total
            total = torch.where(keep | row.isnan(), row, total)  # NaN wins, as in torch.maximum
    return total
