"""Megatron's rank order with a pipeline dimension, at tensor and context parallel size 1 (pure; to be merged into
`parallel/groups.py`'s `rank_layout`).

Megatron-LM's initialize.py orders ranks 'tp-cp-ep-dp-pp' (the first name fastest), or 'tp-cp-ep-pp-dp' with
--use-tp-pp-dp-mapping, and megatron-core's initialize_model_parallel folds them twice over the same ranks
(parallel_state.py, RankGenerator:447 and generate_masked_orthogonal_rank_groups:251): the decoder's (dense params)
with ep = 1, dp = world / pp, and the experts' with ep, edp = world / (ep x pp). At tp = cp = 1:

  world 8, ep 2, pp 2, default order:  dp {0,1,2,3} {4,5,6,7}   pp {0,4} {1,5} {2,6} {3,7}
                                       ep {0,1} {2,3} {4,5} {6,7}   edp {0,2} {1,3} {4,6} {5,7}
  world 8, ep 1, pp 2, tp-pp-dp:       dp {0,2,4,6} {1,3,5,7}   pp {0,1} {2,3} {4,5} {6,7}

At pp = 1 the groups are `rank_layout`'s (dp: the world). The embedding group of each pp group is its first and
last rank (default_embedding_ranks: where the word embedding and the output layer live), the position embedding
group its first rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

from moezero.config.options import ConfigError

Ranks = Tuple[int, ...]
Partition = Tuple[Ranks, ...]
DEFAULT_ORDER = ("ep", "dp", "pp")  # 'tp-cp-ep-dp-pp' without the size-1 tp and cp
TP_PP_DP_ORDER = ("ep", "pp", "dp")  # 'tp-cp-ep-pp-dp' (--use-tp-pp-dp-mapping)


@dataclass(frozen=True)
class PipelineRankLayout:
    """Every group of each kind, as Megatron builds them (each a partition of the world)."""

    world_size: int
    expert_parallel_size: int
    pipeline_parallel_size: int
    use_tp_pp_dp_mapping: bool
    dp_groups: Partition  # dense params' data parallel group, one per pp coordinate
    pp_groups: Partition  # the stages of one pipeline, in stage order
    ep_groups: Partition
    edp_groups: Partition  # expert data parallel (Megatron's expert 'dp')
    embedding_groups: Tuple[Ranks, ...]  # per pp group: its first and last rank (one rank at pp 1)
    position_embedding_groups: Tuple[Ranks, ...]  # per pp group: its first rank

    def group_of(self, partition: Partition, rank: int) -> Ranks:
        return next(group for group in partition if rank in group)

    def pp_rank_of(self, rank: int) -> int:
        return self.group_of(self.pp_groups, rank).index(rank)

    def dp_rank_of(self, rank: int) -> int:
        return self.group_of(self.dp_groups, rank).index(rank)

    def ep_rank_of(self, rank: int) -> int:
        return self.group_of(self.ep_groups, rank).index(rank)


def pipeline_rank_layout(
    world_size: int, expert_parallel_size: int = 1, pipeline_parallel_size: int = 1, use_tp_pp_dp_mapping: bool = False
) -> PipelineRankLayout:
    """The dp, pp, ep, edp partitions and the embedding groups; Megatron's refusals as one-line ConfigErrors."""
    world, ep, pp = world_size, expert_parallel_size, pipeline_parallel_size
    _check(world, ep, pp, use_tp_pp_dp_mapping)
    order = TP_PP_DP_ORDER if use_tp_pp_dp_mapping else DEFAULT_ORDER
    decoder = {"ep": 1, "dp": world // pp, "pp": pp}
    expert = {"ep": ep, "dp": world // (ep * pp), "pp": pp}
    # the experts' pp groups equal the decoder's (Megatron asserts it, parallel_state.py:814): at tp = cp = 1 that
    # holds whenever the checks above pass, so they are taken from the decoder's folding
    pp_groups = _groups(order, decoder, "pp")
    return PipelineRankLayout(
        world,
        ep,
        pp,
        use_tp_pp_dp_mapping,
        dp_groups=_groups(order, decoder, "dp"),
        pp_groups=pp_groups,
        ep_groups=_groups(order, expert, "ep"),
        edp_groups=_groups(order, expert, "dp"),
        embedding_groups=tuple(_first_and_last(group) for group in pp_groups),
        position_embedding_groups=tuple(group[:1] for group in pp_groups),
    )


def _check(world: int, ep: int, pp: int, use_tp_pp_dp_mapping: bool) -> None:
    for name, value in (
        ("world size", world),
        ("--expert-model-parallel-size", ep),
        ("--pipeline-model-parallel-size", pp),
    ):
        if value < 1:
            raise ConfigError(f"{name}={value}: must be >= 1")
    if world % pp:  # parallel_state.py:740; Megatron-LM arguments.py:317 (core_v0.16.1)
        raise ConfigError(f"--pipeline-model-parallel-size={pp}: must divide the world size ({world})")
    if world % (ep * pp):  # parallel_state.py:792
        raise ConfigError(
            f"--expert-model-parallel-size={ep}, --pipeline-model-parallel-size={pp}: their product "
            f"({ep * pp}) must divide the world size ({world})"
        )
    if use_tp_pp_dp_mapping and pp > 1 and ep > 1:
        # parallel_state.py:808: without pp last in the order, the experts' data parallel size must equal the
        # decoder's (world / (ep x pp) == world / pp at tp = 1, i.e. ep = 1)
        raise ConfigError(
            f"--use-tp-pp-dp-mapping, --expert-model-parallel-size={ep}, "
            f"--pipeline-model-parallel-size={pp}: Megatron's tp-pp-dp rank order needs "
            "--expert-model-parallel-size=1 with a pipeline"
        )


def _first_and_last(group: Ranks) -> Ranks:
    return group[:1] if len(group) == 1 else (group[0], group[-1])


def _groups(order: Sequence[str], sizes: Dict[str, int], kind: str) -> Partition:
    """generate_masked_orthogonal_rank_groups for one kind: rank = sum of coordinate x stride over `order` (the first
    name fastest); one group per setting of the other coordinates (the first of them fastest), its ranks by
    the kind's coordinate."""
    shape = [sizes[name] for name in order]
    strides = [1]
    for size in shape[:-1]:
        strides.append(strides[-1] * size)
    axis = order.index(kind)
    others = [i for i in range(len(order)) if i != axis]
    groups = []
    # itertools.product varies its last range fastest: feed the others reversed so the first of them is fastest
    for setting in itertools.product(*(range(shape[i]) for i in reversed(others))):
        base = sum(coordinate * strides[i] for coordinate, i in zip(setting, reversed(others)))
        groups.append(tuple(base + k * strides[axis] for k in range(shape[axis])))
    return tuple(groups)
