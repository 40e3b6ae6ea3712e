"""ParallelGroups' coordinates at tensor-parallel size > 1: read from Megatron's partitions (megatron-core's
RankGenerator is the oracle), never from rank arithmetic; at tp 2, ep 2 on 2 ranks the ep group crosses tp."""

import pytest

from moezero.parallel import ParallelGroups, rank_layout


@pytest.mark.parametrize("world,tp,ep", [(2, 2, 1), (2, 2, 2), (4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 2, 2), (8, 4, 2)])
def test_tensor_parallel_layout_is_megatrons(world, tp, ep):
    from megatron.core.parallel_state import RankGenerator

    layout = rank_layout(world, ep, 1, tp)
    decoder = RankGenerator(tp=tp, ep=1, dp=world // tp, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=1, ep=ep, dp=world // ep, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    assert [list(g) for g in layout.tp_groups] == decoder.get_ranks("tp")
    assert [list(g) for g in layout.dense_groups] == decoder.get_ranks("dp-cp")
    assert [list(g) for g in layout.data_groups] == decoder.get_ranks("dp")
    assert [list(g) for g in layout.ep_groups] == expert.get_ranks("ep")
    assert [list(g) for g in layout.edp_groups] == expert.get_ranks("dp")
    for rank in range(world):
        groups = ParallelGroups(layout, rank=rank)
        assert groups.dp_size == groups.data_parallel_size == world // tp
        assert layout.data_group_of(rank)[groups.data_parallel_rank] == rank
        assert layout.ep_group_of(rank)[groups.ep_rank] == rank and groups.ep_size == ep
        assert layout.edp_group_of(rank)[groups.edp_rank] == rank and groups.edp_size == world // ep
        # the ranks of one tp group read the same micro-batch
        assert {ParallelGroups(layout, rank=r).data_parallel_rank for r in layout.tp_group_of(rank)} == {
            groups.data_parallel_rank
        }


def test_tensor_parallel_layout_refuses_in_one_line():
    from moezero.config.options import ConfigError

    with pytest.raises(ConfigError, match="--tensor-model-parallel-size=4: must divide the world size"):
        rank_layout(2, 1, 1, 4)


def test_world_of_one_refuses_tensor_parallelism():
    with pytest.raises(ValueError, match="tensor parallel size 2"):
        ParallelGroups.build(tensor_parallel_size=2)


@pytest.mark.parametrize(
    "world,tp,ep,etp",
    [(2, 2, 1, 2), (2, 1, 1, 2), (4, 2, 2, 2), (4, 1, 2, 2), (4, 2, 1, 2), (4, 2, 1, 4), (8, 2, 2, 2), (8, 4, 2, 2)],
)
def test_expert_tensor_parallel_layout_is_megatrons(world, tp, ep, etp):
    """At etp > 1 the experts' etp, ep and edp groups are megatron-core's expert RankGenerator's (etp fastest), the
    decoder's groups unchanged; every coordinate read from them."""
    from megatron.core.parallel_state import RankGenerator

    layout = rank_layout(world, ep, 1, tp, etp)
    decoder = RankGenerator(tp=tp, ep=1, dp=world // tp, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep), pp=1, cp=1, order="tp-cp-ep-dp-pp")
    assert [list(g) for g in layout.etp_groups] == expert.get_ranks("tp")
    assert [list(g) for g in layout.ep_groups] == expert.get_ranks("ep")
    assert [list(g) for g in layout.edp_groups] == expert.get_ranks("dp")
    assert [list(g) for g in layout.dense_groups] == decoder.get_ranks("dp-cp")
    assert [list(g) for g in layout.data_groups] == decoder.get_ranks("dp")
    assert layout.tensor_parallel_size == tp and layout.expert_tensor_parallel_size == etp
    for rank in range(world):
        groups = ParallelGroups(layout, rank=rank)
        assert layout.ep_group_of(rank)[groups.ep_rank] == rank and groups.ep_size == ep
        assert layout.edp_group_of(rank)[groups.edp_rank] == rank and groups.edp_size == world // (etp * ep)
        assert rank in layout.etp_group_of(rank) and len(layout.etp_group_of(rank)) == etp


@pytest.mark.parametrize("world,tp,ep", [(2, 1, 1), (2, 1, 2), (4, 1, 2), (4, 2, 2), (8, 2, 4)])
def test_expert_tensor_parallel_size_1_is_todays_layout(world, tp, ep):
    """etp 1 (explicit) builds the layout without it: the experts fold ep x edp over all ranks (megatron-core's
    expert RankGenerator at etp 1), no etp group wider than one rank."""
    from megatron.core.parallel_state import RankGenerator

    layout = rank_layout(world, ep, 1, tp, 1)
    expert = RankGenerator(tp=1, ep=ep, dp=world // ep, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    assert layout == rank_layout(world, ep, 1, tp)
    assert [list(g) for g in layout.ep_groups] == expert.get_ranks("ep")
    assert [list(g) for g in layout.edp_groups] == expert.get_ranks("dp")
    assert all(layout.etp_group_of(rank) == (rank,) for rank in range(world))


def test_expert_tensor_parallel_layout_refuses_in_one_line():
    from moezero.config.options import ConfigError

    with pytest.raises(ConfigError, match=r"--expert-tensor-parallel-size=2, --expert-model-parallel-size=2: their"):
        rank_layout(2, 2, 1, 1, 2)
