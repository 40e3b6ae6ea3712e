"""pipeline_rank_layout (moezero/pipeline/ranks.py) against megatron-core 0.16.1, at tp = cp = 1: the groups, their
order and each group's rank order from its RankGenerator (decoder and expert foldings, as initialize_model_parallel
builds them), the embedding groups from default_embedding_ranks, and the refusals from initialize_model_parallel
itself (run up to its first group creation with torch.distributed's world faked)."""

import itertools
from unittest import mock

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.parallel_state import RankGenerator, default_embedding_ranks, default_position_embedding_ranks

from moezero.config import ConfigError
from moezero.parallel import rank_layout
from moezero.parallel.ranks import megatron_rank_layout
from moezero.pipeline import pipeline_rank_layout


def _order(use_tp_pp_dp_mapping):
    return "tp-cp-ep-pp-dp" if use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp"  # Megatron-LM initialize.py:378


class _Accepted(Exception):
    """initialize_model_parallel got past its checks to its first process group."""


def megatron_refusal(world, ep, pp, mapping, **sizes):
    """initialize_model_parallel's refusal of these sizes (None: it accepts them); `sizes`: its other sizes
    (tensor_model_parallel_size, context_parallel_size, expert_tensor_parallel_size)."""
    with (
        mock.patch.object(torch.distributed, "is_initialized", return_value=True),
        mock.patch.object(torch.distributed, "get_world_size", return_value=world),
        mock.patch.object(torch.distributed, "get_rank", return_value=0),
        mock.patch.object(parallel_state, "create_group", side_effect=_Accepted),
    ):
        try:
            parallel_state.initialize_model_parallel(
                pipeline_model_parallel_size=pp, expert_model_parallel_size=ep, order=_order(mapping), **sizes
            )
        except _Accepted:
            return None
        except (RuntimeError, AssertionError) as e:
            return str(e) or type(e).__name__


def megatron_groups(world, ep, pp, mapping):
    decoder = RankGenerator(tp=1, ep=1, dp=world // pp, pp=pp, cp=1, order=_order(mapping))
    expert = RankGenerator(tp=1, ep=ep, dp=world // (ep * pp), pp=pp, cp=1, order=_order(mapping))
    pp_groups = decoder.get_ranks("pp")
    return {
        "dp_groups": decoder.get_ranks("dp"),
        "pp_groups": pp_groups,
        "ep_groups": expert.get_ranks("ep"),
        "edp_groups": expert.get_ranks("dp"),
        "embedding_groups": [default_embedding_ranks(group) for group in pp_groups],
        "position_embedding_groups": [default_position_embedding_ranks(group) for group in pp_groups],
    }


def test_the_groups_and_refusals_are_megatrons():
    accepted = refused = 0
    for world, ep, pp, mapping in itertools.product(
        (1, 2, 3, 4, 6, 8, 12, 16), (1, 2, 3, 4, 8), (1, 2, 3, 4, 8), (False, True)
    ):
        theirs = megatron_refusal(world, ep, pp, mapping)
        try:
            ours = pipeline_rank_layout(world, ep, pp, mapping)
        except ConfigError as e:
            assert theirs is not None, (world, ep, pp, mapping, e)
            assert "\n" not in str(e) and str(e).startswith("--"), str(e)
            refused += 1
            continue
        assert theirs is None, (world, ep, pp, mapping, theirs)
        for kind, groups in megatron_groups(world, ep, pp, mapping).items():
            assert [list(group) for group in getattr(ours, kind)] == groups, (world, ep, pp, mapping, kind)
        accepted += 1
    assert accepted > 60 and refused > 60


@pytest.mark.parametrize("world,ep", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4)])
def test_at_pp1_the_groups_are_rank_layouts(world, ep):
    ours, today = pipeline_rank_layout(world, ep), rank_layout(world, ep)
    assert (ours.ep_groups, ours.edp_groups) == (today.ep_groups, today.edp_groups)
    assert ours.dp_groups == (tuple(range(world)),) and ours.pp_groups == tuple((r,) for r in range(world))


def test_rank_coordinates():
    layout = pipeline_rank_layout(8, 2, 2)  # dp {0..3} {4..7}, pp {0,4} ..., ep {0,1} ...
    assert [layout.pp_rank_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.dp_rank_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [layout.ep_rank_of(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    mapped = pipeline_rank_layout(8, 1, 4, use_tp_pp_dp_mapping=True)  # pp {0,1,2,3} {4,5,6,7}
    assert [mapped.pp_rank_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert mapped.embedding_groups == ((0, 3), (4, 7)) and mapped.position_embedding_groups == ((0,), (4,))


@pytest.mark.parametrize(
    "sizes,message",
    [
        ((6, 1, 4, False), "--pipeline-model-parallel-size=4: must divide the world size (6)"),
        (
            (8, 4, 4, False),
            "--expert-model-parallel-size=4, --pipeline-model-parallel-size=4: their product (16) must "
            "divide the world size (8)",
        ),
        ((8, 2, 2, True), "--use-tp-pp-dp-mapping, --expert-model-parallel-size=2, --pipeline-model-parallel-size=2: "),
        ((4, 0, 1, False), "--expert-model-parallel-size=0: must be >= 1"),
    ],
)
def test_refusals_name_the_flags(sizes, message):
    with pytest.raises(ConfigError) as info:
        pipeline_rank_layout(*sizes)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_every_dimensions_groups_and_refusals_are_megatrons():
    """megatron_rank_layout (moezero/parallel/ranks.py) with tp, cp and etp too: every decoder and expert kind equals
    megatron-core's RankGenerator's, and it refuses exactly the sizes initialize_model_parallel refuses."""
    accepted = refused = 0
    for world, tp, cp, ep, etp, pp, mapping in itertools.product(
        (1, 2, 4, 6, 8, 16), (1, 2, 4), (1, 2), (1, 2, 4), (None, 1, 2), (1, 2), (False, True)
    ):
        sizes = dict(tensor_model_parallel_size=tp, context_parallel_size=cp, expert_tensor_parallel_size=etp)
        theirs = megatron_refusal(world, ep, pp, mapping, **sizes)
        try:
            ours = megatron_rank_layout(world, tp, cp, ep, etp, pp, mapping)
        except ConfigError as e:
            assert theirs is not None, (world, tp, cp, ep, etp, pp, mapping, e)
            assert "\n" not in str(e) and str(e).startswith("--"), str(e)
            refused += 1
            continue
        assert theirs is None, (world, tp, cp, ep, etp, pp, mapping, theirs)
        etp = tp if etp is None else etp
        decoder = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order=_order(mapping))
        expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=_order(mapping))
        for partitions, generator in ((ours.decoder, decoder), (ours.expert, expert)):
            for kind, groups in partitions.items():
                assert [list(group) for group in groups] == generator.get_ranks(kind), (world, tp, cp, ep, etp, kind)
        accepted += 1
    assert accepted > 400 and refused > 400


@pytest.mark.parametrize(
    "sizes,message",
    [
        ((8, 2, 2, 1, None, 4), "--tensor-model-parallel-size=2, --context-parallel-size=2, "),
        ((3, 1, 1, 1, 2, 1), "--expert-tensor-parallel-size=2: must divide the world size (3)"),
        ((4, 1, 1, 4, 2, 1), "--expert-tensor-parallel-size=2, --expert-model-parallel-size=4: their product (8)"),
        ((4, 1, 1, 1, 0, 1), "--expert-tensor-parallel-size=0: must be >= 1"),
    ],
)
def test_every_dimensions_refusals_name_their_flags(sizes, message):
    with pytest.raises(ConfigError) as info:
        megatron_rank_layout(*sizes)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_with_context_parallelism_the_groups_are_megatrons():
    """pipeline_rank_layout at cp > 1: the dense params' group is megatron-core's dp-cp, the micro-batches' its dp,
    the cp groups its cp (RankGenerator's, as initialize_model_parallel builds them); the experts fold cp in."""
    checked = 0
    for world, cp, ep, pp, mapping in itertools.product((4, 8, 16), (2, 4), (1, 2, 4), (2, 4), (False, True)):
        try:
            ours = pipeline_rank_layout(world, ep, pp, mapping, context_parallel_size=cp)
        except ConfigError:
            assert megatron_refusal(world, ep, pp, mapping, context_parallel_size=cp) is not None
            continue
        decoder = RankGenerator(tp=1, ep=1, dp=world // (cp * pp), pp=pp, cp=cp, order=_order(mapping))
        expert = RankGenerator(tp=1, ep=ep, dp=world // (ep * pp), pp=pp, cp=1, order=_order(mapping))
        for kind, generator, groups in (
            ("dp-cp", decoder, ours.dp_groups),
            ("dp", decoder, ours.data_parallel_groups),
            ("cp", decoder, ours.cp_groups),
            ("pp", decoder, ours.pp_groups),
            ("ep", expert, ours.ep_groups),
            ("dp", expert, ours.edp_groups),
        ):
            assert [list(group) for group in groups] == generator.get_ranks(kind), (world, cp, ep, pp, mapping, kind)
        checked += 1
    assert checked > 20
    layout = pipeline_rank_layout(4, 1, 2, context_parallel_size=2)  # the task's layout: docs/megatron.md
    assert (layout.cp_groups, layout.pp_groups, layout.dp_groups) == (
        ((0, 1), (2, 3)),
        ((0, 2), (1, 3)),
        ((0, 1), (2, 3)),
    )
    assert [layout.cp_rank_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert [layout.data_parallel_rank_of(r) for r in range(4)] == [0, 0, 0, 0]
