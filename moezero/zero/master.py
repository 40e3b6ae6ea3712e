"""This rank's master weights: an fp32 copy of its slice of every bucket, and per-param views of it.

The inner torch optimizer runs on the views (one leaf tensor per param piece), so its per-param
semantics stay torch's: a view whose param got no gradient on any rank gets `grad = None` and is
skipped. When a family's params are already in the master dtype, the master *is* the param
buffer's slice (no copy, no write-back).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from moezero.parallel import comm
from moezero.zero.buckets import ParamFamily
from moezero.zero.stages import StageStrategy


@dataclass
class ShardView:
    """One param's piece of this rank's optimizer range."""

    family: int
    index: int                     # param index in the family
    bucket: int
    param_range: Tuple[int, int]   # elements of the param's flat storage
    offset: int                    # where the piece starts in the bucket's optimizer range
    master: torch.Tensor           # the leaf tensor the inner optimizer updates


class MasterShards:
    def __init__(self, families: Sequence[ParamFamily], strategies: Sequence[StageStrategy],
                 master_dtype: torch.dtype):
        self.families = list(families)
        self.strategies = list(strategies)
        self.masters: List[List[torch.Tensor]] = []   # [family][bucket] -> flat master over the optimizer range
        self.aliased: List[bool] = []
        self.views: List[ShardView] = []
        for f, (family, strategy) in enumerate(zip(families, strategies)):
            self.aliased.append(family.dtype == master_dtype)
            masters = []
            for b in range(len(family.buckets)):
                lo, hi = strategy.optimizer_range(b)
                region = family.bucket_region(family.buffer, b)[lo:hi]
                master = region if self.aliased[f] else region.detach().to(master_dtype)
                masters.append(master)
                for index, param_range, offset in family.pieces(b, (lo, hi)):
                    n = param_range[1] - param_range[0]
                    self.views.append(ShardView(f, index, b, param_range, offset, master[offset:offset + n]))
            self.masters.append(masters)

    def assign_grads(self, reduced: List[List[torch.Tensor]], took_grad: List[List[bool]]) -> None:
        """Point each view's .grad at its slice of the reduced bucket gradient (None: skip the param)."""
        for v in self.views:
            if took_grad[v.family][v.index]:
                n = v.param_range[1] - v.param_range[0]
                v.master.grad = reduced[v.family][v.bucket][v.offset:v.offset + n]
            else:
                v.master.grad = None

    def clear_grads(self) -> None:
        for v in self.views:
            v.master.grad = None

    def publish(self) -> None:
        """Write the updated masters into the params (cast) and all-gather sharded buckets."""
        works = []
        for f, (family, strategy) in enumerate(zip(self.families, self.strategies)):
            for b in range(len(family.buckets)):
                lo, hi = strategy.optimizer_range(b)
                region = family.bucket_region(family.buffer, b)
                if not self.aliased[f]:
                    region[lo:hi].copy_(self.masters[f][b])
                if hi - lo < region.numel():  # sharded: collect every rank's slice (in place, as NCCL and
                    works.append(comm.all_gather(region, region[lo:hi], family.group, async_op=True))  # gloo allow)
        for work in works:
            if work is not None:
                work.wait()
