"""Parameter families: params reduced over one group in one dtype, laid out in one flat space.

Dense params form families over `dp`, routed-expert params over `edp`, one family per dtype, and
params frozen when the optimizer adopted them form families of their own (stored, sharded and held
with their optimizer state like the others, but never reduced: a frozen model part costs no
communication).
A family is pure bookkeeping: its params' records (`zero_param.py`: where each sits in the flat
layout and in its global tensor), and which slice of each bucket this rank owns. Storage is the
param side's business (`param_storage.py`), gradients the grad side's (`grad_strategies.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from moezero.parallel import ParallelGroups, comm, expert_shard_of
from moezero.zero.partition import FlatLayout, plan_buckets
from moezero.zero.zero_param import Range, ZeroParam, optimizer_slice

if TYPE_CHECKING:
    from moezero.zero.grad_strategies import GradStrategy
    from moezero.zero.param_storage import ParamStorage


@dataclass(eq=False)
class ParamFamily:
    """Params of one (reduce group, dtype); see the module docstring."""

    kind: str                         # "dense" or "expert"
    dtype: torch.dtype
    trainable: bool                   # False: frozen when adopted; no gradient hooks, never reduced
    group: Optional[Any]              # the reduce group (dp or edp)
    members: List[ZeroParam]          # in layout order
    layout: FlatLayout

    def __post_init__(self):
        self.group_rank = comm.group_rank(self.group)
        self.group_size = comm.group_size(self.group)
        self.owned: List[Range] = [b.shard_range(self.group_rank, self.group_size) for b in self.layout.buckets]
        self.buckets: List[List[ZeroParam]] = [[self.members[i] for i in b.params] for b in self.layout.buckets]
        for zp in self.members:
            zp.family = self

    @property
    def num_buckets(self) -> int:
        return len(self.layout.buckets)

    @property
    def device(self) -> torch.device:
        """Where the family's storage lives: its params' device (the CPU for params still deferred on meta)."""
        return next((zp.param.device for zp in self.members if zp.param.device.type != "meta"), torch.device("cpu"))

    def bucket_numel(self, bucket: int) -> int:
        return self.layout.buckets[bucket].numel

    def bucket_region(self, flat: torch.Tensor, bucket: int) -> torch.Tensor:
        """The bucket's slice of a family-sized flat tensor."""
        b = self.layout.buckets[bucket]
        return flat[b.start:b.start + b.numel]

    def view_in_bucket(self, bucket_tensor: torch.Tensor, zp: ZeroParam) -> torch.Tensor:
        """The param's slice of a bucket-sized flat tensor, shaped like the param."""
        lo, hi = zp.bucket_range((0, zp.slot.numel))
        return bucket_tensor[lo:hi].view(zp.param.shape)

    def param_view(self, flat: torch.Tensor, zp: ZeroParam) -> torch.Tensor:
        """The param's slice of a family-sized flat tensor, shaped like the param."""
        return self.view_in_bucket(self.bucket_region(flat, zp.bucket), zp)

    def pieces(self, bucket: int, span: Range) -> List[Tuple[ZeroParam, Range, int]]:
        """(param, its part inside the bucket range `span` in param coordinates, where that part starts in
        `span`)."""
        out = []
        for zp in self.buckets[bucket]:
            part = zp.param_range_in(span)
            if part is not None:
                out.append((zp, part, optimizer_slice(zp.bucket_range(part), span).start))
        return out


@dataclass(eq=False)
class FamilyParts:
    """A family and the two sides that serve it: where its values live, how its gradients are reduced."""

    family: ParamFamily
    storage: "ParamStorage"
    strategy: "GradStrategy"


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
        position = {i: pos for b in layout.buckets for pos, i in enumerate(b.params)}
        records = [ZeroParam(name, p, layout.slots[i], position[i], units[i]) for i, (name, p) in enumerate(members)]
        families.append(ParamFamily(kind, dtype, trainable, group, records, layout))
    return families
