import pytest

from moezero.parallel import ParallelGroups, rank_layout


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
