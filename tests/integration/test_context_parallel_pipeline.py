"""The pretraining script at --context-parallel-size 2 x --pipeline-model-parallel-size 2 x
--expert-model-parallel-size 2 on 4 gloo ranks (its entry point in-process in each rank) against the same command
in one process. Megatron's layout (tp-cp-ep-dp-pp): cp {0,1} {2,3}, pp {0,2} {1,3}, dp-cp {0,1} {2,3}: each cp
coordinate's pipeline sends its own half of every sequence, a stage's dense gradients reduce over its dp-cp group
and its experts (split over the same two ranks) over edp. A GPT-MoE with a dense first stage, an MoE last stage with
an MTP depth (whole-sequence shifts before the split), the tied word embedding's copy per cp coordinate, aux and z
losses, jitter, dropout and the aux-loss-free expert bias (keyed or counted over every rank), ZeRO 1, float64: the
lm loss, router losses, MTP loss, gradient norm and validation loss of every iteration to 1e-10 relative, with and
without --calculate-per-token-loss. A checkpoint saved at cp 2 x pp 2 resumes in one process (cp 1, pp 1) on the
uninterrupted run's curve."""

import os

from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, run_in_process, assert_same_curve

# capacity drops are decided on each rank's own tokens (megatron-core's too): not those of one process
CPPP_TINY = [flag for i, flag in enumerate(TINY) if "capacity" not in flag and "capacity" not in TINY[i - 1]]
CPPP_TINY += [
    "--moe-layer-freq",
    "[0,1]",
    "--mtp-num-layers",
    "1",
    "--position-embedding-type",
    "rope",
    "--zero-stage",
    "1",
    "--train-iters",
    "3",
]
CPPP_TINY += ["--eval-interval", "2", "--eval-iters", "1", "--fp64", "--log-interval", "1"]
CPPP_TINY += ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]
LAYOUT = ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
PER_TOKEN = ["--calculate-per-token-loss"]  # the router losses' token weights count a cp rank's tokens


def _cppp_runs(argv, saved):
    """At cp 2 x pp 2 x ep 2: 3 iterations, saved at 2; then the same with --calculate-per-token-loss."""
    history, output = run_in_process(argv + LAYOUT + ["--save", saved, "--save-interval", "2"])
    return history, output, run_in_process(argv + LAYOUT + PER_TOKEN)[0]


def test_cp2_x_pp2_x_ep2_equals_one_process_and_resumes_at_cp1_pp1(tmp_path):
    argv = CPPP_TINY + ["--data-cache-path", str(tmp_path)]
    saved = str(tmp_path / "cp2pp2")
    ranks = run_distributed(_cppp_runs, 4, argv, saved, timeout=600)
    single, per_token = run_in_process(argv)[0], run_in_process(argv + PER_TOKEN)[0]
    resumed, _ = run_in_process(argv + ["--load", os.path.join(saved, "iter_0000002")])
    assert [h.get("validation_loss") is not None for h in single] == [False, True, True]  # and at the end
    for history, _, per_token_history in ranks:  # every rank reports the step's metrics of every pipeline
        assert_same_curve("cp 2 x pp 2", history, single)
        assert_same_curve("cp 2 x pp 2, per-token loss", per_token_history, per_token)
    assert_same_curve("cp 2 x pp 2 -> cp 1 x pp 1", ranks[0][0][:2] + resumed, single)
    assert "pp 2 (1F1B), cp 2, ep 2" in ranks[3][1], ranks[3][1]
