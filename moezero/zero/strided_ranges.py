"""Strided ranges: the compact global coordinates of a tensor-parallel shard's optimizer pieces.

A `Span` (lo, hi, count, stride) is `count` runs of flat elements [lo + i * stride, hi + i * stride), i < count,
taken run by run (run-major); count 1 is the plain range [lo, hi). A shard split along dim d >= 1 of a global
tensor viewed as (A, B, C) (A: the dims before d, C: those after) holds, per block (b0, b1) of dim d, A runs of
(b1 - b0) * C elements at stride B * C: one Span, where a list of plain ranges needs one per row. A range of the
local shard's flat elements (a ZeRO piece) is then at most three spans per block: a partial head row, the whole
rows, a partial tail row (`shard_spans`).

Every conversion between spans and elements is vectorized (torch index arithmetic, or a strided view), never a
Python loop per run.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple, Union

import torch

Index = Union[slice, torch.Tensor]


class Span(NamedTuple):
    lo: int
    hi: int
    count: int = 1
    stride: int = 0

    @classmethod
    def of(cls, rng: Tuple[int, ...]) -> "Span":
        """A piece's "range": (lo, hi), or (lo, hi, count, stride)."""
        return cls(*rng) if len(rng) == 4 else cls(int(rng[0]), int(rng[1]))

    @classmethod
    def runs(cls, lo: int, width: int, count: int, stride: int) -> "Span":
        """`count` runs of `width` elements at `stride`, as a plain range where they touch (or count is 1)."""
        if count == 1 or stride == width:
            return cls(lo, lo + count * width)
        return cls(lo, lo + width, count, stride)

    @property
    def plain(self) -> bool:
        return self.count == 1

    @property
    def width(self) -> int:
        return self.hi - self.lo

    @property
    def numel(self) -> int:
        return self.count * self.width

    @property
    def end(self) -> int:
        """One past the last element."""
        return self.hi + (self.count - 1) * self.stride

    def as_range(self) -> Tuple[int, ...]:
        """The piece "range" form: (lo, hi) when plain."""
        return (self.lo, self.hi) if self.plain else tuple(self)

    def shifted(self, by: int) -> "Span":
        return self._replace(lo=self.lo + by, hi=self.hi + by)

    def key(self) -> str:
        """Its part of a checkpoint key: "lo-hi", or "lo-hixCOUNTsSTRIDE"."""
        return f"{self.lo}-{self.hi}" if self.plain else f"{self.lo}-{self.hi}x{self.count}s{self.stride}"

    def runs_within(self, a: int, b: int) -> Tuple[int, int]:
        """[first, last) of the runs that meet elements [a, b)."""
        if self.plain:
            return (0, 1) if self.lo < b and a < self.hi else (0, 0)
        first = max(0, (a - self.hi) // self.stride + 1)
        last = min(self.count, -(-(b - self.lo) // self.stride))
        return first, max(first, last)

    def indices(self, first: int = 0, last: Optional[int] = None) -> torch.Tensor:
        """The flat elements of runs [first, last), run-major (positions first * width on in the span)."""
        last = self.count if last is None else last
        starts = self.lo + torch.arange(first, last, dtype=torch.int64) * self.stride
        return (starts[:, None] + torch.arange(self.width, dtype=torch.int64)).reshape(-1)

    def locate(self, elements: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(which of `elements` the span holds, their positions in it)."""
        offset = elements - self.lo
        if self.plain:
            return (offset >= 0) & (offset < self.width), offset
        run = torch.div(offset, self.stride, rounding_mode="floor")
        within = offset - run * self.stride
        return (offset >= 0) & (run < self.count) & (within < self.width), run * self.width + within


def overlap(source: Span, target: Span) -> Optional[Tuple[Index, Index]]:
    """(positions in `target`, positions in `source`) of the elements both hold, in matching order; None when
    they share none. Plain pairs are slices; otherwise index tensors over the smaller side's runs that meet the
    other's bounds."""
    a, b = max(source.lo, target.lo), min(source.end, target.end)
    if a >= b:
        return None
    if source.plain and target.plain:
        return slice(a - target.lo, b - target.lo), slice(a - source.lo, b - source.lo)
    t_first, t_last = target.runs_within(a, b)
    s_first, s_last = source.runs_within(a, b)
    if (t_last - t_first) * target.width <= (s_last - s_first) * source.width:
        held, at = source.locate(target.indices(t_first, t_last))
        mine = torch.arange(t_first * target.width, t_last * target.width, dtype=torch.int64)
        out = (mine[held], at[held])
    else:
        held, at = target.locate(source.indices(s_first, s_last))
        theirs = torch.arange(s_first * source.width, s_last * source.width, dtype=torch.int64)
        out = (at[held], theirs[held])
    return out if out[0].numel() else None


def intersects(a: Span, b: Span) -> bool:
    """Whether two spans share an element (runs at one stride, as a tensor's rows, answer without indices)."""
    if a.lo >= b.end or b.lo >= a.end:
        return False
    if a.plain or b.plain:  # some run of the strided one meets the plain range (a load's selection of keys)
        plain, other = (a, b) if a.plain else (b, a)
        first, last = other.runs_within(plain.lo, plain.hi)
        return first < last
    if not a.plain and not b.plain and a.stride == b.stride:  # columns of one row length that do not meet
        (p, q), (r, s) = [(x.lo % x.stride, x.lo % x.stride + x.width) for x in (a, b)]
        if q <= a.stride and s <= a.stride and not (p < s and r < q):
            return False
    return overlap(a, b) is not None


def strided_view(flat: torch.Tensor, span: Span) -> torch.Tensor:
    """A (count, width) view of the elements `span` addresses in the 1-D tensor `flat` (writes go through)."""
    step = flat.stride(0)
    return flat.as_strided((span.count, span.width), (span.stride * step, step), flat.storage_offset() + span.lo * step)


def shard_spans(
    global_shape: Tuple[int, ...], dim: int, blocks: Tuple[Tuple[int, int], ...], lo: int, hi: int
) -> List[Tuple[Span, Span]]:
    """(local span, global span) pairs covering the local flat elements [lo, hi) of a tensor-parallel shard (see
    TensorShard): the local span addresses the shard's contiguous flat elements, the global one where they sit in
    the global tensor, run for run. At most three pairs per block."""
    inner = math.prod(global_shape[dim + 1 :])
    widths = [(b1 - b0) * inner for b0, b1 in blocks]
    local_row, global_row = sum(widths), global_shape[dim] * inner
    offsets = [sum(widths[:k]) for k in range(len(blocks))]
    if lo >= hi:
        return []
    first, last = lo // local_row, (hi - 1) // local_row  # the rows [lo, hi) touches
    whole_first = first if lo == first * local_row else first + 1
    whole_last = last + 1 if hi == (last + 1) * local_row else last
    pairs: List[Tuple[Span, Span]] = []

    def partial_row(row: int) -> None:
        for (b0, _), width, offset in zip(blocks, widths, offsets):
            start = max(lo, row * local_row + offset)
            stop = min(hi, row * local_row + offset + width)
            if start < stop:
                shift = row * global_row + b0 * inner - (row * local_row + offset)
                pairs.append((Span(start, stop), Span(start + shift, stop + shift)))

    if whole_first > first or whole_last <= first:
        partial_row(first)
    if whole_last > whole_first:
        count = whole_last - whole_first
        for (b0, _), width, offset in zip(blocks, widths, offsets):
            local = Span.runs(whole_first * local_row + offset, width, count, local_row)
            pairs.append((local, Span.runs(whole_first * global_row + b0 * inner, width, count, global_row)))
    if last > first and whole_last <= last:
        partial_row(last)
    return _merged(pairs)


def _merged(pairs: List[Tuple[Span, Span]]) -> List[Tuple[Span, Span]]:
    """Plain pairs that continue the previous one both locally and globally, joined."""
    out: List[Tuple[Span, Span]] = []
    for local, glob in pairs:
        if out and local.plain and glob.plain and out[-1][0].plain and out[-1][1].plain:
            prev_local, prev_glob = out[-1]
            if prev_local.hi == local.lo and prev_glob.hi == glob.lo:
                out[-1] = (Span(prev_local.lo, local.hi), Span(prev_glob.lo, glob.hi))
                continue
        out.append((local, glob))
    return out
