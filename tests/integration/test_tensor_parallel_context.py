"""The pretraining script at --tensor-model-parallel-size 2 x --context-parallel-size 2 on 4 gloo ranks (its entry point
in-process in each rank) against the same command in one process. Megatron's layout (tp-cp-ep-dp-pp): tp {0,1} {2,3},
cp {0,2} {1,3}, dp-cp the tp coordinate's {0,2} {1,3}: each cp rank holds chunks r and 3-r of every sequence, its tp
ranks split the heads (and under --sequence-parallel the cp part of the sequence); keys and values are exchanged over
cp on the rank's heads, the router counts tokens over the tp-cp group, the loss is vocab-parallel over tp. Two runs
of 3 iterations, float64: a dense GPT with multi-latent attention (q and kv latents with norms, YaRN, untied output,
an MTP depth, --cp-comm-type all_gather, ZeRO 3) without sequence parallelism, and a GPT-MoE (experts split over ep 2
folded over the tp ranks, aux and z losses, jitter, hidden and attention dropout, tied output, learned positions,
--cp-comm-type all_gather on its first layer and a2a on its second (4 heads: 1 per tp and cp rank), ZeRO 1) with
--sequence-parallel and --calculate-per-token-loss (the routers' token weights count a (tp x cp)-th of the
micro-batch); the lm loss, router losses, MTP loss, gradient norm and validation loss of every iteration to 1e-10
relative. A third run is the MoE one at Megatron's default expert tensor parallelism (etp = tp = 2, ep 1: each
expert's ffn split over the tp ranks, cp folded into the experts' data parallelism). Each run's checkpoint at
iteration 2 resumes in one process (tp 1, cp 1) on the uninterrupted curve."""

import os

from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, run_in_process, assert_same_curve

MOE_ONLY = ("--num-experts", "--moe-router-topk", "--moe-layer-freq", "--moe-input-jitter-eps", "--moe-z-loss-coeff")
MOE_ONLY += ("--moe-aux-loss-coeff", "--moe-expert-capacity-factor")
COMMON = ["--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1", "--fp64", "--log-interval", "1"]
# the vocabulary padded alike at tp 1 and 2 (Megatron pads to --make-vocab-size-divisible-by x tp)
COMMON += ["--make-vocab-size-divisible-by", "256"]
# capacity drops are decided on each rank's own tokens (megatron-core's too): not those of one process
MOE = [flag for i, flag in enumerate(TINY) if "capacity" not in flag and "capacity" not in TINY[i - 1]] + COMMON
MOE += ["--zero-stage", "1", "--calculate-per-token-loss", "--num-attention-heads", "4"]
DENSE = [flag for i, flag in enumerate(TINY) if flag not in MOE_ONLY and TINY[i - 1] not in MOE_ONLY] + COMMON
DENSE += ["--zero-stage", "3", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope"]
DENSE += ["--mtp-num-layers", "1", "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12"]
DENSE += ["--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--qk-layernorm"]
DENSE += ["--rotary-scaling-factor", "4", "--mscale-all-dim", "1"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]
DENSE_LAYOUT = LAYOUT + ["--cp-comm-type", "all_gather"]
MOE_LAYOUT = LAYOUT + [
    "--sequence-parallel",
    "--cp-comm-type",
    "all_gather",
    "a2a",
    "--expert-model-parallel-size",
    "2",
]
ETP_LAYOUT = MOE_LAYOUT[: MOE_LAYOUT.index("--expert-model-parallel-size")]  # Megatron's default etp: tp
MOE_LAYOUT += ["--expert-tensor-parallel-size", "1"]


def _tpcp_runs(dense, moe, saved, saved_etp):
    """At tp 2 x cp 2: the dense run, then the MoE runs under sequence parallelism (ep 2, then etp 2), each saved at
    iteration 2."""
    dense_history, output = run_in_process(dense + DENSE_LAYOUT + ["--save", saved + "_dense", "--save-interval", "2"])
    moe_history, _ = run_in_process(moe + MOE_LAYOUT + ["--save", saved, "--save-interval", "2"])
    etp_history, etp_output = run_in_process(moe + ETP_LAYOUT + ["--save", saved_etp, "--save-interval", "2"])
    return dense_history, moe_history, output, etp_history, etp_output


def test_tp2_x_cp2_equals_one_process_and_resumes_at_tp1_cp1(tmp_path):
    dense, moe = (argv + ["--data-cache-path", str(tmp_path)] for argv in (DENSE, MOE))
    saved, saved_etp = str(tmp_path / "tp2cp2"), str(tmp_path / "tp2cp2etp2")
    ranks = run_distributed(_tpcp_runs, 4, dense, moe, saved, saved_etp, timeout=600)
    single_dense, single_moe = run_in_process(dense)[0], run_in_process(moe)[0]
    resumed, _ = run_in_process(moe + ["--load", os.path.join(saved, "iter_0000002")])
    dense_resumed, _ = run_in_process(dense + ["--load", os.path.join(saved + "_dense", "iter_0000002")])
    resumed_etp, _ = run_in_process(moe + ["--load", os.path.join(saved_etp, "iter_0000002")])
    assert [h.get("validation_loss") is not None for h in single_dense] == [False, True, True]  # and at the end
    assert single_moe[0]["router_aux_loss"] > 0 and single_dense[0]["mtp_1_loss"] > 0 and "moe" not in str(DENSE)
    for dense_history, moe_history, _, etp_history, _ in ranks:  # every rank reports the step's metrics
        assert_same_curve("dense, tp 2 x cp 2 (all_gather)", dense_history, single_dense)
        assert_same_curve("MoE, tp 2 (sequence parallel) x cp 2 (all_gather, a2a)", moe_history, single_moe)
        assert_same_curve("MoE, tp 2 x cp 2, etp 2", etp_history, single_moe)
    assert_same_curve("MoE, tp 2 x cp 2 -> tp 1 x cp 1", ranks[0][1][:2] + resumed, single_moe)
    assert_same_curve("dense MLA, tp 2 x cp 2 -> tp 1 x cp 1", ranks[0][0][:2] + dense_resumed, single_dense)
    assert_same_curve("MoE, tp 2 x cp 2, etp 2 -> tp 1 x cp 1", ranks[0][3][:2] + resumed_etp, single_moe)
    assert "world 4, cp 2, tp 2, ep 1, etp 2, ZeRO stage 3" in ranks[0][2], ranks[0][2]
    assert "world 4, cp 2, tp 2 with sequence parallelism, ep 1, etp 2, ZeRO stage 1" in ranks[0][4], ranks[0][4]
