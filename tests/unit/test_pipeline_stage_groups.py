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


@pytest.mark.parametrize(
    "world, tp, ep, pp, mapping",
    [(4, 2, 1, 2, False), (4, 2, 2, 2, False), (8, 2, 2, 2, False), (16, 2, 4, 2, False), (8, 2, 2, 2, True)],
)
def test_stage_local_groups_with_tensor_parallelism_are_megatrons(world, tp, ep, pp, mapping):
    """At tp > 1 a stage's ranks are its tp-dp-cp group (tp {0,1} {2,3}, pp {0,2} {1,3} at world 4, tp 2, pp 2): its
    local layout gives each rank Megatron's tp, dp-cp (its tp coordinate's), ep and edp groups."""
    layout = pipeline_rank_layout(world, ep, pp, mapping, tensor_parallel_size=tp)
    for rank in range(world):
        local, me = stage_coordinates(layout, rank)  # raises where they differ
        members = layout.group_of(layout.stage_groups, rank)
        assert local.world_size == world // pp and members[me] == rank
        tp_group = layout.group_of(layout.tp_groups, rank)
        assert tuple(members[i] for i in local.tp_group_of(me)) == tp_group and tp_group.index(rank) == me % tp
        assert len(layout.group_of(layout.dp_groups, rank)) == world // (tp * pp)
    if (world, tp, pp, mapping) == (4, 2, 2, False):  # the task's layout: docs/megatron.md
        assert layout.tp_groups == ((0, 1), (2, 3)) and layout.pp_groups == ((0, 2), (1, 3))
        assert layout.stage_groups == ((0, 1), (2, 3)) and layout.embedding_groups == ((0, 2), (1, 3))


@pytest.mark.parametrize(
    "world, tp, cp, ep, etp, pp, mapping",
    [
        (4, 2, 1, 1, 2, 2, False),
        (4, 1, 1, 1, 2, 2, False),
        (8, 2, 1, 2, 2, 2, False),
        (8, 2, 2, 1, 2, 2, False),
        (8, 1, 2, 2, 2, 2, False),
        (16, 2, 1, 1, 2, 2, True),
        (16, 2, 2, 2, 2, 2, False),
    ],
)
def test_stage_local_expert_tensor_parallel_groups_are_megatrons(world, tp, cp, ep, etp, pp, mapping):
    """At etp > 1 a stage's local layout (Megatron's expert folding of a world of the stage's size) gives each rank
    Megatron's etp, ep and edp groups, the experts' slices and ZeRO families of its stage."""
    layout = pipeline_rank_layout(world, ep, pp, mapping, cp, tp, etp)
    for rank in range(world):
        local, me = stage_coordinates(layout, rank)  # raises where they differ
        members = layout.group_of(layout.stage_groups, rank)
        etp_group = layout.group_of(layout.etp_groups, rank)
        assert len(etp_group) == etp and tuple(members[i] for i in local.etp_group_of(me)) == etp_group
        assert set(layout.group_of(layout.edp_groups, rank)) <= set(members)
    if (world, tp, etp, pp) == (4, 2, 2, 2):  # the task's layout: etp = tp, the experts' slices on the tp ranks
        assert layout.etp_groups == layout.tp_groups == ((0, 1), (2, 3)) and layout.edp_groups == (
            (0,),
            (1,),
            (2,),
            (3,),
        )
