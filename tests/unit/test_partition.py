"""The flat-buffer arithmetic of `moezero/zero/partition.py` on its own (the gloo worlds check it only through
training): param slots, bucket boundaries, padding, shard ranges and the pieces of a param in each shard."""

import random

import pytest

from moezero.zero.partition import ParamSlot, plan_buckets, shard_overlap


def test_a_worked_layout():
    # sizes 10, 20, 5, 40, buckets of 32 elements, 2 ranks, 16-element alignment. After the 10 the bucket has
    # used 16 aligned elements; 16 + 20 > 32, so the 20 opens bucket 1
    layout = plan_buckets([10, 20, 5, 40], bucket_size=32, group_size=2, align=16)
    assert layout.slots == (ParamSlot(0, 0, 10), ParamSlot(1, 0, 20), ParamSlot(2, 0, 5), ParamSlot(3, 0, 40))
    # bucket 1 has used 32 after the 20; 32 + 5 > 32, so the 5 opens bucket 2; the 40 (> 32) gets its own
    assert [(b.start, b.numel, b.params) for b in layout.buckets] == [
        (0, 32, (0,)),
        (32, 32, (1,)),
        (64, 32, (2,)),
        (96, 64, (3,)),
    ]
    assert layout.total_numel == 160
    assert layout.buckets[3].shard_range(1, 2) == (32, 64)


def test_params_share_a_bucket_while_they_fit():
    layout = plan_buckets([16, 16, 16, 8], bucket_size=48, group_size=4, align=4)
    assert [s.bucket for s in layout.slots] == [0, 0, 0, 1]
    assert [s.offset for s in layout.slots] == [0, 16, 32, 0]
    assert [b.numel for b in layout.buckets] == [48, 16]  # multiples of group_size * align = 16


def test_breaks_start_a_bucket_even_when_the_param_would_fit():
    layout = plan_buckets([4, 4, 4, 4], bucket_size=1000, group_size=1, align=1, breaks={2})
    assert [s.bucket for s in layout.slots] == [0, 0, 1, 1]
    assert plan_buckets([4, 4], bucket_size=1000, group_size=1, align=1, breaks={0}).buckets[0].params == (0, 1)


def test_an_empty_param_list_and_zero_sized_params():
    assert plan_buckets([], bucket_size=8, group_size=2).buckets == ()
    layout = plan_buckets([0, 3, 0], bucket_size=8, group_size=2, align=4)
    assert layout.buckets[0].numel == 8 and [s.numel for s in layout.slots] == [0, 3, 0]


@pytest.mark.parametrize("bad", [dict(bucket_size=0), dict(group_size=0), dict(align=0)])
def test_bad_sizes_are_one_clear_error(bad):
    kwargs = {**dict(bucket_size=8, group_size=2, align=4), **bad}
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        plan_buckets([3], **kwargs)


def _random_case(rng):
    numels = [rng.choice([0, 1, 3, 7, 16, 100, 1000, 4099]) for _ in range(rng.randint(1, 25))]
    breaks = {i for i in range(len(numels)) if rng.random() < 0.15}
    return numels, rng.choice([1, 50, 512, 5000]), rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 4, 16]), breaks


@pytest.mark.parametrize("seed", range(40))
def test_invariants_of_random_layouts(seed):
    numels, bucket_size, group_size, align, breaks = _random_case(random.Random(seed))
    layout = plan_buckets(numels, bucket_size, group_size, align, breaks)
    assert len(layout.slots) == len(numels)
    start = 0
    for b, bucket in enumerate(layout.buckets):
        assert bucket.index == b and bucket.start == start  # buckets follow each other with no gap
        assert bucket.numel % (group_size * align) == 0 and bucket.numel > 0
        assert list(bucket.params) == sorted(bucket.params)
        start += bucket.numel
        slots = [layout.slots[i] for i in bucket.params]
        for i, slot in zip(bucket.params, slots):
            assert slot.bucket == b and slot.numel == numels[i]
            assert slot.offset % align == 0 and slot.offset + slot.numel <= bucket.numel
        for first, second in zip(slots, slots[1:]):  # in order, never overlapping
            assert first.offset + first.numel <= second.offset
        if len(slots) > 1:  # a bucket of several params stays within bucket_size (aligned sizes)
            last = slots[-1]
            assert last.offset + last.numel <= bucket_size
        lo, hi = zip(*(bucket.shard_range(r, group_size) for r in range(group_size)))
        assert lo[0] == 0 and hi[-1] == bucket.numel and list(lo[1:]) == list(hi[:-1])  # equal, tiling shards
        assert all((h - l) % align == 0 for l, h in zip(lo, hi))
    assert layout.total_numel == start
    order = [i for bucket in layout.buckets for i in bucket.params]
    assert order == list(range(len(numels)))  # layout order is the given order
    for i in breaks:  # a break opens a bucket unless the param is the first
        if i > 0:
            assert layout.slots[i].bucket == layout.slots[i - 1].bucket + 1


@pytest.mark.parametrize("seed", range(40))
def test_each_element_of_a_param_is_in_exactly_one_shard(seed):
    numels, bucket_size, group_size, align, breaks = _random_case(random.Random(1000 + seed))
    layout = plan_buckets(numels, bucket_size, group_size, align, breaks)
    for slot in layout.slots:
        bucket = layout.buckets[slot.bucket]
        pieces = [shard_overlap(slot, bucket.shard_range(r, group_size)) for r in range(group_size)]
        covered = sorted(p for p in pieces if p is not None)
        assert sum(hi - lo for lo, hi in covered) == slot.numel
        position = 0
        for lo, hi in covered:  # consecutive ranks hold consecutive pieces
            assert lo == position and hi > lo
            position = hi


def test_shard_overlap_at_the_edges():
    slot = ParamSlot(0, offset=16, numel=8)
    assert shard_overlap(slot, (0, 16)) is None  # ends where the param starts
    assert shard_overlap(slot, (24, 32)) is None  # starts where the param ends
    assert shard_overlap(slot, (20, 32)) == (4, 8)
    assert shard_overlap(slot, (0, 18)) == (0, 2)
    assert shard_overlap(slot, (0, 64)) == (0, 8)
