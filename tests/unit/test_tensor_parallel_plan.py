"""What the tensor-parallel plan (training/tensor_parallel.py) refuses: one line per setting it does not build."""

import dataclasses

import pytest

from moezero.config import GPTConfig, MoEConfig
from moezero.training.tensor_parallel import refusals

GPT = GPTConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    position_embedding_type="rope",
)


def test_a_gqa_gpt_runs_at_tp2():
    config = dataclasses.replace(GPT, group_query_attention=True, num_query_groups=2, qk_layernorm=True)
    assert refusals(config, None, 2, sequence_parallel=True) == []
    moe = MoEConfig(hidden_size=32, ffn_hidden_size=64, num_experts=4, shared_expert_intermediate_size=32)
    assert refusals(config, moe, 2, sequence_parallel=True) == []


@pytest.mark.parametrize(
    "changes,moe,sp,needle",
    [
        (dict(group_query_attention=True, num_query_groups=1), False, False, "--num-query-groups 1"),
        (dict(num_attention_heads=3, hidden_size=36), False, False, "--num-attention-heads 3"),
        (dict(vocab_size=63), False, False, "a vocabulary of 63"),
        (dict(seq_length=15), False, True, "--seq-length 15 must be divisible"),
        (dict(qk_layernorm=True, qk_layernorm_scope="full_width"), False, False, "full-width q/k norms"),
        ({}, True, False, "MoE layers with tensor parallelism need --sequence-parallel"),
    ],
)
def test_refusals_name_the_setting(changes, moe, sp, needle):
    config = dataclasses.replace(GPT, **changes)
    moe_config = MoEConfig(hidden_size=32, ffn_hidden_size=64, num_experts=4, **(moe if isinstance(moe, dict) else {}))
    lines = refusals(config, moe_config if moe else None, 2, sp)
    assert lines and needle in lines[0], lines  # heads not divisible: their query groups are not either


@pytest.mark.parametrize(
    "routing",
    [
        dict(capacity_factor=1.5),
        dict(load_balancing_type=["global_aux_loss"], aux_loss_coeff=[1e-2]),
        dict(load_balancing_type="sinkhorn"),
    ],
)
def test_moe_routing_options_run_at_tp2_with_sp(routing):
    """Decided on the rank's sequence shard, as megatron-core's router (test_tp_model_exactness.py)."""
    moe = MoEConfig(hidden_size=32, ffn_hidden_size=64, num_experts=4, **routing)
    assert refusals(GPT, moe, 2, sequence_parallel=True) == []


def _validate(argv, world):
    from moezero.training.configs import validate
    from tests.integration.pretrain_utils import TINY, configs

    return validate(configs(TINY + argv), world_size=world)


TP2 = ["--tensor-model-parallel-size", "2", "--position-embedding-type", "rope"]


def test_a_tp_run_lists_every_refusal_at_once():
    """TINY's MoE layers at tp 2 without --sequence-parallel (with its capacity factor and Megatron's default
    --expert-tensor-parallel-size = tp, which run), on 3 processes: one ConfigError, a line each."""
    from moezero.config import ConfigError

    with pytest.raises(ConfigError) as info:
        _validate(TP2, 3)
    lines = str(info.value).splitlines()
    assert lines[0] == "--tensor-model-parallel-size=2: must divide the number of processes (3)", lines
    assert "need --sequence-parallel" in lines[1], lines
    assert len(lines) == 2, lines


SP = ["--sequence-parallel", "--moe-expert-capacity-factor", "-1"]


@pytest.mark.parametrize(
    "argv,world,expected",
    [
        (
            ["--expert-tensor-parallel-size", "2"],
            3,
            ["--expert-tensor-parallel-size=2: must divide the world size (3)"],
        ),
        (
            ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2"],
            2,
            [
                "--expert-tensor-parallel-size=2, --expert-model-parallel-size=2: their product (4) must divide the "
                "world size (2)"
            ],
        ),
        (
            ["--expert-tensor-parallel-size", "3"],
            3,
            [
                "--expert-tensor-parallel-size=3: must divide the experts' ffn size (128, --moe-ffn-hidden-size) and "
                "--hidden-size (32)"
            ],
        ),
        (
            TP2 + SP + ["--expert-tensor-parallel-size", "4"],
            2,
            ["--expert-tensor-parallel-size=4: must divide the world size (2)"],
        ),
    ],
)
def test_expert_tensor_parallel_refusals_are_one_line_each(argv, world, expected):
    """Megatron's sizes (world % (etp x ep x pp)), the experts' widths and what needs whole weights, at tp 1 and 2
    (at tp 2 the flags tp refuses are tp's lines)."""
    from moezero.config import ConfigError

    with pytest.raises(ConfigError) as info:
        _validate(argv, world)
    assert str(info.value).splitlines() == expected


def test_expert_tensor_parallel_runs_at_tp_1_and_at_tps_default():
    """tp 1 etp 2 and tp 2 with its default etp (2) validate on 2 and 4 processes: the micro-steps of their dp."""
    assert _validate(["--expert-tensor-parallel-size", "2", "--moe-expert-capacity-factor", "-1"], 2) == 2
    # --save-hf (moezero/hf/slice_gather.py) and Muon (per --muon-tp-mode) run at etp 2 and tp 2
    muon = ["--save-hf", "out", "--optimizer", "muon", "--muon-tp-mode", "duplicated"]
    assert _validate(["--expert-tensor-parallel-size", "2", "--moe-expert-capacity-factor", "-1"] + muon, 2) == 2
    assert _validate(TP2 + SP + muon, 4) == 2
    assert _validate(TP2 + SP, 4) == 2
    assert configs_etp(TP2 + SP) == 2 and configs_etp([]) == 1


def configs_etp(argv):
    from tests.integration.pretrain_utils import TINY, configs

    return configs(TINY + argv).parallel.expert_tensor_parallel


def test_tp_ranks_read_the_same_micro_batches():
    """tp 2 on 4 processes: 2 data-parallel ranks deal TINY's batch of 8 (2 per micro-batch x 2 ranks x 2 steps)."""
    argv = TP2 + ["--sequence-parallel", "--expert-tensor-parallel-size", "1", "--moe-expert-capacity-factor", "-1"]
    assert _validate(argv, 4) == 2


def test_sequence_parallel_at_tp1_is_turned_off_with_megatrons_warning():
    from moezero.training.tensor_parallel_checks import sequence_parallel_notice
    from tests.integration.pretrain_utils import TINY, configs

    assert sequence_parallel_notice(configs(TINY + ["--sequence-parallel"])) == [
        " --sequence-parallel: off at --tensor-model-parallel-size 1 (Megatron's: it needs tensor parallelism)"
    ]
    assert sequence_parallel_notice(configs(TINY + TP2 + ["--sequence-parallel"])) == []
    assert sequence_parallel_notice(configs(TINY)) == []


def test_tp_with_pipeline_stages_deals_batches_and_runs_mtp():
    """tp 2 x pp 2 on 4 processes: one data-parallel rank deals TINY's batch of 8 (4 micro-batches of 2); MTP depths
    run there (on the last stage: tests/integration/test_tensor_parallel_pipeline.py)."""
    argv = TP2 + ["--sequence-parallel", "--expert-tensor-parallel-size", "1", "--moe-expert-capacity-factor", "-1"]
    argv += ["--pipeline-model-parallel-size", "2"]
    assert _validate(argv, 4) == 4
    assert _validate(argv + ["--mtp-num-layers", "1", "--position-embedding-type", "rope"], 4) == 4


def test_expert_tensor_parallel_validates_with_pipeline_stages_and_context_parallelism():
    """Megatron's default etp (tp) and an explicit etp 2 validate at tp 2 x pp 2 and tp 2 x cp 2 on 4 processes (the
    runs: tests/integration/test_tensor_parallel_pipeline.py and test_tensor_parallel_context.py); Megatron's
    world % (etp x ep x pp) still refuses ep 2 beside them, in one line."""
    from moezero.config import ConfigError

    tpsp = TP2 + ["--sequence-parallel", "--moe-expert-capacity-factor", "-1"]
    for other, micro_steps in ((["--pipeline-model-parallel-size", "2"], 4), (["--context-parallel-size", "2"], 4)):
        assert _validate(tpsp + other, 4) == micro_steps
        assert _validate(tpsp + other + ["--expert-tensor-parallel-size", "2"], 4) == micro_steps
    with pytest.raises(ConfigError) as info:
        _validate(tpsp + ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"], 4)
    assert str(info.value) == (
        "--expert-tensor-parallel-size=2, --expert-model-parallel-size=2, --pipeline-model-parallel-size=2: their "
        "product (8) must divide the world size (4)"
    )


def test_the_default_global_batch_counts_the_data_parallel_ranks_of_every_layout():
    """Without --global-batch-size Megatron's is micro-batch x dp, dp = processes / (tp x pp x cp): the notice says
    the size the run uses (validate's), naming the sizes it divided by."""
    from moezero.training.pretrain import default_global_batch_notice
    from tests.integration.pretrain_utils import configs

    argv = [a for i, a in enumerate(TP2) if "global-batch" not in a and "global-batch" not in TP2[i - 1]]
    cfg = configs(argv + ["--pipeline-model-parallel-size", "2"])
    assert default_global_batch_notice(cfg, 8) == (
        "setting global batch size to 8 (--micro-batch-size x the number of processes / "
        "--tensor-model-parallel-size / --pipeline-model-parallel-size; no --global-batch-size given)"
    )


def test_qat_activation_bits_on_tensor_parallel_shards_are_refused_in_one_line():
    """Weight scales are computed over the shards, but an activation's are per token, and a row-parallel layer's
    token is split over tp (etp): --qat-activation-bits is refused there in one line, before the plugin touches
    the model; weight-only QAT passes."""
    from moezero.config import ConfigError
    from moezero.recipe import attach_qat, refuse_qat_on_shards
    from tests.integration.pretrain_utils import TINY, configs

    qat = ["--qat-weight-bits", "8", "--qat-activation-bits", "8"]
    with pytest.raises(ConfigError) as info:
        attach_qat(None, None, configs(TINY + qat + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]))
    assert str(info.value) == (
        "--qat-activation-bits=8: not supported with --tensor-model-parallel-size=2, --expert-tensor-parallel-size=2 "
        "yet (a row-parallel layer's per-token scales would be each shard's slice of the token's)"
    )
    with pytest.raises(ConfigError, match="not supported with --expert-tensor-parallel-size=2 yet"):
        attach_qat(None, None, configs(TINY + qat + ["--expert-tensor-parallel-size", "2"]))
    refuse_qat_on_shards(configs(TINY + qat + ["--expert-model-parallel-size", "2"]))  # ep splits whole experts
    refuse_qat_on_shards(configs(TINY + qat[:2] + ["--expert-tensor-parallel-size", "2"]))  # weights: over etp


def test_muons_distributed_tp_mode_is_logged_as_run_duplicated():
    from moezero.training.tensor_parallel_checks import muon_tp_mode_notice
    from tests.integration.pretrain_utils import TINY, configs

    distributed = ["--optimizer", "muon", "--muon-tp-mode", "distributed"]
    (line,) = muon_tp_mode_notice(configs(TINY + TP2 + distributed))
    assert line.startswith(" --muon-tp-mode distributed: ") and "as duplicated does" in line
    assert muon_tp_mode_notice(configs(TINY + ["--expert-tensor-parallel-size", "2"] + distributed)) == [line]
    assert muon_tp_mode_notice(configs(TINY + distributed)) == []  # tp 1: every mode is the whole matrix
    assert muon_tp_mode_notice(configs(TINY + TP2 + distributed[:2])) == []  # blockwise, Megatron's default
