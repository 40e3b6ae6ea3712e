"""Combinations of flags megatron-core 0.16.1 refuses are refused at start, each checked against megatron-core's own
TransformerConfig (its __post_init__) or DistributedDataParallel: the refused combination raises there and here, a
neighbour both accept passes here. Megatron-LM's validate_args is not installed (megatron-core only): its rules
are quoted from core_v0.16.1's megatron/training/arguments.py."""

import re

import pytest
import torch

from moezero.config import ConfigError
from moezero.training.configs import moe_comm_overlap_notices, interleaves_micro_batches, validate
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, configs
from tests.megatron_oracle import CPU_BUILD, megatron_on_cpu

pytest.importorskip("megatron.core")

EP2 = ["--expert-model-parallel-size", "2"]
OVERLAP = ["--overlap-moe-expert-parallel-comm", "--moe-token-dispatcher-type", "alltoall"] + EP2
SHARED = ["--moe-shared-expert-intermediate-size", "16", "--disable-bias-linear"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
MOE = dict(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False)
THEIR_OVERLAP = dict(
    MOE,
    overlap_moe_expert_parallel_comm=True,
    expert_model_parallel_size=2,
    bf16=True,
    moe_token_dispatcher_type="alltoall",
)
THEIR_FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)

# (refused flags after TINY (which has a capacity factor), moezero's message, megatron-core's TransformerConfig fields
# for the same, a neighbour both accept:
# flags, fields)
RULES = [
    (
        ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0"],
        "--moe-expert-capacity-factor: only with --moe-router-load-balancing-type aux_loss, seq_aux_loss, "
        "global_aux_loss or none, not sinkhorn",
        dict(MOE, moe_expert_capacity_factor=1.5, moe_router_load_balancing_type="sinkhorn"),
        ["--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0"],
        dict(MOE, moe_expert_capacity_factor=1.5, moe_router_load_balancing_type="none"),
    ),
    (
        SHARED + ["--moe-shared-expert-overlap"],
        "--moe-shared-expert-overlap: only with --moe-token-dispatcher-type alltoall, not allgather",
        dict(MOE, moe_shared_expert_intermediate_size=16, moe_shared_expert_overlap=True),
        SHARED + ["--moe-shared-expert-overlap", "--moe-token-dispatcher-type", "alltoall"],
        dict(
            MOE,
            moe_shared_expert_intermediate_size=16,
            moe_shared_expert_overlap=True,
            moe_token_dispatcher_type="alltoall",
        ),
    ),
    (
        ["--recompute-granularity", "selective", "--recompute-modules", "moe_act"],
        "--recompute-modules moe_act: needs --moe-grouped-gemm",
        dict(MOE, recompute_granularity="selective", recompute_modules=["moe_act"]),
        ["--recompute-granularity", "selective", "--recompute-modules", "moe_act", "--moe-grouped-gemm"],
        dict(MOE, recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True),
    ),
    (
        FULL + ["--moe-layer-recompute"],
        "--moe-layer-recompute: not with --recompute-granularity full",
        dict(MOE, moe_layer_recompute=True, **THEIR_FULL),
        ["--recompute-granularity", "selective", "--moe-layer-recompute"],
        dict(MOE, moe_layer_recompute=True, recompute_granularity="selective"),
    ),
    (
        ["--overlap-moe-expert-parallel-comm"] + EP2,
        "--overlap-moe-expert-parallel-comm: needs --moe-token-dispatcher-type alltoall or flex, not allgather",
        dict(THEIR_OVERLAP, moe_token_dispatcher_type="allgather"),
        OVERLAP,
        THEIR_OVERLAP,
    ),
    (
        OVERLAP + SHARED + ["--moe-shared-expert-overlap"],
        "--overlap-moe-expert-parallel-comm: not with --moe-shared-expert-overlap",
        dict(THEIR_OVERLAP, moe_shared_expert_intermediate_size=16, moe_shared_expert_overlap=True),
        OVERLAP + SHARED,
        dict(THEIR_OVERLAP, moe_shared_expert_intermediate_size=16),
    ),
    (
        OVERLAP + ["--mtp-num-layers", "1", "--position-embedding-type", "rope"],
        "--overlap-moe-expert-parallel-comm: not with --mtp-num-layers at --pipeline-model-parallel-size 1",
        dict(THEIR_OVERLAP, mtp_num_layers=1),
        ["--mtp-num-layers", "1", "--position-embedding-type", "rope"] + EP2,
        dict(MOE, mtp_num_layers=1),
    ),
]


def _megatron_accepts(fields) -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=2, **fields, **CPU_BUILD)
    except (ValueError, AssertionError):
        return False
    return True


def _given(argv):
    """The configs with the command line's typed flags recorded, as the script's parser records them."""
    from moezero.training.args import build_parser, given_dests
    from moezero.training.configs import CONFIG_CLASSES, DESCRIPTION

    cfg = configs(argv)
    cfg.checkpoint.given_fields = tuple(sorted(given_dests(build_parser(CONFIG_CLASSES, DESCRIPTION), argv)))
    return cfg


@pytest.mark.parametrize(
    "refused, message, theirs, allowed, their_allowed",
    RULES,
    ids=[r[1].split(":")[0] + str(i) for i, r in enumerate(RULES)],
)
def test_a_combination_megatron_core_refuses_is_refused(refused, message, theirs, allowed, their_allowed):
    assert not _megatron_accepts(theirs) and _megatron_accepts(their_allowed)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(_given(TINY + refused), world_size=2)
    validate(_given(TINY + allowed), world_size=2)


def _megatron_ddp(per_token: bool, average_in_collective: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    with megatron_on_cpu():
        config = TransformerConfig(
            num_layers=1, hidden_size=8, num_attention_heads=2, calculate_per_token_loss=per_token, **CPU_BUILD
        )
        try:
            DistributedDataParallel(
                config,
                DistributedDataParallelConfig(average_in_collective=average_in_collective),
                torch.nn.Linear(8, 8),
            )
        except AssertionError as exc:
            return str(exc)
        except Exception:  # noqa: BLE001 - past its asserts, what else it needs on a CPU does not matter here
            return None
    return None


def test_per_token_loss_with_averaging_in_the_collective_is_refused_as_megatrons_ddp_refuses_it():
    refusal = run_distributed(_megatron_ddp, 1, True, True, timeout=120)[0]
    assert refusal == "Cannot average in collective when calculating per-token loss!"
    assert run_distributed(_megatron_ddp, 1, True, False, timeout=120)[0] is None
    with pytest.raises(ConfigError, match="--calculate-per-token-loss: not with --ddp-average-in-collective"):
        validate(configs(TINY + ["--calculate-per-token-loss", "--ddp-average-in-collective"]), world_size=1)
    validate(configs(TINY + ["--ddp-average-in-collective"]), world_size=1)


def test_no_position_embedding_without_rope_is_refused_as_validate_args_refuses_it():
    """core_v0.16.1's validate_args: `if not args.add_position_embedding and args.position_embedding_type != 'rope':
    raise RuntimeError('--no-position-embedding is deprecated, use --position-embedding-type')` (after
    --use-rotary-position-embeddings set rope); moezero trained it as no position embedding."""
    with pytest.raises(ConfigError, match="--no-position-embedding: Megatron refuses it without rope"):
        configs(TINY + ["--no-position-embedding"])
    for rope in (["--position-embedding-type", "rope"], ["--use-rotary-position-embeddings"]):
        assert configs(TINY + ["--no-position-embedding"] + rope).model.position_embedding_type == "rope"


@pytest.mark.parametrize(
    "stage3",
    [["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"], ["--zero-stage", "3"]],
)
def test_the_overlap_with_megatron_fsdp_is_taken_and_runs_its_pairs_one_after_the_other(stage3):
    """Megatron takes --overlap-moe-expert-parallel-comm with Megatron-FSDP's optim_grads_params (a CI case of its
    own; neither TransformerConfig nor validate_args refuses it). Stage 3 gathers a layer's params around one
    forward at a time, so the pairs run one after the other there (the same numbers), as the log says."""
    assert _megatron_accepts(THEIR_OVERLAP)
    cfg = configs(TINY + OVERLAP + stage3)
    validate(cfg, world_size=2)
    assert cfg.zero.stage == 3 and not interleaves_micro_batches(cfg)
    assert any("the micro-batches run one after the other" in line for line in moe_comm_overlap_notices(cfg))
    assert interleaves_micro_batches(configs(TINY + OVERLAP))
