"""Parameter families: params reduced over one group in one dtype, laid out in one flat space.

Dense params form families over `dp`, routed-expert params over `edp`, one family per dtype, and
params frozen when the optimizer adopted them form families of their own (stored, sharded and held
with their optimizer state like the others, but never reduced: a frozen model part costs no
communication).
A family is pure bookkeeping: which param sits where in the flat layout, which bucket slice
this rank owns, and where each param sits in its *global* tensor (routed experts stacked over
the global experts). Storage is the param side's business (`param_storage.py`), gradients the
grad side's (`grad_strategies.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from moezero.parallel import ParallelGroups, comm, expert_shard_of
from moezero.zero.partition import FlatLayout, ParamSlot, plan_buckets, shard_overlap

Range = Tuple[int, int]


def global_placement(param: torch.Tensor) -> Tuple[Tuple[int, ...], int]:
    """(global shape, flat offset of this rank's tensor inside it); experts stack along dim 0."""
    shard = expert_shard_of(param)
    if shard is None:
        return tuple(param.shape), 0
    per_expert = param.numel() // shard.num_local_experts
    return (shard.num_global_experts,) + tuple(param.shape[1:]), shard.first_global_expert * per_expert


@dataclass
class ParamFamily:
    """Params of one (reduce group, dtype); see the module docstring."""

    kind: str                         # "dense" or "expert"
    dtype: torch.dtype
    trainable: bool                   # False: frozen when adopted; no gradient hooks, never reduced
    group: Optional[Any]              # the reduce group (dp or edp)
    names: List[str]
    params: List[nn.Parameter]
    layout: FlatLayout
    units: List[int] = field(default_factory=list)   # stage-3 gather unit of each param (else all 0)

    def __post_init__(self):
        self.group_rank = comm.group_rank(self.group)
        self.group_size = comm.group_size(self.group)
        self.owned: List[Range] = [b.shard_range(self.group_rank, self.group_size) for b in self.layout.buckets]
        self.placements = [global_placement(p) for p in self.params]
        self.bucket_params: List[Tuple[int, ...]] = [b.params for b in self.layout.buckets]

    @property
    def num_buckets(self) -> int:
        return len(self.layout.buckets)

    def slot(self, index: int) -> ParamSlot:
        return self.layout.slots[index]

    def bucket_of(self, index: int) -> int:
        return self.layout.slots[index].bucket

    def bucket_numel(self, bucket: int) -> int:
        return self.layout.buckets[bucket].numel

    def bucket_region(self, flat: torch.Tensor, bucket: int) -> torch.Tensor:
        """The bucket's slice of a family-sized flat tensor."""
        b = self.layout.buckets[bucket]
        return flat[b.start:b.start + b.numel]

    def view_in_bucket(self, bucket_tensor: torch.Tensor, index: int) -> torch.Tensor:
        """Param `index`'s slice of a bucket-sized flat tensor, shaped like the param."""
        s = self.slot(index)
        return bucket_tensor[s.offset:s.offset + s.numel].view(self.params[index].shape)

    def param_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Param `index`'s slice of a family-sized flat tensor, shaped like the param."""
        return self.view_in_bucket(self.bucket_region(flat, self.bucket_of(index)), index)

    def pieces(self, bucket: int, span: Range) -> List[Tuple[int, Range, int]]:
        """(param index, range of the param's own flat elements, offset in `span`) of params inside `span`."""
        out = []
        for index in self.bucket_params[bucket]:
            overlap = shard_overlap(self.slot(index), span)
            if overlap is not None:
                out.append((index, overlap, self.slot(index).offset + overlap[0] - span[0]))
        return out

    def global_range(self, index: int, param_range: Range) -> Range:
        """A range of param `index`'s flat elements, in the coordinates of its global tensor."""
        offset = self.placements[index][1]
        return offset + param_range[0], offset + param_range[1]


def family_key(param: torch.Tensor) -> Tuple[str, torch.dtype, bool]:
    return ("expert" if expert_shard_of(param) is not None else "dense"), param.dtype, param.requires_grad


def build_families(named_params: Sequence[Tuple[str, nn.Parameter]], groups: ParallelGroups, bucket_size: int,
                   unit_of: Optional[Mapping[int, int]] = None) -> List[ParamFamily]:
    """Group params into families; each family's layout is reverse registration (~ backward) order.

    `unit_of` (stage 3: id(param) -> gather unit) keeps each unit's params contiguous, in
    reverse unit order, and starts a new bucket at every unit boundary.
    """
    by_key: Dict[Tuple[str, torch.dtype, bool], List[Tuple[str, nn.Parameter]]] = {}
    for name, p in named_params:
        by_key.setdefault(family_key(p), []).append((name, p))
    families = []
    for (kind, dtype, trainable), members in sorted(by_key.items(), key=lambda kv: (kv[0][0], str(kv[0][1]),
                                                                                      not kv[0][2])):
        members = list(reversed(members))
        units = [0] * len(members)
        if unit_of is not None:
            members.sort(key=lambda m: -unit_of[id(m[1])])  # stable: reverse registration inside a unit
            units = [unit_of[id(p)] for _, p in members]
        breaks = {i for i in range(1, len(units)) if units[i] != units[i - 1]}
        group = groups.edp if kind == "expert" else groups.dp
        layout = plan_buckets([p.numel() for _, p in members], bucket_size, comm.group_size(group), breaks=breaks)
        families.append(ParamFamily(kind, dtype, trainable, group, [n for n, _ in members],
                                    [p for _, p in members], layout, units))
    return families
