"""The one registry of ZeRO stages: what each rank holds a 1/dp share of, and the parts that implement it.

    stage  shards                          params stored as       gradients
    0      nothing (data parallel)         replicated             all-reduced, whole buckets kept
    1      optimizer state                 replicated             reduce-scattered at the step boundary
    2      + gradients                     replicated             reduce-scattered after every backward
    3      + params                        sharded, gathered      reduce-scattered after every backward
                                           per unit

Everything that depends on the stage asks its `Stage` (the engine, the optimizer's checks, the tests'
memory formula); adding a variant (e.g. hierarchical partitioning) is a row here plus its parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Type

from moezero.zero.grad_strategies import (
    AllReduceGrads,
    GradStrategy,
    ReduceScatterAtBoundary,
    ReduceScatterEveryBackward,
)
from moezero.zero.param_storage import ParamStorage, ReplicatedParams
from moezero.zero.sharded_params import ShardedParams
from moezero.zero.zero_param import ParamFamily

KINDS = ("params", "grads", "optimizer_state")  # what a rank holds (masters count with the optimizer state)


@dataclass(frozen=True)
class Stage:
    number: int
    shards: FrozenSet[str]  # which KINDS each rank holds a 1/dp share of
    param_storage: Type[ParamStorage]  # built as cls(family, groups)
    grad_strategy: Type[GradStrategy]  # built as cls(family, reduce dtype, master dtype, dp size)

    @property
    def shards_params(self) -> bool:
        """Params stored as shards and gathered per unit around their module's forward and backward."""
        return "params" in self.shards

    @property
    def keeps_whole_buckets(self) -> bool:
        """Gradients reduced whole on every rank (nothing of them sharded): stage 0."""
        return "grads" not in self.shards and "optimizer_state" not in self.shards

    def held_bytes(self, kind: str, total_bytes: float, dp_size: int) -> float:
        """The memory formula (ZeRO paper, Rajbhandari et al. 2020): bytes of `kind` one rank holds when the
        whole model's are `total_bytes` (padding of the last bucket aside)."""
        return total_bytes / dp_size if kind in self.shards else total_bytes


STAGES: Dict[int, Stage] = {
    0: Stage(0, frozenset(), ReplicatedParams, AllReduceGrads),
    1: Stage(1, frozenset({"optimizer_state"}), ReplicatedParams, ReduceScatterAtBoundary),
    2: Stage(2, frozenset({"optimizer_state", "grads"}), ReplicatedParams, ReduceScatterEveryBackward),
    3: Stage(3, frozenset({"optimizer_state", "grads", "params"}), ShardedParams, ReduceScatterEveryBackward),
}


@dataclass(eq=False)
class FamilyParts:
    """What a stage builds for one family: where its values live, how its gradients are reduced."""

    family: ParamFamily
    storage: ParamStorage
    strategy: GradStrategy


def stage_of(number: int) -> Stage:
    if number not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(map(str, STAGES))}, got {number}")
    return STAGES[number]
