"""Parameter families: params reduced over one group in one dtype, living in one flat buffer.

Dense params form families over `dp`, routed-expert params over `edp`, one family per dtype.
Each family moves its params' storage into a flat buffer once, at construction (the params
become views of it, so the optimizer can all-gather updated shards straight into them), and
cuts that buffer into buckets (`partition.plan_buckets`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from moezero.parallel import ParallelGroups, comm, expert_shard_of
from moezero.zero.partition import BucketLayout, FlatLayout, ParamSlot, plan_buckets, shard_overlap


@dataclass
class Bucket:
    """One bucket's params and its per-backward readiness."""

    layout: BucketLayout
    params: List[int]                 # family param indices
    pending: int = 0                  # params yet to deliver a gradient in this backward
    staged: bool = False              # gradients of this backward are in the bucket's buffer


@dataclass
class ParamFamily:
    """Params of one (reduce group, dtype); see the module docstring."""

    kind: str                         # "dense" or "expert"
    dtype: torch.dtype
    group: Optional[Any]
    names: List[str]
    params: List[nn.Parameter]
    layout: FlatLayout
    buffer: torch.Tensor              # flat param storage, model dtype
    buckets: List[Bucket] = field(default_factory=list)
    data_ptrs: List[int] = field(default_factory=list)

    @property
    def group_size(self) -> int:
        return self.layout.group_size

    @property
    def group_rank(self) -> int:
        return comm.group_rank(self.group)

    def slot(self, index: int) -> ParamSlot:
        return self.layout.slots[index]

    def bucket_region(self, tensor: torch.Tensor, bucket: int) -> torch.Tensor:
        """The bucket's slice of a family-sized flat tensor."""
        b = self.layout.buckets[bucket]
        return tensor[b.start:b.start + b.numel]

    def param_view(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        """Param `index`'s slice of a family-sized flat tensor, shaped like the param."""
        s = self.slot(index)
        start = self.layout.buckets[s.bucket].start + s.offset
        return tensor[start:start + s.numel].view(self.params[index].shape)

    def own_range(self, bucket: int) -> Tuple[int, int]:
        """The shard of `bucket` this rank owns (for sharding, the norm and checkpoints)."""
        return self.layout.buckets[bucket].shard_range(self.group_rank, self.group_size)

    def pieces(self, bucket: int, shard: Tuple[int, int]) -> List[Tuple[int, Tuple[int, int], int]]:
        """(param index, range of the param's flat elements, offset in the shard) for params in a shard."""
        out = []
        for index in self.buckets[bucket].params:
            overlap = shard_overlap(self.slot(index), shard)
            if overlap is not None:
                out.append((index, overlap, self.slot(index).offset + overlap[0] - shard[0]))
        return out

    def storage_intact(self, index: int) -> bool:
        return self.params[index].data_ptr() == self.data_ptrs[index]


def build_families(named_params: Sequence[Tuple[str, nn.Parameter]], groups: ParallelGroups,
                   bucket_size: int) -> List[ParamFamily]:
    """Group trainable params into families and move each family into its flat buffer.

    `named_params` come in registration order; buckets are laid out in reverse (≈ backward) order.
    """
    by_key: Dict[Tuple[str, torch.dtype], List[Tuple[str, nn.Parameter]]] = {}
    for name, p in named_params:
        kind = "expert" if expert_shard_of(p) is not None else "dense"
        by_key.setdefault((kind, p.dtype), []).append((name, p))
    families = []
    for (kind, dtype), members in sorted(by_key.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        members = list(reversed(members))
        group = groups.edp if kind == "expert" else groups.dp
        layout = plan_buckets([p.numel() for _, p in members], bucket_size, comm.group_size(group))
        families.append(_make_family(kind, dtype, group, members, layout))
    return families


def _make_family(kind, dtype, group, members, layout) -> ParamFamily:
    device = members[0][1].device
    buffer = torch.zeros(layout.total_numel, dtype=dtype, device=device)
    family = ParamFamily(kind, dtype, group, [n for n, _ in members], [p for _, p in members], layout, buffer)
    with torch.no_grad():
        for index, p in enumerate(family.params):
            view = family.param_view(buffer, index)
            view.copy_(p)
            p.data = view  # once, at construction: the param now lives in the flat buffer
    family.data_ptrs = [p.data_ptr() for p in family.params]
    family.buckets = [Bucket(b, list(b.params)) for b in layout.buckets]
    return family
