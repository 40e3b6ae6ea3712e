"""What each ZeRO stage does with a bucket's gradients: the reduction strategies.

All three average over the data-parallel world (the sum over the family's group divided by
the dp size: expert grads are summed over `edp` and divided by dp too, since every rank's
tokens reach every expert), and all three hand the optimizer a reduced gradient per bucket.

  Stage 0: a persistent full-size gradient buffer, all-reduced in place (data parallelism).
  Stage 1: a persistent full-size gradient buffer, reduce-scattered into this rank's shard.
  Stage 2: no full-size buffer between backwards: a bucket's gradients are copied into a
           temporary buffer when ready, reduce-scattered, added to this rank's shard, freed.

Stage 0/1 reductions are idempotent on accumulated gradients (stage 0 like DDP: a reduced
buffer holds the same average everywhere; stage 1 re-reduces the whole local accumulation
and overwrites the shard), so reducing after every backward that is not under `no_sync`, and
once more at `step()` if needed, is always correct.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from moezero import ops
from moezero.parallel import comm
from moezero.zero.buckets import ParamFamily


STAGING_POOL_BUCKETS = 4  # stage 2 keeps at most this many largest-bucket staging buffers for reuse


@dataclass
class InFlight:
    """A launched bucket reduction and what to do once it completed."""

    bucket: int
    work: Any
    finish: Callable[[], None]

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.finish()


class StageStrategy(abc.ABC):
    """Shared state: the family, dtypes and the dp size the average divides by; each stage
    implements how a bucket's gradients are staged, reduced, read back and zeroed."""

    reduces_every_backward = False   # stage 2: no_sync does not defer its reductions
    keeps_full_grads = True

    def __init__(self, family: ParamFamily, reduce_dtype: torch.dtype, master_dtype: torch.dtype, dp_size: int):
        self.family = family
        self.reduce_dtype = reduce_dtype
        self.master_dtype = master_dtype
        self.scale = 1.0 / dp_size

    def optimizer_range(self, bucket: int) -> Tuple[int, int]:
        """The part of a bucket whose master weights and optimizer state this rank holds."""
        return self.family.own_range(bucket)

    def _grad_offsets(self, bucket: int, fired: List[int]) -> List[int]:
        return [self.family.slot(i).offset for i in fired]

    @property
    def accumulates_in_place(self) -> bool:
        """Params' .grad can be views of the bucket (same dtype), so autograd adds into it directly."""
        return self.family.dtype == self.reduce_dtype

    def accumulation_views(self, bucket: int) -> Optional[List[torch.Tensor]]:
        """Views for the .grad of the bucket's params (in bucket order), or None: copy them instead."""
        return None

    def _foreign(self, bucket: int, fired: List[int], grads: List[torch.Tensor], region: torch.Tensor):
        """The (indices, grads) that are not already views of `region` and must be copied in."""
        base, size = region.data_ptr(), region.numel() * region.element_size()
        keep = [(i, g) for i, g in zip(fired, grads) if not base <= g.data_ptr() < base + size]
        return [i for i, _ in keep], [g for _, g in keep]

    @abc.abstractmethod
    def stage(self, bucket: int, fired: List[int], grads: List[torch.Tensor]) -> None:
        """See the module docstring."""

    @abc.abstractmethod
    def launch(self, bucket: int) -> InFlight:
        """See the module docstring."""

    @abc.abstractmethod
    def reduced_grad(self, bucket: int) -> torch.Tensor:
        """Averaged gradient over `optimizer_range(bucket)`, in the master dtype."""

    @abc.abstractmethod
    def zero(self) -> None:
        """See the module docstring."""


class _FullBufferStage(StageStrategy):
    """Stages 0 and 1: gradients accumulate in a persistent family-sized buffer (params' .grad are
    views of it when the dtypes match, as DDP's gradient_as_bucket_view)."""

    def __init__(self, *args):
        super().__init__(*args)
        fam = self.family
        self.grad_buffer = torch.zeros(fam.layout.total_numel, dtype=self.reduce_dtype, device=fam.buffer.device)

    def accumulation_views(self, bucket):
        if not self.accumulates_in_place:
            return None
        return [self.family.param_view(self.grad_buffer, i) for i in self.family.buckets[bucket].params]

    def stage(self, bucket, fired, grads):
        region = self.family.bucket_region(self.grad_buffer, bucket)
        fired, grads = self._foreign(bucket, fired, grads, region)
        if grads:
            ops.flatten_into(region, grads, self._grad_offsets(bucket, fired), accumulate=True)

    def zero(self):
        self.grad_buffer.zero_()


class Stage0AllReduce(_FullBufferStage):
    """In-place all-reduce. The buffer holds the *group* average after each reduction, which is what
    makes repeated reductions of an accumulating buffer exact (as in DDP); the optimizer's gradient
    is that times group size / dp size (1 for dense params, 1/ep for experts reduced over edp)."""

    def optimizer_range(self, bucket):
        return 0, self.family.layout.buckets[bucket].numel

    def launch(self, bucket):
        region = self.family.bucket_region(self.grad_buffer, bucket)
        work = comm.all_reduce(region, self.family.group, async_op=True)
        return InFlight(bucket, work, lambda: region.mul_(1.0 / self.family.group_size))

    def reduced_grad(self, bucket):
        region = self.family.bucket_region(self.grad_buffer, bucket)
        factor = self.family.group_size * self.scale
        return region.to(self.master_dtype) if factor == 1.0 else region.to(self.master_dtype) * factor


class Stage1ReduceScatterAtBoundary(_FullBufferStage):
    def __init__(self, *args):
        super().__init__(*args)
        fam = self.family
        self.shards = [torch.zeros(b.numel // fam.group_size, dtype=self.master_dtype, device=fam.buffer.device)
                       for b in fam.layout.buckets]

    def launch(self, bucket):
        region = self.family.bucket_region(self.grad_buffer, bucket)
        shard = self.shards[bucket]
        out = shard if shard.dtype == self.reduce_dtype else torch.empty_like(shard, dtype=self.reduce_dtype)
        work = comm.reduce_scatter(out, region, self.family.group, async_op=True)

        def finish():
            shard.copy_(out)  # overwrite: the buffer held the whole local accumulation
            shard.mul_(self.scale)
        return InFlight(bucket, work, finish)

    def reduced_grad(self, bucket):
        return self.shards[bucket]

    def zero(self):
        super().zero()
        for shard in self.shards:
            shard.zero_()


class Stage2ReduceScatterEveryBackward(StageStrategy):
    reduces_every_backward = True
    keeps_full_grads = False

    def __init__(self, *args):
        super().__init__(*args)
        fam = self.family
        self.shards = [torch.zeros(b.numel // fam.group_size, dtype=self.master_dtype, device=fam.buffer.device)
                       for b in fam.layout.buckets]
        self._staging: List[Optional[torch.Tensor]] = [None] * len(fam.layout.buckets)
        self._gaps = [_gaps(fam, b) for b in range(len(fam.layout.buckets))]
        # reduced staging buffers are kept for reuse (fresh allocations cost page faults every
        # backward), at most a few buckets' worth, so memory stays O(shard + in-flight buckets)
        self._pool: Dict[int, List[torch.Tensor]] = {}
        self._pool_limit = STAGING_POOL_BUCKETS * max(b.numel for b in fam.layout.buckets)

    def accumulation_views(self, bucket):
        """Allocated when the bucket's first gradient is about to arrive, freed after its reduction."""
        if not self.accumulates_in_place:
            return None
        if self._staging[bucket] is None:
            self._staging[bucket] = self._new_staging(bucket, zeroed=True)
        staging = self._staging[bucket]
        fam = self.family
        return [staging[fam.slot(i).offset:fam.slot(i).offset + fam.slot(i).numel].view(fam.params[i].shape)
                for i in fam.buckets[bucket].params]

    def _new_staging(self, bucket: int, zeroed: bool) -> torch.Tensor:
        numel = self.family.layout.buckets[bucket].numel
        pooled = self._pool.get(numel)
        staging = pooled.pop() if pooled else \
            torch.empty(numel, dtype=self.reduce_dtype, device=self.family.buffer.device)
        if zeroed:
            return staging.zero_()
        for lo, hi in self._gaps[bucket]:  # every param is about to be copied in: only gaps need zeros
            staging[lo:hi].zero_()
        return staging

    def _release(self, staging: torch.Tensor) -> None:
        pooled = sum(t.numel() for buffers in self._pool.values() for t in buffers)
        if pooled + staging.numel() <= self._pool_limit:
            self._pool.setdefault(staging.numel(), []).append(staging)

    def stage(self, bucket, fired, grads):
        staging = self._staging[bucket]
        if staging is None:
            everyone = len(fired) == len(self.family.buckets[bucket].params)
            staging = self._staging[bucket] = self._new_staging(bucket, zeroed=not everyone)
        fired, grads = self._foreign(bucket, fired, grads, staging)
        if grads:
            ops.flatten_into(staging, grads, self._grad_offsets(bucket, fired))

    def launch(self, bucket):
        staging = self._staging[bucket]
        if staging is None:  # no backward staged it (a rank catching up on a round): contribute zeros
            staging = self._new_staging(bucket, zeroed=True)
        self._staging[bucket] = None
        shard = self.shards[bucket]
        out = torch.empty(shard.shape, dtype=self.reduce_dtype, device=shard.device)
        work = comm.reduce_scatter(out, staging, self.family.group, async_op=True)

        def finish():
            shard.add_(out.to(shard.dtype), alpha=self.scale)
            self._release(staging)  # the reduction is done with it
        return InFlight(bucket, work, finish)

    def reduced_grad(self, bucket):
        return self.shards[bucket]

    def zero(self):
        for shard in self.shards:
            shard.zero_()


def _gaps(family: ParamFamily, bucket: int) -> List[Tuple[int, int]]:
    """Element ranges of a bucket that no param covers (alignment gaps and tail padding)."""
    covered = sorted((family.slot(i).offset, family.slot(i).offset + family.slot(i).numel)
                     for i in family.buckets[bucket].params)
    gaps, position = [], 0
    for lo, hi in covered:
        if lo > position:
            gaps.append((position, lo))
        position = max(position, hi)
    end = family.layout.buckets[bucket].numel
    return gaps + ([(position, end)] if position < end else [])


STAGES = {0: Stage0AllReduce, 1: Stage1ReduceScatterAtBoundary, 2: Stage2ReduceScatterEveryBackward}
