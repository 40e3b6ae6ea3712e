"""A tensor-parallel shard's elements read from the Hub files exactly (--load-hf at tp > 1).

A ZeRO reader asks a deferred param for its local flat elements [lo, hi). For a tensor-parallel shard (a
TensorShard: rows of a column-parallel or vocabulary-parallel weight, columns of a row-parallel one) those lie in
the global tensor as a few strided spans (zero's `shard_spans`: at most three per block). Each span is read as
boxes of the global tensor viewed as (rows, row length) — a partial first row, whole rows, a partial last row, or
for a row-parallel weight the columns of its block in consecutive rows — sliced out of the safetensors files (a
fused weight's rows across its Hub tensors), so a rank reads only the elements it keeps, never a whole tensor nor
whole rows of a row-parallel weight.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from moezero.hf.keys import Link
from moezero.parallel.tensor_marker import TensorShard
from moezero.zero import Span, shard_spans


def read_shard_range(link: Link, hub, shard: TensorShard, lo: int, hi: int) -> torch.Tensor:
    """The shard's local flat elements [lo, hi) (1-D), read from the Hub tensors `link` names."""
    out = None
    for local, glob in shard_spans(shard.global_shape, shard.dim, shard.blocks, lo, hi):
        values = read_span(link, hub, shard.global_shape, glob)
        if out is None:
            out = torch.empty(hi - lo, dtype=values.dtype)
        if local.plain:
            out[local.lo - lo : local.hi - lo] = values
        else:  # the runs of a strided local span, run-major as the global one's values
            view = out.as_strided((local.count, local.width), (local.stride, 1), local.lo - lo)
            view.copy_(values.view(local.count, local.width))
    return out if out is not None else torch.empty(0)


def read_span(link: Link, hub, shape: Tuple[int, ...], span: Span) -> torch.Tensor:
    """The elements of `span` (run-major, 1-D) of the global tensor of `shape` the Hub tensors of `link` make."""
    row = math.prod(shape[1:])
    if not span.plain:  # runs in consecutive rows, each within one row: one box
        first, col = divmod(span.lo, row)
        if span.stride != row or col + span.width > row:
            raise ValueError(f"a span {tuple(span)} of a tensor shaped {shape} is not a box of its rows")
        return link.read_box(hub, first, first + span.count, col, col + span.width).reshape(-1)
    (first, head), (last, tail) = divmod(span.lo, row), divmod(span.hi, row)
    if first == last:
        return link.read_box(hub, first, first + 1, head, tail).reshape(-1)
    boxes = []
    if head:  # the first row's end
        boxes.append(link.read_box(hub, first, first + 1, head, row))
        first += 1
    if last > first:  # whole rows
        boxes.append(link.read_box(hub, first, last, 0, row))
    if tail:  # the last row's start
        boxes.append(link.read_box(hub, last, last + 1, 0, tail))
    return torch.cat([box.reshape(-1) for box in boxes])
