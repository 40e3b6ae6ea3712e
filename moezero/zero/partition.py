"""Pure arithmetic of the flat buffers: where each param sits, bucket boundaries, shard ranges.

Params are laid out in the order given (the optimizer passes reverse registration order,
roughly the order gradients arrive in backward). A bucket collects whole params until adding
the next would pass `bucket_size` elements (a param larger than that gets a bucket of its own).
Each param starts on an `align`-element boundary (aligned storage for vectorised and grouped
GEMM kernels), and each bucket is padded to a multiple of `group_size * align` elements so it
splits into equal, aligned shards: rank r owns elements [r * n / g, (r + 1) * n / g) of every
bucket. The layout depends only on the params' sizes, never on the order hooks fire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, List, Optional, Sequence, Tuple


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class ParamSlot:
    """One param's place: bucket index, offset inside the bucket, element count."""

    bucket: int
    offset: int
    numel: int


@dataclass(frozen=True)
class BucketLayout:
    index: int
    start: int  # first element of the bucket in the family's flat buffer
    numel: int  # padded size, a multiple of group_size * align
    params: Tuple[int, ...]  # indices (into the layout's param order) of the params it holds

    def shard_range(self, rank: int, group_size: int) -> Tuple[int, int]:
        """Element range [lo, hi) of the bucket that `rank` owns."""
        size = self.numel // group_size
        return rank * size, (rank + 1) * size


@dataclass(frozen=True)
class FlatLayout:
    slots: Tuple[ParamSlot, ...]
    buckets: Tuple[BucketLayout, ...]
    group_size: int

    @property
    def total_numel(self) -> int:
        return sum(b.numel for b in self.buckets)


def plan_buckets(
    numels: Sequence[int], bucket_size: int, group_size: int, align: int = 16, breaks: Collection[int] = ()
) -> FlatLayout:
    """Assign params (given in layout order) to aligned offsets in padded buckets.

    A param whose index is in `breaks` starts a new bucket (stage 3: a bucket never spans two
    gather units, so a unit is gathered as whole buckets).
    """
    if bucket_size < 1 or group_size < 1 or align < 1:
        raise ValueError(f"bucket_size ({bucket_size}), group_size ({group_size}) and align ({align}) must be >= 1")
    slots: List[ParamSlot] = []
    buckets: List[BucketLayout] = []
    members: List[int] = []
    used = 0  # aligned elements used in the open bucket
    start = 0

    def close_bucket():
        nonlocal used, start, members
        padded = _round_up(max(used, 1), group_size * align)
        buckets.append(BucketLayout(len(buckets), start, padded, tuple(members)))
        start += padded
        used, members = 0, []

    for index, numel in enumerate(numels):
        if members and (used + numel > bucket_size or index in breaks):
            close_bucket()
        slots.append(ParamSlot(len(buckets), used, numel))
        members.append(index)
        used = _round_up(used + numel, align)
    if members:
        close_bucket()
    return FlatLayout(tuple(slots), tuple(buckets), group_size)


def shard_overlap(slot: ParamSlot, shard: Tuple[int, int]) -> Optional[Tuple[int, int]]:
    """The part of a param inside a shard, as a range of the param's own flat elements."""
    lo = max(slot.offset, shard[0])
    hi = min(slot.offset + slot.numel, shard[1])
    if lo >= hi:
        return None
    return lo - slot.offset, hi - slot.offset
