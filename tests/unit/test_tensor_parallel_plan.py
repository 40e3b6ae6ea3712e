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
        ({}, dict(capacity_factor=1.5), True, "--moe-expert-capacity-factor 1.5"),
    ],
)
def test_refusals_name_the_setting(changes, moe, sp, needle):
    config = dataclasses.replace(GPT, **changes)
    moe_config = MoEConfig(hidden_size=32, ffn_hidden_size=64, num_experts=4, **(moe if isinstance(moe, dict) else {}))
    lines = refusals(config, moe_config if moe else None, 2, sp)
    assert lines and needle in lines[0], lines  # heads not divisible: their query groups are not either


def _validate(argv, world):
    from moezero.training.configs import validate
    from tests.integration.pretrain_utils import TINY, configs

    return validate(configs(TINY + argv), world_size=world)


TP2 = ["--tensor-model-parallel-size", "2", "--position-embedding-type", "rope"]


def test_a_tp_run_lists_every_refusal_at_once():
    """TINY's MoE layers at tp 2 without --sequence-parallel, with its capacity factor and Megatron's default
    --expert-tensor-parallel-size (= tp), on 3 processes: one ConfigError, a line each."""
    from moezero.config import ConfigError

    with pytest.raises(ConfigError) as info:
        _validate(TP2, 3)
    lines = str(info.value).splitlines()
    assert lines[0] == "--tensor-model-parallel-size=2: must divide the number of processes (3)", lines
    assert lines[1].startswith("--expert-tensor-parallel-size=2 (Megatron default: --tensor-model-parallel-size)")
    assert "pass --expert-tensor-parallel-size 1" in lines[1]
    assert "need --sequence-parallel" in lines[2] and "--moe-expert-capacity-factor 1.5" in lines[3], lines
    assert len(lines) == 4, lines


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


def test_tp_with_pipeline_stages_deals_batches_and_refuses_mtp_in_one_line():
    """tp 2 x pp 2 on 4 processes: one data-parallel rank deals TINY's batch of 8 (4 micro-batches of 2); MTP depths
    are not run there yet: one line naming both sizes."""
    from moezero.config import ConfigError

    argv = TP2 + ["--sequence-parallel", "--expert-tensor-parallel-size", "1", "--moe-expert-capacity-factor", "-1"]
    argv += ["--pipeline-model-parallel-size", "2"]
    assert _validate(argv, 4) == 4
    with pytest.raises(ConfigError) as info:
        _validate(argv + ["--mtp-num-layers", "1"], 4)
    assert str(info.value) == (
        "--mtp-num-layers=1: not supported with --tensor-model-parallel-size > 1 and pipeline stages yet "
        "(--tensor-model-parallel-size=2, --pipeline-model-parallel-size=2)"
    )
