"""The pretraining script at --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 on 4 gloo ranks (its
entry point in-process in each rank) against the same command in one process. Megatron's layout (tp-cp-ep-dp-pp):
tp {0,1} {2,3}, pp {0,2} {1,3}: each tp coordinate's pipeline sends its own hidden states ((mbs, S, D), under
--sequence-parallel its sequence shard (mbs, S/2, D)), a stage's gradient norm is summed over tp then over the
stages, and the tied word embedding's vocabulary shard has its copy per tp coordinate. Two runs of 3 iterations,
float64, ZeRO 1: a dense GPT (untied output, RoPE, an MTP depth on the last stage: its input embedding the last
stage's vocabulary-parallel copy of the word embedding) without sequence parallelism, and a GPT-MoE (MoE layers on both
stages, experts split over ep 2 folded over the tp ranks, aux and z losses, jitter, dropout, tied output, learned
positions) with --sequence-parallel and --calculate-per-token-loss (the routers' token weights count a rank's
sequence shard); the lm loss, router losses, gradient norm and validation loss of every iteration to 1e-10
relative. A third run is the MoE one at Megatron's default expert tensor parallelism (etp = tp = 2, ep 1: each
expert's ffn split over the tp ranks, etp {0,1} {2,3} per stage), with RoPE and an MTP depth (MoE too, under
sequence parallelism: its embedded tokens the rank's sequence shard). The MoE runs' checkpoints at iteration 2 resume in
one process (tp 1, pp 1) on the uninterrupted curve."""

import os

from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, run_in_process, assert_same_curve

MOE_ONLY = ("--num-experts", "--moe-router-topk", "--moe-layer-freq", "--moe-input-jitter-eps", "--moe-z-loss-coeff")
MOE_ONLY += ("--moe-aux-loss-coeff", "--moe-expert-capacity-factor")
COMMON = ["--zero-stage", "1", "--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1", "--fp64"]
# the vocabulary padded alike at tp 1 and 2 (Megatron pads to --make-vocab-size-divisible-by x tp)
COMMON += ["--log-interval", "1", "--make-vocab-size-divisible-by", "256"]
# capacity drops are decided on each rank's own tokens (megatron-core's too): not those of one process
MOE = [flag for i, flag in enumerate(TINY) if "capacity" not in flag and "capacity" not in TINY[i - 1]] + COMMON
MOE += ["--calculate-per-token-loss"]
DENSE = [flag for i, flag in enumerate(TINY) if flag not in MOE_ONLY and TINY[i - 1] not in MOE_ONLY] + COMMON
DENSE += ["--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--mtp-num-layers", "1"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
MOE_LAYOUT = LAYOUT + ["--sequence-parallel", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
ETP_LAYOUT = LAYOUT + ["--sequence-parallel"]  # Megatron's default etp: tp
ETP_MODEL = ["--position-embedding-type", "rope", "--mtp-num-layers", "1"]  # MTP needs RoPE (Megatron's rule)


def _tppp_runs(dense, moe, saved, saved_etp):
    """At tp 2 x pp 2: the dense run, then the MoE runs under sequence parallelism (ep 2, then etp 2), saved at
    iteration 2."""
    dense_history, output = run_in_process(dense + LAYOUT)
    moe_history, _ = run_in_process(moe + MOE_LAYOUT + ["--save", saved, "--save-interval", "2"])
    etp_history, etp_output = run_in_process(
        moe + ETP_MODEL + ETP_LAYOUT + ["--save", saved_etp, "--save-interval", "2"]
    )
    return dense_history, moe_history, output, etp_history, etp_output


def test_tp2_x_pp2_equals_one_process_and_resumes_at_tp1_pp1(tmp_path):
    dense, moe = (argv + ["--data-cache-path", str(tmp_path)] for argv in (DENSE, MOE))
    saved, saved_etp = str(tmp_path / "tp2pp2"), str(tmp_path / "tp2pp2etp2")
    ranks = run_distributed(_tppp_runs, 4, dense, moe, saved, saved_etp, timeout=600)
    single_dense, single_moe = run_in_process(dense)[0], run_in_process(moe)[0]
    single_etp = run_in_process(moe + ETP_MODEL)[0]
    resumed, _ = run_in_process(moe + ["--load", os.path.join(saved, "iter_0000002")])
    resumed_etp, _ = run_in_process(moe + ETP_MODEL + ["--load", os.path.join(saved_etp, "iter_0000002")])
    assert [h.get("validation_loss") is not None for h in single_dense] == [False, True, True]  # and at the end
    assert single_moe[0]["router_aux_loss"] > 0 and "moe" not in str(DENSE)
    assert single_dense[0]["mtp_1_loss"] > 0 and single_etp[0]["mtp_1_loss"] > 0
    for dense_history, moe_history, _, etp_history, _ in ranks:  # every rank reports every pipeline's step metrics
        assert_same_curve("dense, tp 2 x pp 2", dense_history, single_dense)
        assert_same_curve("MoE, tp 2 (sequence parallel) x pp 2", moe_history, single_moe)
        assert_same_curve("MoE with MTP, tp 2 x pp 2, etp 2", etp_history, single_etp)
    assert_same_curve("MoE, tp 2 x pp 2 -> tp 1 x pp 1", ranks[0][1][:2] + resumed, single_moe)
    assert_same_curve("MoE, tp 2 x pp 2, etp 2 -> tp 1 x pp 1", ranks[0][3][:2] + resumed_etp, single_etp)
    assert "pp 2 (1F1B), tp 2" in ranks[3][2], ranks[3][2]
    assert "pp 2 (1F1B), tp 2 with sequence parallelism, ep 1, etp 2," in ranks[3][4], ranks[3][4]


# tp x cp x pp: 4 heads (a2a splits each tp rank's 2 over cp), RoPE and an MTP depth, 2 micro-batches a step
THREE_D = MOE + ["--num-attention-heads", "4", "--global-batch-size", "4"] + ETP_MODEL
THREE_D_LAYOUT = LAYOUT + ["--context-parallel-size", "2", "--sequence-parallel", "--cp-comm-type", "all_gather", "a2a"]
THREE_D_LAYOUT += ["--expert-model-parallel-size", "2"]  # etp 2 (Megatron's default) x ep 2 x pp 2: the 8 ranks


def _three_d_run(argv, saved):
    return run_in_process(argv + THREE_D_LAYOUT + ["--save", saved, "--save-interval", "2"])


def test_tp2_x_cp2_x_pp2_equals_one_process_and_resumes_at_one(tmp_path):
    """tp 2 x cp 2 x pp 2 on 8 gloo ranks (Megatron's tp {0,1}, cp {0,2}, pp {0,4}; the experts' etp {0,1}, ep {0,2},
    edp singletons): a GPT-MoE under sequence parallelism (each cp rank's part of the sequence sharded over tp, the
    pipeline sending that shard), cp all_gather then a2a, ep 2 x etp 2, an MTP depth on the last stage; its losses,
    gradient norm and validation loss of 3 iterations equal one process's in float64 to 1e-10 relative, and its
    checkpoint at iteration 2 resumes there on the uninterrupted curve."""
    argv = THREE_D + ["--data-cache-path", str(tmp_path)]
    saved = str(tmp_path / "tp2cp2pp2")
    ranks = run_distributed(_three_d_run, 8, argv, saved, timeout=600, isolated=True)
    single = run_in_process(argv)[0]
    resumed, _ = run_in_process(argv + ["--load", os.path.join(saved, "iter_0000002")])
    assert single[0]["mtp_1_loss"] > 0 and single[0]["router_aux_loss"] > 0
    for history, _ in ranks:
        assert_same_curve("MoE, tp 2 x cp 2 x pp 2", history, single)
    assert_same_curve("MoE, tp 2 x cp 2 x pp 2 -> one process", ranks[0][0][:2] + resumed, single)
    banner = "world 8, pp 2 (1F1B), cp 2, tp 2 with sequence parallelism, ep 2, etp 2,"
    assert banner in ranks[7][1], ranks[7][1]
