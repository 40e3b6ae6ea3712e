"""This rank's master weights: a copy (fp32 or wider) of its optimizer range of every bucket, and
per-param views of it.

The inner torch optimizer runs on the views (one leaf tensor per param piece), so its per-param
semantics stay torch's: a view whose param got no gradient on any rank gets `grad = None` and is
skipped. When a family's params are already in the master dtype, the master *is* the param
storage (no copy, no write-back). Each family has its own master dtype: the wider of its param
dtype and fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from moezero.zero.families import ParamFamily, Range
from moezero.zero.grad_strategies import GradStrategy
from moezero.zero.param_storage import ParamStorage


def master_dtype_of(param_dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(param_dtype, torch.float32)


@dataclass
class ShardView:
    """One param's piece of this rank's optimizer range of one bucket."""

    family: int
    index: int                     # param index in the family
    bucket: int
    param_range: Range             # elements of the param's flat storage
    offset: int                    # where the piece starts in the bucket's optimizer range
    master: torch.Tensor           # the leaf tensor the inner optimizer updates

    @property
    def numel(self) -> int:
        return self.param_range[1] - self.param_range[0]


class MasterShards:
    def __init__(self, families: Sequence[ParamFamily], storages: Sequence[ParamStorage],
                 strategies: Sequence[GradStrategy]):
        self.families, self.storages, self.strategies = list(families), list(storages), list(strategies)
        self.masters: List[List[torch.Tensor]] = []   # [family][bucket] -> flat master over the optimizer range
        self.aliased: List[bool] = []
        self.views: List[ShardView] = []
        for f, (family, storage, strategy) in enumerate(zip(families, storages, strategies)):
            dtype = master_dtype_of(family.dtype)
            self.aliased.append(family.dtype == dtype)
            masters = []
            for b in range(family.num_buckets):
                span = strategy.optimizer_range(b)
                values = storage.values(b, span)
                master = values if self.aliased[f] else values.detach().to(dtype)
                masters.append(master)
                for index, param_range, offset in family.pieces(b, span):
                    n = param_range[1] - param_range[0]
                    self.views.append(ShardView(f, index, b, param_range, offset, master[offset:offset + n]))
            self.masters.append(masters)

    def assign_grads(self, reduced: List[List[torch.Tensor]], took_grad: List[List[bool]]) -> None:
        """Point each view's .grad at its slice of the reduced bucket gradient (None: skip the param)."""
        for v in self.views:
            if took_grad[v.family][v.index]:
                v.master.grad = reduced[v.family][v.bucket][v.offset:v.offset + v.numel]
            else:
                v.master.grad = None

    def clear_grads(self) -> None:
        for v in self.views:
            v.master.grad = None

    def publish(self, trainable_only: bool = False) -> None:
        """Write the updated masters into the param storage (cast) and let every replica see them
        (`trainable_only`: after a step, which never changes a frozen family)."""
        for f, (family, storage, strategy) in enumerate(zip(self.families, self.storages, self.strategies)):
            if trainable_only and not family.trainable:
                continue
            spans = [strategy.optimizer_range(b) for b in range(family.num_buckets)]
            if not self.aliased[f]:
                with torch.no_grad():
                    for b, span in enumerate(spans):
                        storage.values(b, span).copy_(self.masters[f][b])
            storage.publish(spans)

    def refresh_from_params(self) -> None:
        """Copy the param values into non-aliased masters (after params were written from outside)."""
        with torch.no_grad():
            for f, (family, storage, strategy) in enumerate(zip(self.families, self.storages, self.strategies)):
                if not self.aliased[f]:
                    for b in range(family.num_buckets):
                        self.masters[f][b].copy_(storage.values(b, strategy.optimizer_range(b)))
