"""PipelinePlan (moezero/pipeline/layout.py) against megatron-core 0.16.1 as the oracle: for every flag combination
of a grid, moezero refuses exactly what Megatron refuses (Megatron-LM's validate_args, restated below with its line
numbers; TransformerConfig raising; get_num_layers_to_build / get_transformer_layer_offset asserting when the model
is built), and otherwise every (pipeline rank, virtual stage) holds Megatron's layers (get_transformer_layer_offset,
get_num_layers_to_build, PipelineParallelLayerLayout), MTP depths (get_mtp_layer_offset /
get_mtp_num_layers_to_build), embedding and loss (is_pipeline_first/last_stage). The few combinations Megatron
accepts but builds wrongly are listed and refused on purpose. The micro-batch rule of the interleaved schedule is
checked against Megatron's rule (restated, schedules.py) and torch's ScheduleInterleaved1F1B itself."""

import contextlib
import functools
import itertools
import logging
import warnings
from unittest import mock

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import get_schedule_table
from megatron.core.transformer.multi_token_prediction import get_mtp_layer_offset, get_mtp_num_layers_to_build
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

from moezero.config import ConfigError
from moezero.pipeline import PipelinePlan, StagePiece

logging.getLogger("megatron.core").setLevel(logging.ERROR)  # the layout's pretty print at INFO

FIELDS = (
    "num_layers",
    "mtp_num_layers",
    "pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "overlap_p2p_comm",
)


class Refused(Exception):
    """Megatron refused the flags (validate_args, TransformerConfig, or building the stages)."""


class BuildsWrongly(Exception):
    """Megatron accepted the flags but its stages do not hold every layer exactly once."""


def _validate_args(v):
    """Megatron-LM's validate_args for these flags, megatron/training/arguments.py at tag core_v0.16.1 (the same
    lines up to core_v0.19.0); returns the virtual pipeline size (None without virtual stages)."""
    pp = v["pipeline_model_parallel_size"]
    per_stage, stages = v["num_layers_per_virtual_pipeline_stage"], v["num_virtual_stages_per_pipeline_rank"]
    layout = v["pipeline_model_parallel_layout"]
    first_last = v["decoder_first_pipeline_num_layers"], v["decoder_last_pipeline_num_layers"]
    slots = v["num_layers"] + v["account_for_embedding_in_pipeline_split"] + v["account_for_loss_in_pipeline_split"]
    assert sum(x is not None for x in (per_stage, stages, layout)) <= 1  # arguments.py:503
    if layout is not None:
        num_stages = PipelineParallelLayerLayout.get_num_stages_from_str(layout)  # arguments.py:519
        assert num_stages % pp == 0  # arguments.py:520
        vpp = num_stages // pp  # arguments.py:525
    elif per_stage is not None or stages is not None:
        if stages is None:
            assert first_last == (None, None)  # arguments.py:530
            assert slots % pp == 0  # arguments.py:543
            assert (slots // pp) % per_stage == 0  # arguments.py:547
            vpp = (slots // pp) // per_stage  # arguments.py:549
        else:
            vpp = stages  # arguments.py:552
    else:
        vpp = None
        if first_last == (None, None):
            assert slots % pp == 0  # arguments.py:570
    vpp = None if vpp == 1 else vpp  # arguments.py:526, 553
    if vpp is not None:
        assert pp > (1 if v["overlap_p2p_comm"] else 2)  # arguments.py:574-582
    return vpp


@contextlib.contextmanager
def _pipeline_rank(pp, vpp, pp_rank):
    """megatron-core's parallel_state as on `pp_rank` (its layout and MTP paths read the rank from there)."""
    names = (
        "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
        "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
        "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    )
    saved = [getattr(parallel_state, name) for name in names]
    for name, value in zip(names, (pp_rank, pp, vpp)):
        setattr(parallel_state, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(parallel_state, name, value)


def megatron_pieces(v):
    """Every stage's piece as megatron-core builds it (final_norm by TransformerBlock's rule on its layers)."""
    try:
        vpp = _validate_args(v)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = TransformerConfig(
                num_layers=v["num_layers"],
                hidden_size=8,
                num_attention_heads=1,
                pipeline_dtype=torch.float32,
                pipeline_model_parallel_size=v["pipeline_model_parallel_size"],
                virtual_pipeline_model_parallel_size=vpp,
                mtp_num_layers=v["mtp_num_layers"],
                num_layers_in_first_pipeline_stage=v["decoder_first_pipeline_num_layers"],
                num_layers_in_last_pipeline_stage=v["decoder_last_pipeline_num_layers"],
                pipeline_model_parallel_layout=v["pipeline_model_parallel_layout"],
                account_for_embedding_in_pipeline_split=v["account_for_embedding_in_pipeline_split"],
                account_for_loss_in_pipeline_split=v["account_for_loss_in_pipeline_split"],
            )
        pp, virtual = config.pipeline_model_parallel_size, vpp or 1
        counts = {}
        for pp_rank, vp in itertools.product(range(pp), range(virtual)):
            vp_stage = vp if vpp else None
            with _pipeline_rank(pp, vpp, pp_rank):
                counts[vp * pp + pp_rank] = (
                    get_num_layers_to_build(config, vp_stage, pp_rank),
                    get_mtp_layer_offset(config, vp_stage),
                    get_mtp_num_layers_to_build(config, vp_stage, pp_rank),
                    parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                )
        offsets = {}
        for pp_rank, vp in itertools.product(range(pp), range(virtual)):
            with _pipeline_rank(pp, vpp, pp_rank):
                offsets[vp * pp + pp_rank] = get_transformer_layer_offset(config, vp if vpp else None, pp_rank)
    except (AssertionError, ValueError, IndexError) as e:  # IndexError: validate_layer_layout on an empty layout
        raise Refused(e) from e
    pieces = []
    for stage in range(pp * virtual):
        count, mtp_offset, mtp_count, first, last = counts[stage]
        layers = tuple(range(offsets[stage], offsets[stage] + count))
        final_norm = (v["num_layers"] - 1 in layers) if v["mtp_num_layers"] else last
        pieces.append(
            StagePiece(
                stage,
                stage % pp,
                stage // pp,
                layers,
                first,
                final_norm,
                last,
                tuple(range(mtp_offset, mtp_offset + mtp_count)),
            )
        )
    held = [layer for piece in pieces for layer in piece.layers]
    if held != list(range(v["num_layers"])) or min(c[0] for c in counts.values()) < 0:
        raise BuildsWrongly(held)
    return tuple(pieces)


def _values(**given):
    values = dict.fromkeys(FIELDS)
    values.update(
        account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False, overlap_p2p_comm=True
    )
    values.update(given)
    return values


def _compare(v):
    """None when moezero agrees with megatron-core on `v`, else what differs."""
    try:
        theirs = megatron_pieces(v)
    except (Refused, BuildsWrongly) as e:
        theirs = e
    try:
        ours = PipelinePlan(**v).pieces
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("--"), str(e)  # one line, naming a flag first
        ours = e
    if isinstance(theirs, Exception) != isinstance(ours, Exception):
        return f"{v}: megatron {theirs!r} moezero {ours!r}"
    if not isinstance(ours, Exception) and ours != theirs:
        return f"{v}: megatron {theirs} moezero {ours}"
    return None


def _check_grid(cases):
    differences = [d for d in map(_compare, cases) if d is not None]
    assert not differences, f"{len(differences)} differ, e.g.\n" + "\n".join(differences[:5])


VIRTUAL = [
    {},
    {"num_layers_per_virtual_pipeline_stage": 1},
    {"num_layers_per_virtual_pipeline_stage": 2},
    {"num_layers_per_virtual_pipeline_stage": 3},
    {"num_virtual_stages_per_pipeline_rank": 2},
    {"num_virtual_stages_per_pipeline_rank": 3},
]


def test_the_even_split_is_megatrons():
    """--num-layers over pp (and vpp by either flag), with and without the embedding's / loss's slot, MTP on the
    last stage (and the final norm on the stage of the last layer when that stage is not the last)."""
    cases = [
        _values(
            num_layers=layers,
            pipeline_model_parallel_size=pp,
            mtp_num_layers=mtp,
            account_for_embedding_in_pipeline_split=embedding,
            account_for_loss_in_pipeline_split=loss,
            **virtual,
        )
        for layers in range(1, 13)
        for pp in (1, 2, 3, 4)
        for virtual in VIRTUAL
        for mtp in (None, 1)
        for embedding in (False, True)
        for loss in (False, True)
    ]
    _check_grid(cases)
    accepted = [v for v in cases if not isinstance(_safe_plan(v), Exception)]
    assert len(accepted) > 200 and any(_safe_plan(v).virtual_stages == 3 for v in accepted)


def _safe_plan(v):
    try:
        return PipelinePlan(**v)
    except ConfigError as e:
        return e


# Megatron accepts these but its stages would not hold every layer once (BuildsWrongly), or it crashes building
# them (ZeroDivisionError in get_transformer_layer_offset at pp 2 with both counts and virtual stages)
PP1_COUNTS_NOT_ALL = {
    "pipeline_model_parallel_size": 1,
    "num_layers": 4,
    "decoder_first_pipeline_num_layers": 1,
    "decoder_last_pipeline_num_layers": 2,
}
COUNTS_EXCEED = {
    "pipeline_model_parallel_size": 3,
    "num_layers": 4,
    "decoder_first_pipeline_num_layers": 3,
    "decoder_last_pipeline_num_layers": 3,
}


def test_the_first_and_last_stage_counts_are_megatrons():
    cases = []
    for layers, pp, first, last, virtual, mtp in itertools.product(
        (3, 4, 6, 8, 9, 12),
        (1, 2, 3, 4),
        (None, 1, 2, 3, 4, 6),
        (None, 1, 2, 3, 4, 6),
        [
            {},
            {"num_virtual_stages_per_pipeline_rank": 2},
            {"num_virtual_stages_per_pipeline_rank": 3},
            {"num_layers_per_virtual_pipeline_stage": 2},
        ],
        (None, 1),
    ):
        if first is None and last is None:
            continue
        v = _values(
            num_layers=layers,
            pipeline_model_parallel_size=pp,
            decoder_first_pipeline_num_layers=first,
            decoder_last_pipeline_num_layers=last,
            mtp_num_layers=mtp,
            **virtual,
        )
        both_with_virtual = pp == 2 and first and last and "num_virtual_stages_per_pipeline_rank" in virtual
        if not both_with_virtual:
            cases.append(v)
    _check_grid(cases)
    for wrong in (PP1_COUNTS_NOT_ALL, COUNTS_EXCEED):
        with pytest.raises(BuildsWrongly):
            megatron_pieces(_values(**wrong))
        with pytest.raises(ConfigError, match="--decoder-"):
            PipelinePlan(**wrong)


def test_pp2_with_both_counts_and_virtual_stages_where_megatron_crashes():
    """get_transformer_layer_offset divides by the zero middle ranks there; its layer counts are still right and
    the layers follow in stage order."""
    v = _values(
        num_layers=12,
        pipeline_model_parallel_size=2,
        decoder_first_pipeline_num_layers=4,
        decoder_last_pipeline_num_layers=8,
        num_virtual_stages_per_pipeline_rank=2,
    )
    config = TransformerConfig(
        num_layers=12,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        num_layers_in_first_pipeline_stage=4,
        num_layers_in_last_pipeline_stage=8,
    )
    with pytest.raises(ZeroDivisionError):
        get_transformer_layer_offset(config, 0, 1)
    counts = [get_num_layers_to_build(config, stage // 2, stage % 2) for stage in range(4)]
    assert counts == [2, 4, 2, 4]
    assert [p.layers for p in PipelinePlan(**v).pieces] == [(0, 1), (2, 3, 4, 5), (6, 7), (8, 9, 10, 11)]


# (pp, layout, mtp depths) from Megatron-LM: the DeepSeek-V3 recipe's (Megatron-MoE-ModelZoo
# best_practice/DeepSeekV3/run.sh, PP 8 x VPP 4, and its long-context one), the docs' and the brief's DeepSeek-V3
# forms, megatron-core's own layout tests (test_transformer_block.py) and functional test cases
LAYOUTS = [
    (8, "Et|(tt|)*30mL", 1),
    (8, "Et*2|(tt|)*22t|(tt|)*7mL", 1),
    (16, "Et*3|(tt|)*29,m|L", 1),
    (8, "Et*3|(tt|)*29,m|L", 1),
    (16, "Et*3|(tt|)*29m|L", 1),
    (16, "Et*2|(tt|)*29,t|mL", 1),
    (2, "Et|t*4|t|tL", 0),
    (2, "E|t*6|t|L", 0),
    (4, "E|t|t*2|t||(t|)*2,t*2,L", 0),
    (4, "Et*2|(tt|)*5t|tmL", 1),
    (2, "Et*7|t*7mL", 1),
    (2, "Et*3|(tt|)*6tmL", 1),
    (2, "Et*3|(tt|)*6mL", 1),
    (2, "Et|(tt|)*6mL", 1),
    (1, "EttttL", 0),
    (3, "|Et|tL", 0),
    (3, "Et|tL|", 0),
]
OTHER_LAYOUTS = [
    "tE|tL",
    "Et|tLL",
    "EtL|tL",
    "Et|m|tL",
    "mEt|tL",
    "Et|tmm|L",
    "Etm|tmL",
    "Et|tx|L",  # mostly refused
    "E((t|)*2)*2L",
    "Et*|tL",
    "Ett|tt|mL",
    "E t|tL",
    "",
    "Et|ttL|m",
    "Etm|tL",
    "Et|tt|mL|||",
    "Et|tm|mL",
    "Et|EtL",
]


def _decoders(layout):
    return sum(stage.count(LayerType.decoder) for stage in PipelineParallelLayerLayout.parse_str_to_list(layout))


def test_layouts_are_megatrons():
    cases = []
    for pp, layout, mtp in LAYOUTS:
        decoders = _decoders(layout)
        for depths, num_layers, size, overlap in itertools.product(
            {mtp, mtp + 1}, (decoders, decoders + 1), {pp, 1, 2, 4}, (True, False)
        ):
            cases.append(
                _values(
                    num_layers=num_layers,
                    pipeline_model_parallel_size=size,
                    overlap_p2p_comm=overlap,
                    pipeline_model_parallel_layout=layout,
                    mtp_num_layers=depths or None,
                )
            )
    for layout, pp, depths in itertools.product(OTHER_LAYOUTS, (1, 2, 3), (None, 1, 2)):
        try:
            num_layers = _decoders(layout)
        except AssertionError:  # a character Megatron's parser refuses
            num_layers = 4
        cases.append(
            _values(
                num_layers=num_layers,
                pipeline_model_parallel_size=pp,
                pipeline_model_parallel_layout=layout,
                mtp_num_layers=depths,
            )
        )
    _check_grid(cases)
    # and it is not all refusals: every listed layout at its own pp builds
    for pp, layout, mtp in LAYOUTS:
        PipelinePlan(_decoders(layout), mtp or None, pp, pipeline_model_parallel_layout=layout)


def test_the_deepseek_v3_recipe():
    """PP 8 x VPP 4 from the layout alone; rank 0's first stage holds the embedding and layer 0, the last stage only
    the MTP depth and the loss, so the final norm sits with layers 59 and 60 on rank 6's last stage."""
    plan = PipelinePlan(61, 1, 8, pipeline_model_parallel_layout="Et|(tt|)*30mL")
    assert (plan.regime, plan.virtual_stages, plan.num_stages) == ("layout", 4, 32)
    assert plan.piece(0, 0) == StagePiece(0, 0, 0, (0,), True, False, False, ())
    assert plan.piece(7, 3) == StagePiece(31, 7, 3, (), False, False, True, (0,))
    assert plan.piece(6, 3).layers == (59, 60) and plan.piece(6, 3).final_norm
    assert [p.stage_index for p in plan.pieces_of(1)] == [1, 9, 17, 25]
    assert plan.stage_of_layer(60).stage_index == 30 and not plan.mtp_standalone
    plan.check_supported()
    standalone = PipelinePlan(61, 1, 16, pipeline_model_parallel_layout="Et*3|(tt|)*29,m|L")
    assert standalone.mtp_standalone and standalone.piece(14, 1).mtp == (0,)
    with pytest.raises(ConfigError, match="pipeline rank 14 .*not supported yet"):
        standalone.check_supported()
    with pytest.raises(ConfigError, match="stage 4 holds nothing"):
        PipelinePlan(8, None, 4, pipeline_model_parallel_layout="E|t|t*2|t||(t|)*2,t*2,L").check_supported()


def test_mixtral_8x7b_example():
    """Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh: 32 layers at pp 4 (8 a rank), and its
    functional test with --num-layers-per-virtual-pipeline-stage 1 (vpp 8: rank r holds r, r + 4, ...)."""
    plan = PipelinePlan(32, pipeline_model_parallel_size=4)
    assert [p.layers for p in plan.pieces] == [tuple(range(8 * r, 8 * r + 8)) for r in range(4)]
    interleaved = PipelinePlan(32, pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=1)
    assert interleaved.virtual_stages == 8
    assert [p.layers for p in interleaved.pieces_of(1)] == [(1 + 4 * v,) for v in range(8)]
    assert (
        _compare(_values(num_layers=32, pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=1))
        is None
    )


@pytest.mark.parametrize(
    "given,message",
    [
        (
            dict(num_layers=8, pipeline_model_parallel_size=3),
            "--num-layers=8: must be divisible by --pipeline-model-parallel-size=3",
        ),
        (
            dict(num_layers=8, pipeline_model_parallel_size=2, account_for_loss_in_pipeline_split=True),
            "--num-layers=8 + 1 for --account-for-loss-in-pipeline-split: must be divisible by",
        ),
        (
            dict(num_layers=8, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=3),
            "--num-layers-per-virtual-pipeline-stage=3: must divide the layers per pipeline rank (4",
        ),
        (
            dict(num_layers=6, pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2),
            "--num-virtual-stages-per-pipeline-rank=2: must divide the layers per pipeline rank (3",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=2,
                num_layers_per_virtual_pipeline_stage=2,
                num_virtual_stages_per_pipeline_rank=2,
            ),
            "at most one of these may be given",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=2,
                pipeline_model_parallel_layout="Ettt|ttttL",
                decoder_first_pipeline_num_layers=3,
            ),
            "the layout cannot be combined with them",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=4,
                decoder_first_pipeline_num_layers=2,
                account_for_embedding_in_pipeline_split=True,
            ),
            "--decoder-first-pipeline-num-layers=2, --account-for-embedding-in-pipeline-split: the first/last",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=4,
                decoder_last_pipeline_num_layers=2,
                num_layers_per_virtual_pipeline_stage=1,
            ),
            "give the virtual stages with --num-virtual-stages-per-",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=4,
                decoder_first_pipeline_num_layers=3,
                num_virtual_stages_per_pipeline_rank=2,
            ),
            "--decoder-first-pipeline-num-layers=3: must be divisible by",
        ),
        (
            dict(num_layers=8, pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=3),
            "the 5 other layers of --num-layers=8 must be divisible by the 3 middle ranks",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=2,
                decoder_first_pipeline_num_layers=3,
                decoder_last_pipeline_num_layers=3,
            ),
            "leave 2 layers of --num-layers=8 for 0 middle ranks",
        ),
        (
            dict(num_layers=8, pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=0),
            "--decoder-first-pipeline-num-layers=0: must be >= 1",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=2,
                num_virtual_stages_per_pipeline_rank=2,
                overlap_p2p_comm=False,
            ),
            "--pipeline-model-parallel-size=2, --no-overlap-p2p-communication",
        ),
        (
            dict(num_layers=8, pipeline_model_parallel_size=1, num_virtual_stages_per_pipeline_rank=2),
            "--pipeline-model-parallel-size=1: 2 virtual stages per rank need it > 1",
        ),
        (
            dict(num_layers=8, pipeline_model_parallel_size=3, pipeline_model_parallel_layout="Ettt|ttttL"),
            "its 2 stages must be divisible by --pipeline-model-parallel-size (3)",
        ),
        (
            dict(num_layers=8, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ettt|ttttL"),
            "it holds 7 decoder layers ('t'), --num-layers is 8",
        ),
        (
            dict(
                num_layers=4, mtp_num_layers=1, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett|ttL"
            ),
            "it holds 0 MTP depths ('m'), --mtp-num-layers is 1",
        ),
        (
            dict(num_layers=4, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett|tt?L"),
            "unknown layer character '?'",
        ),
    ],
)
def test_refusals_name_the_flags(given, message):
    with pytest.raises(ConfigError) as info:
        PipelinePlan(**given)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert _compare(_values(**given)) is None  # and Megatron refuses it too


def _megatron_interleaved_accepts(pp, m, g):
    """megatron-core pipeline_parallel/schedules.py:996-1015 (forward_backward_pipelining_with_interleaving, which
    reaches these checks only with a CUDA device)."""
    return pp <= g <= m and not 0 < m % g < pp


@functools.lru_cache(maxsize=None)
def _mock_stage(pp, virtual):
    """A PipelineStage of rank 0 as torch's schedule visualizer mocks it (_schedule_visualizer.get_schedule_ops)."""
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, pp, None, pp * virtual
    return stage


def _torch_interleaved(pp, virtual, m):
    """torch's ScheduleInterleaved1F1B for M micro-batches: its micro-batches per round and rank 0's forwards as
    (micro-batch, virtual stage), or None where it refuses M."""
    try:
        schedule = ScheduleInterleaved1F1B([_mock_stage(pp, virtual)] * virtual, m)
    except ValueError:
        return None
    forwards = [
        (a.microbatch_index, a.stage_index // pp)
        for a in schedule.pipeline_order[0]
        if a is not None and a.computation_type.name == "FORWARD"
    ]
    return schedule.microbatches_per_round, forwards


def test_the_interleaved_schedules_micro_batches():
    """Accepted: Megatron runs M with groups of g and torch's schedule runs the same groups (rank 0's forward order
    equals Megatron's schedule table); every other (M, g) is refused in one line."""
    accepted = 0
    for pp, virtual, m in itertools.product((2, 3, 4), (2, 3), range(1, 19)):
        torch_runs = _torch_interleaved(pp, virtual, m)
        for group in (None, 2, 3, 4, 5, 6, 8):
            plan = PipelinePlan(
                pp * virtual * 2,
                pipeline_model_parallel_size=pp,
                num_virtual_stages_per_pipeline_rank=virtual,
                microbatch_group_size_per_virtual_pipeline_stage=group,
            )
            g = group or pp
            runs = _megatron_interleaved_accepts(pp, m, g) and torch_runs is not None and torch_runs[0] == g
            try:
                plan.check_num_microbatches(m)
            except ConfigError as e:
                assert not runs and "\n" not in str(e) and str(e).startswith("--microbatch-group-size"), (pp, m, g, e)
                continue
            assert runs, (pp, virtual, m, g)
            assert torch_runs[1] == get_schedule_table(m, virtual, g), (pp, virtual, m, g)
            accepted += 1
    assert accepted > 50
    # the default group size (pp) takes exactly the multiples of pp
    plan = PipelinePlan(8, pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2)
    for m in (2, 4, 6, 8):
        plan.check_num_microbatches(m)
    for m in (1, 3, 5):
        with pytest.raises(ConfigError, match="--microbatch-group-size-per-virtual-pipeline-stage"):
            plan.check_num_microbatches(m)
    PipelinePlan(8, pipeline_model_parallel_size=2).check_num_microbatches(1)  # 1F1B takes any M
    with pytest.raises(ConfigError, match="0 micro-batches per step"):
        plan.check_num_microbatches(0)


def test_pp1_is_one_stage_and_the_fingerprint_tells_plans_apart():
    plan = PipelinePlan(4, 2)
    assert plan.pieces == (StagePiece(0, 0, 0, (0, 1, 2, 3), True, True, True, (0, 1)),)
    assert plan.regime == "even" and plan.num_stages == 1
    plans = [
        PipelinePlan(8, None, 2),
        PipelinePlan(8, None, 2, num_virtual_stages_per_pipeline_rank=2),
        PipelinePlan(8, None, 2, decoder_first_pipeline_num_layers=3),
        PipelinePlan(8, None, 4),
        PipelinePlan(8, 1, 2),
    ]
    assert len({p.fingerprint() for p in plans}) == len(plans)
    assert PipelinePlan(8, None, 2).fingerprint() == PipelinePlan(8, None, 2).fingerprint()
