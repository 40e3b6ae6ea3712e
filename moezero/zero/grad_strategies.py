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

Each strategy keeps its per-bucket state in the family's `Bucket` records (`bucket.py`), one per bucket.
Buffers are reused on the guarantee of reducer.py's NOTE [no accumulation into a reducing bucket].
"""

from __future__ import annotations

import abc
from typing import Dict, List, Optional

import torch

from moezero import ops
from moezero.parallel import comm
from moezero.zero.bucket import Bucket, StagingBuffer, zero_uncovered
from moezero.zero.zero_param import ParamFamily, Range, ZeroParam

STAGING_POOL_BUCKETS = 2  # stages 2/3 keep at most this many largest-bucket staging buffers for reuse


class GradStrategy(abc.ABC):
    """Shared state: the family, its buckets, the dtypes and the dp size the average divides by."""

    reduces_under_no_sync = False  # stages 2/3 reduce every backward; no_sync does not defer them
    holds_local = False  # stages 0/1: a persistent buffer holds what a user's clear may drop

    def __init__(self, family: ParamFamily, reduce_dtype: torch.dtype, master_dtype: torch.dtype, dp_size: int):
        self.family = family
        self.reduce_dtype = reduce_dtype
        self.master_dtype = master_dtype
        self.dp_size = dp_size
        self.in_place = family.dtype == reduce_dtype  # .grad can be a view of the reduction buffer
        self.buckets = [Bucket(family, index, self) for index in range(family.num_buckets)]

    def optimizer_range(self, index: int) -> Range:
        """The part of bucket `index` whose master weights and optimizer state this rank holds."""
        return self.family.owned[index]

    def accumulation_views(self, bucket: Bucket) -> Optional[List[torch.Tensor]]:
        """Views for the .grad of the bucket's params (bucket order), or None: grads are copied in."""
        return None

    def before_accumulate(self, bucket: Bucket) -> None:
        """Called once per backward per bucket, before any gradient is added into it."""

    def adopt_assigned(self, bucket: Bucket, view: torch.Tensor, grad: torch.Tensor) -> None:
        """A gradient the user assigned to `.grad` since the last backward: the backward adds on top of it."""
        view.copy_(grad)

    def visible_grads(self, bucket: Bucket, synced: bool) -> Optional[List[torch.Tensor]]:
        """What the params' .grad point to once the bucket is staged (None: .grad is None)."""
        return None

    def assigned_scale(self, bucket: Bucket) -> float:
        """What a gradient assigned by hand is multiplied by before the sum over the group (assigned_grads.py)."""
        return 1.0

    def stage(self, bucket: Bucket, fired: List[ZeroParam]) -> None:
        """Every param of the bucket delivered (or was zero-filled): bring the grads of `fired` into the bucket."""
        target = self._staging_target(bucket)
        base, size = target.data_ptr(), target.numel() * target.element_size()
        foreign = [zp for zp in fired if not base <= zp.param.grad.data_ptr() < base + size]
        if foreign:
            ops.flatten_into(
                target, [zp.param.grad for zp in foreign], [zp.slot.offset for zp in foreign], accumulate=True
            )

    @abc.abstractmethod
    def _staging_target(self, bucket: Bucket) -> torch.Tensor:
        """The bucket-sized tensor gradients accumulate in."""

    @abc.abstractmethod
    def launch(self, bucket: Bucket) -> None:
        """Start the bucket's reduction (async): `bucket.launched(work, finish)`."""

    @abc.abstractmethod
    def reduced_grad(self, bucket: Bucket) -> torch.Tensor:
        """Averaged gradient over the bucket's optimizer range, in the master dtype."""

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

    def _allocate_shards(self) -> None:
        """Stages 1-3: each bucket's reduced slice, summed over the step's synced backwards (cleared: zeros)."""
        for bucket in self.buckets:
            bucket.shard = torch.zeros(
                bucket.numel // self.family.group_size, dtype=self.master_dtype, device=self.family.device
            )

    def _clear_shards(self) -> None:
        for bucket in self.buckets:
            bucket.cleared = True

    def _reduce_into_shard(
        self, bucket: Bucket, source: torch.Tensor, after=None, received=None, sum_into=None
    ) -> None:
        """Launch: reduce-scatter `source` (the bucket's gradients, scratch) and add this rank's slice, divided by
        the dp size, to the bucket's shard; `after` runs once the slice was added (it may reuse `source` and
        `received`, the buffer that comm.reduce_scatter_in_place may receive into, and `sum_into`, where it may sum
        a narrower source)."""
        work, mine = comm.reduce_scatter_in_place(
            source, self.family.group, async_op=True, received=received, sum_into=sum_into
        )

        def finish():
            bucket.add_to_shard(mine, 1.0 / self.dp_size)
            if after is not None:
                after()

        bucket.launched(work, finish)


def _size(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _PersistentBuffer(GradStrategy):
    """Stages 0 and 1: gradients accumulate in a persistent family-sized buffer."""

    holds_local = True

    def __init__(self, *args):
        super().__init__(*args)
        fam = self.family
        self.grad_buffer = torch.zeros(fam.layout.total_numel, dtype=self.reduce_dtype, device=fam.device)
        for bucket in self.buckets if self.in_place else ():
            bucket.views = [fam.param_view(self.grad_buffer, zp) for zp in bucket.members]

    def accumulation_views(self, bucket):
        return bucket.views

    def _staging_target(self, bucket):
        return self.family.bucket_region(self.grad_buffer, bucket.index)

    def forget_local(self, zp):
        self.family.param_view(self.grad_buffer, zp).zero_()  # stage 0: the average it showed; 1: local sums
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

    def optimizer_range(self, index):
        return 0, self.family.bucket_numel(index)

    def before_accumulate(self, bucket):
        bucket.cast = None
        bucket.rescaled = False
        if bucket.holds_average:
            if self._rescale != 1.0:
                self._staging_target(bucket).mul_(self._rescale)
                bucket.rescaled = True
            bucket.holds_average = False

    def adopt_assigned(self, bucket, view, grad):
        """An assigned gradient replaces an average .grad showed: scaled as that average was (dp / g)."""
        view.copy_(grad)
        if bucket.rescaled:
            view.mul_(self._rescale)

    def visible_grads(self, bucket, synced):
        return bucket.views

    def assigned_scale(self, bucket):
        """Assigned where .grad showed the average: an average too (see adopt_assigned)."""
        return self._rescale if bucket.holds_average else 1.0

    def forget_local(self, zp):
        super().forget_local(zp)
        self.buckets[zp.bucket].cast = None
        return True  # nothing of it lives elsewhere

    def launch(self, bucket):
        region = self._staging_target(bucket)
        work = comm.all_reduce(region, self.family.group, async_op=True)

        def finish():
            region.mul_(1.0 / self.dp_size)
            bucket.holds_average = True
            bucket.cast = None

        bucket.launched(work, finish)

    def reduced_grad(self, bucket):
        region = self._staging_target(bucket)
        if region.dtype == self.master_dtype:
            return region
        # reduced in another dtype: one master-dtype copy per reduction, so that clip_grad_norm_() and the step
        # that follows scale and read the same tensor
        if bucket.cast is None:
            bucket.cast = region.to(self.master_dtype)
        return bucket.cast

    def zero(self):
        super().zero()
        for bucket in self.buckets:
            bucket.holds_average = False
            bucket.cast = None

    def nbytes(self):
        return _size([self.grad_buffer])


class ReduceScatterAtBoundary(_PersistentBuffer):
    """Stage 1: .grad shows the local accumulation under no_sync (as DDP) and is None once reduced."""

    def __init__(self, *args):
        super().__init__(*args)
        self._allocate_shards()

    def visible_grads(self, bucket, synced):
        return None if synced else bucket.views

    def launch(self, bucket):
        region = self._staging_target(bucket)
        self._reduce_into_shard(bucket, region, after=region.zero_)

    def reduced_grad(self, bucket):
        return bucket.read_shard()

    def forget_local(self, zp):
        super().forget_local(zp)
        return self.buckets[zp.bucket].cleared  # no synced backward reduced into it this step

    def zero(self):
        super().zero()
        self._clear_shards()

    def nbytes(self):
        return _size([self.grad_buffer]) + _size(b.shard for b in self.buckets)


class ReduceScatterEveryBackward(GradStrategy):
    """Stages 2 and 3: per-rank gradient memory is the shard plus the buckets of one backward."""

    reduces_under_no_sync = True

    def __init__(self, *args):
        super().__init__(*args)
        fam = self.family
        self._allocate_shards()
        # reduced buffers are reused (a fresh one costs page faults every backward), at most two buckets'
        # worth, as DeepSpeed keeps two reduction buffers
        self._pool: Dict[int, List[StagingBuffer]] = {}
        self._pool_limit = STAGING_POOL_BUCKETS * max(bucket.numel for bucket in self.buckets)
        # the buffer's dtype: the params' own where the pieces are summed here in the reduction dtype (see the top)
        narrow = not self.in_place and fam.group_size > 1 and comm.receives_pieces(fam.group)
        self.staging_dtype = fam.dtype if narrow else self.reduce_dtype
        self._sum: Optional[torch.Tensor] = None  # where a narrow bucket's pieces are summed (one slice, reused)

    def _staging(self, bucket: Bucket) -> StagingBuffer:
        if bucket.staging is None:
            staging = self._take(bucket.numel)
            if self.in_place:  # autograd adds into the params' views of it (else stage() fills all of it)
                staging.tensor.zero_()
            bucket.staging = staging
        return bucket.staging

    def _take(self, numel: int) -> StagingBuffer:
        pooled = self._pool.get(numel)
        return (
            pooled.pop()
            if pooled
            else StagingBuffer(torch.empty(numel, dtype=self.staging_dtype, device=self.family.device))
        )

    def _sum_buffer(self, numel: int) -> Optional[torch.Tensor]:
        """The reduction-dtype slice a narrow bucket is summed into (reductions finish one at a time), or None."""
        if self.staging_dtype == self.reduce_dtype:
            return None
        if self._sum is None:
            most = max(bucket.numel for bucket in self.buckets) // self.family.group_size
            self._sum = torch.empty(most, dtype=self.reduce_dtype, device=self.family.device)
        return self._sum[: numel // self.family.group_size]

    def accumulation_views(self, bucket):
        return self._staging(bucket).views(bucket) if self.in_place else None

    def stage(self, bucket, fired):
        if self.in_place:
            super().stage(bucket, fired)
            return
        if self.family.group_size == 1:  # nothing to reduce (experts at ep = dp): add them, cast, to the shard
            bucket.add_local(fired, 1.0 / self.dp_size)
            bucket.added_directly = True
            return
        grads, offsets = [zp.param.grad for zp in fired], [zp.slot.offset for zp in fired]
        # grads in another dtype are copied in, and nothing else writes the buffer in this backward (it was taken
        # unzeroed): copy the delivered ones and zero the rest (params that got none, alignment padding)
        target = self._staging_target(bucket)
        ops.flatten_into(target, grads, offsets)
        zero_uncovered(target, fired)

    def _staging_target(self, bucket):
        return self._staging(bucket).tensor

    def launch(self, bucket):
        if bucket.added_directly:
            bucket.added_directly = False
            bucket.launched(None, lambda: None)
            return
        staging = self._staging(bucket)  # zeros when no gradient reached this rank's bucket
        bucket.staging = None
        # gloo receives every rank's pieces into a bucket-sized buffer: one from the same pool, so that a step
        # holds no more than before between backwards (at most STAGING_POOL_BUCKETS buckets, tested)
        received = self._take(staging.tensor.numel()) if comm.receives_pieces(self.family.group) else None

        def release():
            for buffer in (staging, received):
                if buffer is not None:
                    self._release(buffer)

        self._reduce_into_shard(
            bucket,
            staging.tensor,
            after=release,
            received=received and received.tensor,
            sum_into=self._sum_buffer(staging.tensor.numel()),
        )

    def _release(self, staging: StagingBuffer) -> None:
        pooled = sum(s.tensor.numel() for buffers in self._pool.values() for s in buffers)
        if pooled + staging.tensor.numel() <= self._pool_limit:
            self._pool.setdefault(staging.tensor.numel(), []).append(staging)

    def pooled_buffers(self) -> List[torch.Tensor]:
        """The staging buffers kept for reuse (none is a bucket's now)."""
        return [s.tensor for buffers in self._pool.values() for s in buffers]

    def reduced_grad(self, bucket):
        return bucket.read_shard()

    def zero(self):
        self._clear_shards()

    def nbytes(self):
        held = [b.staging.tensor for b in self.buckets if b.staging is not None]
        held += self.pooled_buffers() + [self._sum]
        return _size(b.shard for b in self.buckets) + _size(held)

    def discard_pass(self):
        for bucket in self.buckets:
            bucket.added_directly = False  # the shard is cleared next (clear_step)
            if bucket.staging is not None:
                self._release(bucket.staging)
                bucket.staging = None


class NoGradients(GradStrategy):
    """A family of params frozen when the optimizer adopted them: nothing is accumulated or reduced;
    the optimizer holds their master and state over the same range a trainable family's would
    (the whole bucket at stage 0, the owned slice otherwise), and skips them while they are frozen."""

    def __init__(
        self,
        family: ParamFamily,
        reduce_dtype: torch.dtype,
        master_dtype: torch.dtype,
        dp_size: int,
        whole_buckets: bool,
    ):
        super().__init__(family, reduce_dtype, master_dtype, dp_size)
        self.whole_buckets = whole_buckets

    def optimizer_range(self, index):
        return (0, self.family.bucket_numel(index)) if self.whole_buckets else self.family.owned[index]

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
