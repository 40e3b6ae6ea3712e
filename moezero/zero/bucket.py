"""Bucket: one bucket of a family's gradients, with all its state in one record; LaunchQueue: the buckets reduced
over one process group, in the one order every rank launches them.

A family's flat layout (`partition.py`) cuts its params into buckets. The family's grad strategy
(`grad_strategies.py`) makes one Bucket per bucket, and each part of the gradient's way keeps its state there:

    who         family, index, members (the params' records, in layout order), strategy (the family's grad side)
    backward    pending (members whose gradient has not arrived), touched (prepared for this backward's
                gradients), staged (every member delivered or was zero-filled: it may launch)    - GradReducer's
    gradients   views (what the params' .grad show while autograd adds into the bucket; None: copied in),
                staging (stages 2/3: this backward's buffer), shard (stages 1-3: this rank's reduced slice,
                summed over backwards) and cleared (nothing reduced into the shard since the step began: it
                reads as zeros), and stage 0's flags                                             - the strategy's
    reduction   work (the launched collective) and finish (what runs once it completed), generation (how many
                finished)                                                                 - the LaunchQueue's

Launch order. Collectives on one process group pair up by issue order, so every rank must launch the same
buckets in the same order on it. Families that share a group (two dtypes of dense params) form one queue: all
buckets of the first family, then the next, each in index order. A bucket is launched once it and every bucket
before it in its queue are staged; nothing here ever blocks inside backward (completed reductions are only
polled), so no rank waits on a collective that another rank can only join later.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Sequence

import torch

from moezero import ops
from moezero.zero.zero_param import ParamFamily, ZeroParam


class GradSide(Protocol):
    """What a bucket's launch asks of its family's grad strategy. The strategy is a `GradStrategy`
    (grad_strategies.py), whose every method takes the Bucket; that module builds on this one, so the bucket
    names only the call it makes itself."""

    def launch(self, bucket: "Bucket") -> None:
        """Start the bucket's reduction: set `bucket.work` and `bucket.finish`."""


class StagingBuffer:
    """A bucket-sized buffer a bucket's gradients gather in for one backward (stages 2/3, from its family's pool),
    and the params' views into it for each bucket it served (built once: buffers come back from the pool)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._views: Dict[int, List[torch.Tensor]] = {}

    def views(self, bucket: "Bucket") -> List[torch.Tensor]:
        if bucket.index not in self._views:
            self._views[bucket.index] = [bucket.family.view_in_bucket(self.tensor, zp) for zp in bucket.members]
        return self._views[bucket.index]


@dataclass(eq=False)
class Bucket:
    """One bucket of a family's gradients (see the module docstring)."""

    family: ParamFamily
    index: int
    strategy: GradSide
    members: List[ZeroParam] = field(init=False)
    numel: int = field(init=False)
    # this backward (GradReducer)
    pending: int = 0
    touched: bool = False
    staged: bool = False
    # the gradients (the grad strategy)
    views: Optional[List[torch.Tensor]] = None
    staging: Optional[StagingBuffer] = None
    added_directly: bool = False  # stages 2/3, a group of one: this backward's gradients are in the shard
    shard: Optional[torch.Tensor] = None
    cleared: bool = True
    holds_average: bool = False  # stage 0: the buffer holds the last reduction's average ...
    rescaled: bool = False  # ... which this backward rescaled before adding to it
    cast: Optional[torch.Tensor] = None  # stage 0: the average in the master dtype (one copy per reduction)
    # the reduction (LaunchQueue)
    work: Optional[Any] = None
    finish: Optional[Callable[[], None]] = None
    generation: int = 0  # reductions finished into it (and assignments): what read it before is stale

    def __post_init__(self):
        self.members = self.family.bucket_members[self.index]
        self.numel = self.family.bucket_numel(self.index)

    def begin_pass(self) -> None:
        """A new backward: every member's gradient is awaited again."""
        for zp in self.members:
            zp.fired = False
        self.pending = len(self.members)
        self.staged = self.touched = False

    # ---- this rank's reduced shard (stages 1-3) ---------------------------------------------------
    def read_shard(self) -> torch.Tensor:
        """The shard; zeros when nothing was reduced into it since it was cleared (zeroed only then: a memset
        and a read of every shard less per step, a visible share of a small model's step)."""
        if self.cleared:
            self.shard.zero_()
            self.cleared = False
        return self.shard

    def add_to_shard(self, reduced: torch.Tensor, scale: float) -> None:
        """Add this rank's reduced slice, times `scale`, to the shard (a cleared shard is written, not added to)."""
        if self.cleared:  # scaled and cast in fp32 (or fp64), as add_ would onto zeros
            ops.flatten_into(self.shard, [reduced], [0], scale)
            self.cleared = False
        else:
            self.shard.add_(reduced, alpha=scale)  # a wider shard dtype promotes in place

    def add_local(self, fired: List[ZeroParam], scale: float) -> None:
        """A group of one (nothing to reduce): add the fired params' grads, scaled and cast, to the whole-bucket
        shard."""
        ops.flatten_into(
            self.shard,
            [zp.param.grad for zp in fired],
            [zp.slot.offset for zp in fired],
            scale,
            accumulate=not self.cleared,
        )
        if self.cleared:
            zero_uncovered(self.shard, fired)
            self.cleared = False

    # ---- the reduction (LaunchQueue) --------------------------------------------------------------
    def launched(self, work: Optional[Any], finish: Callable[[], None]) -> None:
        self.work, self.finish = work, finish

    def reduced(self) -> bool:
        """The launched reduction completed (never blocks)."""
        return self.work is None or self.work.is_completed()

    def wait(self) -> None:
        """Wait for the launched reduction and finish it."""
        work, finish = self.work, self.finish
        self.work = self.finish = None
        if work is not None:
            work.wait()
        finish()
        self.generation += 1


def zero_uncovered(target: torch.Tensor, fired: List[ZeroParam]) -> None:
    """Zero what the grads of `fired` did not write in a bucket-sized tensor (params that got none, alignment)."""
    covered = 0
    for lo, hi in sorted(zp.bucket_range((0, zp.slot.numel)) for zp in fired):
        if lo > covered:
            target[covered:lo].zero_()
        covered = hi
    target[covered:].zero_()


class LaunchQueue:
    """The buckets of the families that reduce over one process group, in launch order (see the module
    docstring)."""

    def __init__(self, buckets: Sequence[Bucket]):
        self.buckets = list(buckets)
        self.next = 0  # the first bucket not launched in this round
        self.inflight: Deque[Bucket] = collections.deque()

    def launch_ready(self) -> None:
        while self.next < len(self.buckets) and self.buckets[self.next].staged:
            self._launch_next()

    def launch_up_to(self, count: int) -> None:
        """Launch buckets until `count` are launched, staged or not (aligning with peers)."""
        while self.next < min(count, len(self.buckets)):
            self._launch_next()

    def poll(self) -> None:
        """Finish reductions that already completed, oldest first; never blocks."""
        while self.inflight and self.inflight[0].reduced():
            self.inflight.popleft().wait()

    def wait_all(self) -> None:
        while self.inflight:
            self.inflight.popleft().wait()

    def rewind(self) -> None:
        """A new backward pass (or reduction round) launches from the first bucket again."""
        self.wait_all()
        self.next = 0

    def _launch_next(self) -> None:
        bucket = self.buckets[self.next]
        bucket.strategy.launch(bucket)
        self.inflight.append(bucket)
        self.next += 1


def build_queues(buckets: Sequence[Bucket]) -> List[LaunchQueue]:
    """One queue per distinct process group object, families and buckets in their (rank-independent) order."""
    by_group: Dict[int, List[Bucket]] = {}
    for bucket in buckets:
        by_group.setdefault(id(bucket.family.group), []).append(bucket)
    return [LaunchQueue(members) for members in by_group.values()]
