"""The pretraining script at --tensor-model-parallel-size 2 with --sequence-parallel on 2 gloo ranks (its entry point
in-process in each rank) against the same command in one process: a GPT-MoE with a dense first layer, MoE layers
with their experts split over the same two ranks (tp 2 x ep 2 folded: each rank's sequence shard goes to the all-to-
all), RoPE, an MTP depth, aux and z losses, router jitter and dropout (keyed), the aux-loss-free expert bias (its
counts summed over every rank), float64: the lm, MTP and router losses, gradient norm and validation loss of every
iteration to 1e-10 relative, with and without --calculate-per-token-loss. Checkpoints hold global coordinates, so a
tp 2 checkpoint resumes in one process (tp 1) and a tp 1 one at tp 2, each on the uninterrupted run's curve. The
runs pad the vocabulary to a multiple of 256 at tp 1 and 2 alike (Megatron pads to --make-vocab-size-divisible-by x
tp); the resumed ones keep the default (257 tokens: 384 rows at tp 1, 512 at tp 2) and adopt their checkpoint's.

Expert tensor parallelism in the same world: tp 2 with Megatron's default --expert-tensor-parallel-size (= tp: each
expert's ffn split over both ranks, ep 1), and tp 1 with etp 2 (dp 2: each rank its own micro-batches, the experts'
rows gathered over etp), on one process's curve; a checkpoint saved at tp 2 etp 2 resumes in one process."""

from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, run_in_process, assert_same_curve

# capacity drops are decided on each rank's own tokens (megatron-core's too): not those of one process
TP_TINY = [flag for i, flag in enumerate(TINY) if "capacity" not in flag and "capacity" not in TINY[i - 1]]
TP_TINY += ["--num-layers", "3", "--moe-layer-freq", "[0,1,1]", "--zero-stage", "1", "--train-iters", "4"]
TP_TINY += ["--eval-interval", "2", "--eval-iters", "1", "--fp64", "--log-interval", "1"]
TP_TINY += ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]  # counts over tp too
TP_TINY += ["--position-embedding-type", "rope", "--make-vocab-size-divisible-by", "256", "--mtp-num-layers", "1"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]
TP2 += ["--expert-tensor-parallel-size", "1"]
ETP_AT_TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]  # etp: tp's, Megatron's default
ETP_AT_TP1 = ["--expert-tensor-parallel-size", "2"]
# a run on the default padding: a tp 1 run pads to 384 rows, a tp 2 one to 512 (a resumed one: its checkpoint's)
DEFAULT_PADDING = [
    flag for i, flag in enumerate(TP_TINY) if "make-vocab" not in flag and "make-vocab" not in TP_TINY[i - 1]
]
ADOPTED = "padded vocab (size: 257) with {} dummy tokens (new size: {}): the checkpoint's, not the {} of"
PER_TOKEN = ["--calculate-per-token-loss"]  # the routers' token-weighted shares count a rank's 1/tp of the tokens


def _tp2_runs(argv, default_padding, saved_at_tp2, saved_at_tp1, saved_at_etp2):
    """At tp 2: 4 iterations straight (and with --calculate-per-token-loss); iterations 1-2 saved, then 3-4 resumed
    on the default padding from a tp 1 run's checkpoint (its 384 rows). Then expert tensor parallelism (_etp_runs)."""
    straight, output = run_in_process(argv + TP2)
    per_token, _ = run_in_process(argv + TP2 + PER_TOKEN)
    first, _ = run_in_process(argv + TP2 + ["--exit-interval", "2", "--save", saved_at_tp2])
    from_tp1, from_tp1_output = run_in_process(default_padding + TP2 + ["--load", saved_at_tp1])
    return (straight, output + from_tp1_output, first, from_tp1, per_token), _etp_runs(argv, saved_at_etp2)


def _etp_runs(argv, saved_at_etp2):
    """tp 2 etp 2 (ep 1) straight and its iterations 1-2 saved; tp 1 etp 2 straight; the two straight runs' logs."""
    at_tp2, output_tp2 = run_in_process(argv + ETP_AT_TP2)
    first, _ = run_in_process(argv + ETP_AT_TP2 + ["--exit-interval", "2", "--save", saved_at_etp2])
    at_tp1, output_tp1 = run_in_process(argv + ETP_AT_TP1)
    return at_tp2, first, at_tp1, output_tp2 + output_tp1


def test_tp2_sp_x_ep2_and_etp_runs_equal_one_process_and_checkpoints_reshard(tmp_path):
    argv = TP_TINY + ["--data-cache-path", str(tmp_path)]
    default_padding = DEFAULT_PADDING + ["--data-cache-path", str(tmp_path)]
    at_tp2, at_tp1, at_etp2 = str(tmp_path / "tp2"), str(tmp_path / "tp1"), str(tmp_path / "etp2")
    single, _ = run_in_process(argv)
    single_per_token, _ = run_in_process(argv + PER_TOKEN)
    single_384, _ = run_in_process(default_padding)  # tp 1's own padding: 384 rows
    first_tp1, _ = run_in_process(default_padding + ["--exit-interval", "2", "--save", at_tp1])
    runs = run_distributed(_tp2_runs, 2, argv, default_padding, at_tp2, at_tp1, at_etp2, timeout=400)
    ranks, etp_ranks = [tp for tp, _ in runs], [etp for _, etp in runs]
    from_tp2, from_tp2_output = run_in_process(default_padding + ["--load", at_tp2])  # adopts the 512 rows
    from_etp2, _ = run_in_process(argv + ["--load", at_etp2])
    assert [h.get("validation_loss") is not None for h in single] == [False, True, False, True]
    for at_tp2_etp2, first_etp2, at_tp1_etp2, _ in etp_ranks:
        assert_same_curve("tp 2, etp 2", at_tp2_etp2, single)
        assert_same_curve("tp 1, etp 2 (dp 2)", at_tp1_etp2, single)
    assert_same_curve("tp 2 etp 2 -> tp 1 etp 1", etp_ranks[0][1] + from_etp2, single)
    output = etp_ranks[0][3]
    assert "world 2, tp 2 with sequence parallelism, ep 1, etp 2" in output and "world 2, ep 1, etp 2" in output
    for straight, output, first, from_tp1, per_token in ranks:
        assert_same_curve("tp 2", straight, single)
        assert_same_curve("tp 2, per-token loss", per_token, single_per_token)
        assert_same_curve("tp 1 -> tp 2", first_tp1 + from_tp1, single_384)
    assert ADOPTED.format(127, 384, 512) in ranks[0][1]  # the logging rank's
    assert_same_curve("tp 2 -> tp 1", ranks[0][2] + from_tp2, single)
    assert ADOPTED.format(255, 512, 384) in from_tp2_output
    output = ranks[0][1]
    assert "tp 2 with sequence parallelism, ep 2" in output, output
