"""The one tag moezero puts on parameters: "this is a routed-expert weight".

Routed-expert weights are stacked (local experts along dim 0) and reduced over the `edp`
group; everything else is replicated over `dp`. The MoE layer sets the tag, the optimizer and
checkpointing read it, so `zero/` never imports `moe/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_ATTR = "_moezero_expert_shard"


@dataclass(frozen=True)
class ExpertShard:
    """Where a stacked local-expert tensor sits in the global expert dimension (dim 0)."""

    num_local_experts: int
    ep_rank: int
    ep_size: int

    @property
    def num_global_experts(self) -> int:
        return self.num_local_experts * self.ep_size

    @property
    def first_global_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    def global_index(self, local_index: int) -> int:
        return self.first_global_expert + local_index


def mark_expert_parallel(param: torch.Tensor, shard: ExpertShard) -> None:
    if param.shape[0] != shard.num_local_experts:
        raise ValueError(
            f"expert tensor of shape {tuple(param.shape)} does not stack "
            f"{shard.num_local_experts} local experts along dim 0"
        )
    setattr(param, _ATTR, shard)


def expert_shard_of(param: torch.Tensor) -> Optional[ExpertShard]:
    """The ExpertShard of a routed-expert weight, None for a replicated (dense) param."""
    return getattr(param, _ATTR, None)


def is_expert_parallel(param: torch.Tensor) -> bool:
    return expert_shard_of(param) is not None
