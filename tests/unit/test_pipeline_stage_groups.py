"""The stage-local coordinates a pipeline rank's ParallelGroups is built with (moezero/pipeline/stage_groups.py):
each stage's ranks, numbered by their place in the stage's dp group, must see the ep and edp groups that Megatron's
rank order gives them (pipeline_rank_layout, itself checked against megatron-core in test_pipeline_ranks.py), so
the MoE layers' expert shards (ep_rank = local rank % ep) and ZeRO's expert families are the right ones."""

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
def test_stage_local_ep_and_edp_groups_are_megatrons(world, ep, pp, mapping):
    layout = pipeline_rank_layout(world, ep, pp, mapping)
    for rank in range(world):
        local, me = stage_coordinates(layout, rank)  # raises where they differ
        members = layout.group_of(layout.dp_groups, rank)
        assert local.world_size == world // pp and members[me] == rank
        ep_group = layout.group_of(layout.ep_groups, rank)
        assert ep_group.index(rank) == me % ep  # the expert shard ParallelGroups.ep_rank picks
        assert tuple(members[i] for i in local.ep_group_of(me)) == ep_group
