import pytest

from moezero.parallel import ParallelGroups, rank_layout
from moezero.parallel.ranks import megatron_rank_layout


@pytest.mark.parametrize(
    "world,ep,ep_groups,edp_groups",
    [
        (1, 1, [(0,)], [(0,)]),
        (2, 1, [(0,), (1,)], [(0, 1)]),
        (2, 2, [(0, 1)], [(0,), (1,)]),
        (4, 1, [(0,), (1,), (2,), (3,)], [(0, 1, 2, 3)]),
        (4, 2, [(0, 1), (2, 3)], [(0, 2), (1, 3)]),
        (4, 4, [(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)]),
    ],
)
def test_layout(world, ep, ep_groups, edp_groups):
    layout = rank_layout(world, ep)
    assert list(layout.ep_groups) == ep_groups
    assert list(layout.edp_groups) == edp_groups
    for rank in range(world):
        # every rank is in exactly one group of each kind, and ep x edp covers the world
        assert rank in layout.ep_group_of(rank) and rank in layout.edp_group_of(rank)
        assert set(layout.ep_group_of(rank)) & set(layout.edp_group_of(rank)) == {rank}


@pytest.mark.parametrize("world,ep,needle", [(4, 3, "(4)"), (2, 0, "got 0"), (2, 4, "(4)"), (0, 1, "got 0")])
def test_invalid_layout_names_the_numbers(world, ep, needle):
    with pytest.raises(ValueError, match=None) as info:
        rank_layout(world, ep)
    assert needle in str(info.value)


def test_world_of_one_without_torch_distributed():
    groups = ParallelGroups.build(expert_parallel_size=1)
    assert (groups.world_size, groups.ep_size, groups.edp_size, groups.rank, groups.ep_rank) == (1, 1, 1, 0, 0)
    assert groups.dp is None and groups.ep is None and groups.edp is None
    with pytest.raises(ValueError, match="expert parallel size 2"):
        ParallelGroups.build(expert_parallel_size=2)


@pytest.mark.parametrize(
    "world,ep,cp,cp_groups,edp_groups",
    [
        (2, 1, 2, [(0, 1)], [(0, 1)]),
        (4, 2, 2, [(0, 1), (2, 3)], [(0, 2), (1, 3)]),  # ep and cp on the same ranks; cp folded into edp
        (4, 1, 2, [(0, 1), (2, 3)], [(0, 1, 2, 3)]),
        (8, 2, 4, [(0, 1, 2, 3), (4, 5, 6, 7)], [(0, 2, 4, 6), (1, 3, 5, 7)]),
    ],
)
def test_context_parallel_layout_is_megatrons(world, ep, cp, cp_groups, edp_groups):
    """At tp 1 Megatron's decoder order 'tp-cp-ep-dp-pp' makes cp the fastest coordinate, and its expert order folds
    cp into edp: the groups are megatron-core's RankGenerator's (decoder: cp and dp-cp; expert: ep and dp)."""
    from megatron.core.parallel_state import RankGenerator

    layout = rank_layout(world, ep, cp)
    assert list(layout.cp_groups) == cp_groups and list(layout.edp_groups) == edp_groups
    decoder = RankGenerator(tp=1, ep=1, dp=world // cp, pp=1, cp=cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=1, ep=ep, dp=world // ep, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    assert [list(g) for g in layout.cp_groups] == decoder.get_ranks("cp")
    assert decoder.get_ranks("dp-cp") == [list(range(world))]  # dense gradients: the whole world, as today
    assert [list(g) for g in layout.ep_groups] == expert.get_ranks("ep")
    assert [list(g) for g in layout.edp_groups] == expert.get_ranks("dp")
    groups = [ParallelGroups(layout, rank=r) for r in range(world)]
    assert [g.data_parallel_rank for g in groups] == [r // cp for r in range(world)]
    assert {g.data_parallel_size for g in groups} == {world // cp}
    assert all(layout.cp_group_of(r)[g.cp_rank] == r for r, g in enumerate(groups))


@pytest.mark.parametrize("world,cp", [(4, 3), (2, 0)])
def test_invalid_context_parallel_size(world, cp):
    with pytest.raises(ValueError, match=f"context parallel size {cp}"):
        rank_layout(world, 1, cp)


@pytest.mark.parametrize(
    "world,ep,cp,tp", [(2, 1, 1, 1), (4, 2, 2, 1), (4, 1, 1, 2), (8, 2, 2, 2), (8, 1, 2, 2), (8, 4, 1, 4)]
)
def test_batch_groups_are_megatrons_tp_cp_groups(world, ep, cp, tp):
    """The ranks that read the same micro-batches (their records: parallel/batch_agreement.py) are Megatron's tp-cp
    groups at pp 1."""
    layout = rank_layout(world, ep, cp, tp, expert_tensor_parallel_size=1)
    megatron = megatron_rank_layout(world, tp, cp, ep, expert_tensor_parallel_size=1).decoder["tp-cp"]
    assert sorted(layout.batch_groups()) == sorted(megatron)
