"""The grad side of a family: how each ZeRO stage accumulates, reduces and hands over gradients.

All strategies average over the data-parallel world: the sum over the family's group divided
by the dp size (expert grads are summed over `edp` and divided by dp too, since every rank's
tokens reach every expert), and all hand the optimizer a reduced gradient per bucket.

  AllReduceGrads (stage 0): a persistent full-size buffer (params' .grad are views of it, as
      DDP's gradient_as_bucket_view), all-reduced in place: after a synced backward it holds
      the averaged gradient, which is what .grad shows.
  ReduceScatterAtBoundary (stage 1): a persistent full-size buffer of *local* gradients,
      reduce-scattered into this rank's shard at every synced backward and then cleared.
  ReduceScatterEveryBackward (stages 2 and 3): no full-size buffer between backwards: a
      bucket's gradients land in a temporary buffer, are reduce-scattered, added to this rank's
      shard, and the buffer is reused. Where the sum of the pieces is ours to compute (gloo) and
      the params are narrower than the reduction (bf16 params, fp32 reduction), the buffer keeps the
      params' dtype: one backward's gradients are exactly values of that dtype, so the pieces travel
      at half the bytes and are summed in the reduction dtype, to the same bits.

Buffers are reused on the guarantee of reducer.py's NOTE [no accumulation into a reducing bucket].
"""
from __future__ import annotations

import abc
from typing import Dict, List, Optional

import torch

from moezero import ops
from moezero.parallel import comm
from moezero.zero.launch_queue import InFlight
from moezero.zero.zero_param import ParamFamily, Range, ZeroParam

STAGING_POOL_BUCKETS = 2  # stages 2/3 keep at most this many largest-bucket staging buffers for reuse


class GradStrategy(abc.ABC):
    """Shared state: the family, the dtypes and the dp size the average divides by."""

    reduces_under_no_sync = False   # stages 2/3 reduce every backward; no_sync does not defer them
    holds_local = False             # stages 0/1: a persistent buffer holds what a user's clear may drop

    def __init__(self, family: ParamFamily, reduce_dtype: torch.dtype, master_dtype: torch.dtype, dp_size: int):
        self.family = family
        self.reduce_dtype = reduce_dtype
        self.master_dtype = master_dtype
        self.dp_size = dp_size
        self.in_place = family.dtype == reduce_dtype  # .grad can be a view of the reduction buffer

    def optimizer_range(self, bucket: int) -> Range:
        """The part of a bucket whose master weights and optimizer state this rank holds."""
        return self.family.owned[bucket]

    def accumulation_views(self, bucket: int) -> Optional[List[torch.Tensor]]:
        """Views for the .grad of the bucket's params (bucket order), or None: grads are copied in."""
        return None

    def before_accumulate(self, bucket: int) -> None:
        """Called once per backward per bucket, before any gradient is added into it."""

    def adopt_assigned(self, zp: ZeroParam, view: torch.Tensor, grad: torch.Tensor) -> None:
        """A gradient the user assigned to `.grad` since the last backward: the backward adds on top of it."""
        view.copy_(grad)

    def visible_grads(self, bucket: int, synced: bool) -> Optional[List[torch.Tensor]]:
        """What the params' .grad point to once the bucket is staged (None: .grad is None)."""
        return None

    def assigned_scale(self, bucket: int) -> float:
        """What a gradient assigned by hand is multiplied by before the sum over the group (assigned_grads.py)."""
        return 1.0

    def stage(self, bucket: int, fired: List[ZeroParam]) -> None:
        """Every param of the bucket delivered (or was zero-filled): bring the grads of `fired` into the bucket."""
        target = self._staging_target(bucket)
        base, size = target.data_ptr(), target.numel() * target.element_size()
        foreign = [zp for zp in fired if not base <= zp.param.grad.data_ptr() < base + size]
        if foreign:
            ops.flatten_into(target, [zp.param.grad for zp in foreign], [zp.slot.offset for zp in foreign],
                             accumulate=True)

    @abc.abstractmethod
    def _staging_target(self, bucket: int) -> torch.Tensor:
        """The bucket-sized tensor gradients accumulate in."""

    @abc.abstractmethod
    def launch(self, bucket: int) -> InFlight:
        """Start the bucket's reduction (async)."""

    @abc.abstractmethod
    def reduced_grad(self, bucket: int) -> torch.Tensor:
        """Averaged gradient over `optimizer_range(bucket)`, in the master dtype."""

    @abc.abstractmethod
    def zero(self) -> None:
        """Forget every gradient of the step."""

    def discard_pass(self) -> None:
        """Drop per-backward buffers of a backward that did not finish."""

    def forget_local(self, zp: ZeroParam) -> bool:
        """The user cleared a param's gradient: drop what of it is not reduced into a shard yet; True when that
        was all of it."""
        return False

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of gradient storage held on this rank (buffers, shards, staging and its pool)."""


def _size(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _PersistentBuffer(GradStrategy):
    """Stages 0 and 1: gradients accumulate in a persistent family-sized buffer."""

    holds_local = True

    def __init__(self, *args):
        super().__init__(*args)
        fam = self.family
        self.grad_buffer = torch.zeros(fam.layout.total_numel, dtype=self.reduce_dtype, device=fam.device)
        self._views = [[fam.param_view(self.grad_buffer, zp) for zp in fam.buckets[b]] if self.in_place else None
                       for b in range(fam.num_buckets)]

    def accumulation_views(self, bucket):
        return self._views[bucket]

    def _staging_target(self, bucket):
        return self.family.bucket_region(self.grad_buffer, bucket)

    def forget_local(self, zp):
        self.family.param_view(self.grad_buffer, zp).zero_()   # stage 0: the average it showed; 1: local sums
        return False

    def zero(self):
        self.grad_buffer.zero_()


class AllReduceGrads(_PersistentBuffer):
    """Stage 0. After a reduction the buffer holds the averaged gradient R (sum / dp). Accumulating
    a later backward's local gradient L on top and reducing again must give R + sum(L) / dp: a
    group of g ranks sums g copies of R, so R is first scaled by dp / g (1 for dense params)."""

    def __init__(self, *args):
        super().__init__(*args)
        self._rescale = self.dp_size / self.family.group_size
        self._holds_average = [False] * self.family.num_buckets
        self._rescaled = [False] * self.family.num_buckets   # this backward's before_accumulate rescaled the average
        self._cast: List[Optional[torch.Tensor]] = [None] * self.family.num_buckets   # see reduced_grad

    def optimizer_range(self, bucket):
        return 0, self.family.bucket_numel(bucket)

    def before_accumulate(self, bucket):
        self._cast[bucket] = None
        self._rescaled[bucket] = False
        if self._holds_average[bucket]:
            if self._rescale != 1.0:
                self._staging_target(bucket).mul_(self._rescale)
                self._rescaled[bucket] = True
            self._holds_average[bucket] = False

    def adopt_assigned(self, zp, view, grad):
        """An assigned gradient replaces an average .grad showed: scaled as that average was (dp / g)."""
        view.copy_(grad)
        if self._rescaled[zp.bucket]:
            view.mul_(self._rescale)

    def visible_grads(self, bucket, synced):
        return self._views[bucket]

    def assigned_scale(self, bucket):
        """Assigned where .grad showed the average: an average too (see adopt_assigned)."""
        return self._rescale if self._holds_average[bucket] else 1.0

    def forget_local(self, zp):
        super().forget_local(zp)
        self._cast[zp.bucket] = None
        return True   # nothing of it lives elsewhere

    def launch(self, bucket):
        region = self._staging_target(bucket)
        work = comm.all_reduce(region, self.family.group, async_op=True)

        def finish():
            region.mul_(1.0 / self.dp_size)
            self._holds_average[bucket] = True
            self._cast[bucket] = None
        return InFlight(work, finish)

    def reduced_grad(self, bucket):
        region = self._staging_target(bucket)
        if region.dtype == self.master_dtype:
            return region
        # reduced in another dtype: one master-dtype copy per reduction, so that clip_grad_norm_() and the step
        # that follows scale and read the same tensor
        if self._cast[bucket] is None:
            self._cast[bucket] = region.to(self.master_dtype)
        return self._cast[bucket]

    def zero(self):
        super().zero()
        self._holds_average = [False] * self.family.num_buckets
        self._cast = [None] * self.family.num_buckets

    def nbytes(self):
        return _size([self.grad_buffer])


class _ShardAccumulator:
    """This rank's reduced gradient shard of every bucket, summed over synced backwards.

    zero() only marks the shards cleared: the first reduction into a cleared shard writes it (a memset and a read
    of every shard less per step, a visible share of a small model's step), and a reader of a shard that nothing
    wrote since gets zeros (shard())."""

    def __init__(self, family: ParamFamily, dtype: torch.dtype):
        device = family.device
        self.family = family
        self._shards = [torch.zeros(family.bucket_numel(b) // family.group_size, dtype=dtype, device=device)
                        for b in range(family.num_buckets)]
        self._cleared = [True] * family.num_buckets   # zeros, and nothing reduced into them yet

    def shard(self, bucket: int) -> torch.Tensor:
        if self._cleared[bucket]:
            self._shards[bucket].zero_()
            self._cleared[bucket] = False
        return self._shards[bucket]

    def reduce_into(self, bucket: int, source: torch.Tensor, group, scale: float, after=None, received=None,
                    sum_into=None):
        """Reduce-scatter `source` (a bucket, scratch) and add this rank's slice, times `scale`, to its shard;
        `after` runs once the slice was added (it may reuse `source` and `received`, the buffer that
        comm.reduce_scatter_in_place may receive into, and `sum_into`, where it may sum a narrower source)."""
        shard = self._shards[bucket]
        work, mine = comm.reduce_scatter_in_place(source, group, async_op=True, received=received,
                                                  sum_into=sum_into)

        def finish():
            if self._cleared[bucket]:   # scaled and cast in fp32 (or fp64), as add_ would onto zeros
                ops.flatten_into(shard, [mine], [0], scale)
                self._cleared[bucket] = False
            else:
                shard.add_(mine, alpha=scale)   # a wider shard dtype promotes in place
            if after is not None:
                after()
        return InFlight(work, finish)

    def add_local(self, bucket: int, fired: List[ZeroParam], scale: float) -> None:
        """A group of one (nothing to reduce): add the fired params' grads, scaled and cast, to the whole-bucket
        shard."""
        shard = self._shards[bucket]
        ops.flatten_into(shard, [zp.param.grad for zp in fired], [zp.slot.offset for zp in fired], scale,
                         accumulate=not self._cleared[bucket])
        if self._cleared[bucket]:
            _zero_uncovered(shard, fired)
            self._cleared[bucket] = False

    def untouched(self, bucket: int) -> bool:
        """Nothing was reduced into the bucket's shard since it was cleared."""
        return self._cleared[bucket]

    def zero(self):
        self._cleared = [True] * self.family.num_buckets

    def nbytes(self) -> int:
        return _size(self._shards)


def _zero_uncovered(target: torch.Tensor, fired: List[ZeroParam]) -> None:
    """Zero what the grads of `fired` did not write in a bucket-sized tensor (params that got none, alignment)."""
    covered = 0
    for lo, hi in sorted(zp.bucket_range((0, zp.slot.numel)) for zp in fired):
        if lo > covered:
            target[covered:lo].zero_()
        covered = hi
    target[covered:].zero_()


class ReduceScatterAtBoundary(_PersistentBuffer):
    """Stage 1: .grad shows the local accumulation under no_sync (as DDP) and is None once reduced."""

    def __init__(self, *args):
        super().__init__(*args)
        self.accumulator = _ShardAccumulator(self.family, self.master_dtype)

    def visible_grads(self, bucket, synced):
        return None if synced else self._views[bucket]

    def launch(self, bucket):
        region = self._staging_target(bucket)
        return self.accumulator.reduce_into(bucket, region, self.family.group, 1.0 / self.dp_size, after=region.zero_)

    def reduced_grad(self, bucket):
        return self.accumulator.shard(bucket)

    def forget_local(self, zp):
        super().forget_local(zp)
        return self.accumulator.untouched(zp.bucket)   # no synced backward reduced into it this step

    def zero(self):
        super().zero()
        self.accumulator.zero()

    def nbytes(self):
        return _size([self.grad_buffer]) + self.accumulator.nbytes()


class _Staging:
    """A temporary bucket buffer and, per bucket it served, the params' views into it (built once)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._views: Dict[int, List[torch.Tensor]] = {}

    def views(self, family: ParamFamily, bucket: int) -> List[torch.Tensor]:
        if bucket not in self._views:
            self._views[bucket] = [family.view_in_bucket(self.tensor, zp) for zp in family.buckets[bucket]]
        return self._views[bucket]


class ReduceScatterEveryBackward(GradStrategy):
    """Stages 2 and 3: per-rank gradient memory is the shard plus the buckets of one backward."""

    reduces_under_no_sync = True

    def __init__(self, *args):
        super().__init__(*args)
        fam = self.family
        self.accumulator = _ShardAccumulator(fam, self.master_dtype)
        self._live: List[Optional[_Staging]] = [None] * fam.num_buckets
        # reduced buffers are reused (a fresh one costs page faults every backward), at most two buckets'
        # worth, as DeepSpeed keeps two reduction buffers
        self._pool: Dict[int, List[_Staging]] = {}
        self._pool_limit = STAGING_POOL_BUCKETS * max(fam.bucket_numel(b) for b in range(fam.num_buckets))
        self._added_directly = [False] * fam.num_buckets   # this backward's grads already in the shard
        # the buffer's dtype: the params' own where the pieces are summed here in the reduction dtype (see the top)
        narrow = not self.in_place and fam.group_size > 1 and comm.receives_pieces(fam.group)
        self.staging_dtype = fam.dtype if narrow else self.reduce_dtype
        self._sum: Optional[torch.Tensor] = None   # where a narrow bucket's pieces are summed (one slice, reused)

    def _staging(self, bucket: int) -> _Staging:
        if self._live[bucket] is None:
            staging = self._take(self.family.bucket_numel(bucket))
            if self.in_place:   # autograd adds into the params' views of it (else stage() fills all of it)
                staging.tensor.zero_()
            self._live[bucket] = staging
        return self._live[bucket]

    def _take(self, numel: int) -> _Staging:
        pooled = self._pool.get(numel)
        return pooled.pop() if pooled else _Staging(torch.empty(numel, dtype=self.staging_dtype,
                                                                device=self.family.device))

    def _sum_buffer(self, numel: int) -> Optional[torch.Tensor]:
        """The reduction-dtype slice a narrow bucket is summed into (reductions finish one at a time), or None."""
        if self.staging_dtype == self.reduce_dtype:
            return None
        if self._sum is None:
            fam = self.family
            most = max(fam.bucket_numel(b) for b in range(fam.num_buckets)) // fam.group_size
            self._sum = torch.empty(most, dtype=self.reduce_dtype, device=fam.device)
        return self._sum[:numel // self.family.group_size]

    def accumulation_views(self, bucket):
        return self._staging(bucket).views(self.family, bucket) if self.in_place else None

    def stage(self, bucket, fired):
        if self.in_place:
            super().stage(bucket, fired)
            return
        if self.family.group_size == 1:   # nothing to reduce (experts at ep = dp): add them, cast, to the shard
            self.accumulator.add_local(bucket, fired, 1.0 / self.dp_size)
            self._added_directly[bucket] = True
            return
        grads, offsets = [zp.param.grad for zp in fired], [zp.slot.offset for zp in fired]
        # grads in another dtype are copied in, and nothing else writes the buffer in this backward (it was taken
        # unzeroed): copy the delivered ones and zero the rest (params that got none, alignment padding)
        target = self._staging_target(bucket)
        ops.flatten_into(target, grads, offsets)
        _zero_uncovered(target, fired)

    def _staging_target(self, bucket):
        return self._staging(bucket).tensor

    def launch(self, bucket):
        if self._added_directly[bucket]:
            self._added_directly[bucket] = False
            return InFlight(None, lambda: None)
        staging = self._staging(bucket)  # zeros when no gradient reached this rank's bucket
        self._live[bucket] = None
        # gloo receives every rank's pieces into a bucket-sized buffer: one from the same pool, so that a step
        # holds no more than before between backwards (at most STAGING_POOL_BUCKETS buckets, tested)
        received = self._take(staging.tensor.numel()) if comm.receives_pieces(self.family.group) else None

        def release():
            for buffer in (staging, received):
                if buffer is not None:
                    self._release(buffer)
        return self.accumulator.reduce_into(bucket, staging.tensor, self.family.group, 1.0 / self.dp_size,
                                            after=release, received=received and received.tensor,
                                            sum_into=self._sum_buffer(staging.tensor.numel()))

    def _release(self, staging: _Staging) -> None:
        pooled = sum(s.tensor.numel() for buffers in self._pool.values() for s in buffers)
        if pooled + staging.tensor.numel() <= self._pool_limit:
            self._pool.setdefault(staging.tensor.numel(), []).append(staging)

    def reduced_grad(self, bucket):
        return self.accumulator.shard(bucket)

    def zero(self):
        self.accumulator.zero()

    def nbytes(self):
        held = [s.tensor for s in self._live if s is not None]
        held += [s.tensor for buffers in self._pool.values() for s in buffers] + [self._sum]
        return self.accumulator.nbytes() + _size(held)

    def discard_pass(self):
        self._added_directly = [False] * self.family.num_buckets   # the shard is cleared next (clear_step)
        for bucket, staging in enumerate(self._live):
            if staging is not None:
                self._release(staging)
                self._live[bucket] = None


class NoGradients(GradStrategy):
    """A family of params frozen when the optimizer adopted them: nothing is accumulated or reduced;
    the optimizer holds their master and state over the same range a trainable family's would
    (the whole bucket at stage 0, the owned slice otherwise), and skips them while they are frozen."""

    def __init__(self, family: ParamFamily, reduce_dtype: torch.dtype, master_dtype: torch.dtype, dp_size: int,
                 whole_buckets: bool):
        super().__init__(family, reduce_dtype, master_dtype, dp_size)
        self.whole_buckets = whole_buckets

    def optimizer_range(self, bucket):
        return (0, self.family.bucket_numel(bucket)) if self.whole_buckets else self.family.owned[bucket]

    def _staging_target(self, bucket):
        raise RuntimeError("a frozen family accumulates no gradients")

    def launch(self, bucket):
        raise RuntimeError("a frozen family reduces no gradients")

    def reduced_grad(self, bucket):
        raise RuntimeError("a frozen family has no gradients")

    def zero(self):
        pass

    def nbytes(self):
        return 0

