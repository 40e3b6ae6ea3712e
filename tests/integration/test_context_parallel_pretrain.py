"""The pretraining script at --context-parallel-size 2 on 2 gloo ranks (its entry point in-process in each rank)
against the same command in one process: a GPT-MoE with a dense first layer, MoE layers with their experts split
over the same two ranks (cp 2 x ep 2: the all-to-all between the two halves of each sequence), aux and z losses,
router jitter and dropout (keyed), the aux-loss-free expert bias (its counts summed over every rank), float64: the
lm loss, router losses, gradient norm and validation loss of every iteration to 1e-10 relative. Params are
replicated over cp, so a cp 2 checkpoint resumes in one process (cp 1) and a cp 1 one at cp 2, each on the
uninterrupted run's curve."""

from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, run_in_process, assert_same_curve

# capacity drops are decided on each rank's own tokens (megatron-core's too): not those of one process
CP_TINY = [flag for i, flag in enumerate(TINY) if "capacity" not in flag and "capacity" not in TINY[i - 1]]
CP_TINY += ["--num-layers", "3", "--moe-layer-freq", "[0,1,1]", "--zero-stage", "1", "--train-iters", "4"]
CP_TINY += ["--eval-interval", "2", "--eval-iters", "1", "--fp64", "--log-interval", "1"]
CP_TINY += ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]  # counts over cp too
CP2 = ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"]  # Megatron's default --cp-comm-type p2p


def _cp2_runs(argv, saved_at_cp2, saved_at_cp1):
    """At cp 2: 4 iterations straight; iterations 1-2 saved, then 3-4 resumed from a cp 1 run's checkpoint."""
    straight, output = run_in_process(argv)
    first, _ = run_in_process(argv + ["--exit-interval", "2", "--save", saved_at_cp2])
    from_cp1, _ = run_in_process(argv + ["--load", saved_at_cp1])
    return straight, output, first, from_cp1


def test_cp2_x_ep2_run_equals_one_process_and_checkpoints_reshard_over_cp(tmp_path):
    argv = CP_TINY + ["--data-cache-path", str(tmp_path)]
    at_cp2, at_cp1 = str(tmp_path / "cp2"), str(tmp_path / "cp1")
    single, _ = run_in_process(argv)
    first_cp1, _ = run_in_process(argv + ["--exit-interval", "2", "--save", at_cp1])
    ranks = run_distributed(_cp2_runs, 2, argv + CP2, at_cp2, at_cp1, timeout=400)
    from_cp2, _ = run_in_process(argv + ["--load", at_cp2])
    assert [h.get("validation_loss") is not None for h in single] == [False, True, False, True]
    for straight, output, first, from_cp1 in ranks:
        assert_same_curve("cp 2", straight, single)
        assert_same_curve("cp 1 -> cp 2", first_cp1 + from_cp1, single)
    assert_same_curve("cp 2 -> cp 1", ranks[0][2] + from_cp2, single)
    output = ranks[0][1]
    assert "cp 2, ep 2" in output and "--cp-comm-type p2p: attention all-gathers" in output, output
