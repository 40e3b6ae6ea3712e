"""The stage-local coordinates a pipeline rank's ParallelGroups is built with (moezero/pipeline/stage_groups.py):
each stage's ranks, numbered by their place in the stage's dp group, must see the ep and edp groups that Megatron's
rank order gives them (pipeline_rank_layout, itself checked against megatron-core in test_pipeline_ranks.py), so
the MoE layers' expert shards (ep_rank = local rank % ep) and ZeRO's expert families are the right ones; with
context parallelism the cp groups too (the stage's dp group is Megatron's dp-cp, cp fastest)."""

import pytest

from moezero.pipeline import pipeline_rank_layout
from moezero.pipeline.stage_groups import stage_coordinates


@pytest.mark.parametrize(
    "world, ep, pp, mapping",
    [
        (2, 1, 2, False),
        (4, 2, 2, False),
        (8, 2, 2, False),
        (8, 2, 4, False),
        (16, 4, 2, False),
        (16, 2, 4, False),
        (8, 1, 2, True),
        (16, 1, 4, True),
    ],
)
@pytest.mark.parametrize("cp", [1, 2])
def test_stage_local_ep_edp_and_cp_groups_are_megatrons(world, ep, pp, mapping, cp):
    if world % (cp * pp) or (mapping and ep != cp):  # sizes Megatron refuses (test_pipeline_ranks.py)
        pytest.skip("a layout Megatron refuses")
    layout = pipeline_rank_layout(world, ep, pp, mapping, context_parallel_size=cp)
    for rank in range(world):
        local, me = stage_coordinates(layout, rank)  # raises where they differ
        members = layout.group_of(layout.dp_groups, rank)
        assert local.world_size == world // pp and members[me] == rank
        ep_group = layout.group_of(layout.ep_groups, rank)
        assert ep_group.index(rank) == me % ep  # the expert shard ParallelGroups.ep_rank picks
        assert tuple(members[i] for i in local.ep_group_of(me)) == ep_group
        cp_group = layout.group_of(layout.cp_groups, rank)
        assert tuple(members[i] for i in local.cp_group_of(me)) == cp_group and me % cp == cp_group.index(rank)
