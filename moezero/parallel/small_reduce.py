"""A short all-reduce (a flag, a norm's sum of squares, the step's metrics) as every rank's copy sent to every
rank, which then reduces the copies itself: through the group's pipes when its ranks share a host
(`local_channel.py`: ~0.05-0.1 ms, any length), else as gloo's all-gather.

Why: a short all-reduce costs its rounds, not its bytes, and gloo's ring takes twice the rounds of its
all-gather: from a few elements per rank on, gloo's all-reduce costs ~1.5-2x the CPU of this one
(`tools/bench_small_reduce.py`, docs/benchmarks.md#small-reduce), and a stage-3 step states ~10 agreement
records. Below 2 elements per rank gloo's own is the faster of the two (it reduces them in one step), so
without pipes it keeps those.
The reduction runs in rank order with exact elementwise ops, so every rank gets the same bits whatever its
CPU. gloo's own all-gather, not the point-to-point exchange of
`peer_exchange.py`: a gloo receive reports completion only once waited for, and a wait given a timeout ends it,
while waits watched in slices (`agreement.watched_wait`) and records checked as they arrive need both.
"""
from __future__ import annotations

import datetime
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from moezero.parallel import local_channel
from moezero.torch_internals import all_gather_single

SMALL_REDUCE_BYTES = 64 * 1024   # an all-reduce whose gathered copies (ranks x bytes) fit this travels as one
_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


def gather_copies(x: torch.Tensor, group: Any) -> Any:
    """Every rank's copy of the short CPU tensor `x`, launched now: a work handle (is_completed, wait(timeout))
    whose `copies`, once waited for, holds them flat in rank order; through the group's pipes when it has them
    (`local_channel.py`), else gloo's all-gather (which reports completion as soon as it completed)."""
    channel = local_channel.of(group)
    return _PipedCopies(channel, x) if channel is not None else _GlooCopies(x, group)


def reduces_small(x: torch.Tensor, group: Any, op: Any) -> bool:
    """Whether GatheredReduce serves this all-reduce (SUM / MAX / MIN of a short CPU tensor): on a group with
    pipes (`local_channel.py`, every rank on one host) any length; else on gloo, at least 2 elements per rank."""
    if group is None or x.device.type != "cpu" or op not in _OPS or x.numel() == 0:
        return False
    world = dist.get_world_size(group)
    if x.numel() * x.element_size() * world > SMALL_REDUCE_BYTES:
        return False
    return local_channel.of(group) is not None or (dist.get_backend(group) == "gloo" and x.numel() >= 2 * world)


class GatheredReduce:
    """Every rank's copy of `x`, being gathered (through the group's pipes if it has them, else gloo's
    all-gather); once waited for, `x` holds their reduction (a work handle)."""

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


class _GlooCopies:
    """gather_copies on gloo: its all-gather."""

    def __init__(self, x: torch.Tensor, group: Any):
        self.copies = torch.empty(dist.get_world_size(group) * x.numel(), dtype=x.dtype)
        self.work = all_gather_single(self.copies, x.reshape(-1), group=group, async_op=True)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timeout)
        return True


class _PipedCopies:
    """gather_copies through the group's pipes: completed once every copy came or the group's timeout passed
    since the launch (wait() then raises, as a gloo work's would)."""

    def __init__(self, channel: Any, x: torch.Tensor):
        self.channel, self.dtype, self.numel = channel, x.dtype, x.numel()
        self.index = channel.post(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        self.deadline = time.monotonic() + channel.timeout
        self.copies: Optional[torch.Tensor] = None

    def is_completed(self) -> bool:
        return self.channel.arrived(self.index) or time.monotonic() >= self.deadline

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        left = max(0.0, self.deadline - time.monotonic())
        if timeout is None or timeout.total_seconds() >= left:   # up to the group's timeout from the launch
            every = self.channel.wait(self.index, left)
        else:   # a slice: ChannelTimeout, and a later wait resumes
            every = self.channel.wait(self.index, timeout.total_seconds(), final=False)
        if any(len(m) != len(every[0]) for m in every):
            raise RuntimeError(f"a short all-reduce of {self.numel} elements met a rank's of another length: the "
                               "ranks are not running the same collectives")
        self.copies = torch.frombuffer(bytearray(b"".join(every)), dtype=self.dtype)
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

