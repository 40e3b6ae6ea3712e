"""Parameter families: params reduced over one group in one dtype, laid out in one flat space.

Dense params form families over `dp`, routed-expert params over `edp`, one family per dtype (at tp > 1 the
params replicated over tp form families of their own, still over `dp`: see `family_kind`), and
params frozen when the optimizer adopted them form families of their own (stored, sharded and held
with their optimizer state like the others, but never reduced: a frozen model part costs no
communication).
A family (`ParamFamily`, in `zero_param.py` beside the params' records) is pure bookkeeping: its params'
records (where each sits in the flat layout and in its global tensor), and which slice of each bucket this
rank owns. Storage is the param side's business (`param_storage.py`), gradients the grad side's
(`grad_strategies.py`). This module groups a model's params into families.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from moezero.parallel import ParallelGroups, comm, expert_shard_of
from moezero.parallel.tensor_marker import is_tensor_parallel, is_tp_partial
from moezero.zero.partition import plan_buckets
from moezero.zero.zero_param import ParamFamily, ZeroParam


def family_kind(param: torch.Tensor, tp_size: int = 1) -> str:
    """ "expert" (routed experts, over edp); at tp > 1 a param whole on every tp rank is "tp_partial" when its
    gradient is each rank's part of the sum (tensor_marker.mark_tp_partial), else "tp_copies" (the same gradient on
    every tp rank): both are counted once over tp in the norm; "dense" otherwise (tp shards, everything at tp 1)."""
    if expert_shard_of(param) is not None:
        return "expert"
    if tp_size > 1 and not is_tensor_parallel(param):
        return "tp_partial" if is_tp_partial(param) else "tp_copies"
    return "dense"


def family_key(param: torch.Tensor, tp_size: int = 1) -> Tuple[str, torch.dtype, bool]:
    return family_kind(param, tp_size), param.dtype, param.requires_grad


def build_families(
    named_params: Sequence[Tuple[str, nn.Parameter]],
    groups: ParallelGroups,
    bucket_size: int,
    unit_of: Optional[Mapping[int, int]] = None,
) -> List[ParamFamily]:
    """Group params into families; each family's layout is reverse registration (~ backward) order.

    `unit_of` (stage 3: id(param) -> gather unit) keeps each unit's params contiguous, in
    reverse unit order, and starts a new bucket at every unit boundary.
    """
    by_key: Dict[Tuple[str, torch.dtype, bool], List[Tuple[str, nn.Parameter]]] = {}
    for name, p in named_params:
        by_key.setdefault(family_key(p, groups.tp_size), []).append((name, p))
    families = []
    for (kind, dtype, trainable), members in sorted(
        by_key.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), not kv[0][2])
    ):
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
