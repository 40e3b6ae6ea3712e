"""The pretraining script at --pipeline-model-parallel-size 2 on 2 gloo ranks (its entry point in-process in each
rank) against the same command at pp 1 in one process: a GPT-MoE with a dense first layer and MoE layers (aux and
z losses, capacity drops, router jitter and dropout, all keyed), float64, the lm loss, gradient norm and
validation loss of every iteration to 1e-10 relative (the layouts only reassociate sums), with Megatron's tied
embedding and output weights (the last stage's copy is stored once in a checkpoint, refreshed from the first stage
on a resume). Megatron's console
line and TensorBoard come from the last rank (the last stage, which holds the loss); every stage's first rank
reports its memory once (Megatron's report_memory)."""

import contextlib
import io

import pytest

from moezero.recipe import pretraining
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, configs, run_in_process

PIPELINE_TINY = TINY + [
    "--num-layers",
    "4",
    "--moe-layer-freq",
    "[0,1,1,1]",
    "--zero-stage",
    "1",
    "--train-iters",
    "4",
    "--eval-interval",
    "2",
    "--eval-iters",
    "1",
    "--fp64",
    "--log-interval",
    "1",
]
PP2 = ["--pipeline-model-parallel-size", "2"]
VPP2 = ["--num-layers-per-virtual-pipeline-stage", "1"]
TOL = 1e-10


def _values(history):
    return [(h["lm_loss"], h["grad_norm"], h.get("validation_loss")) for h in history]


def _without_zero_stage(argv):
    at = argv.index("--zero-stage")
    return argv[:at] + argv[at + 2 :]


def test_pp2_on_two_ranks_equals_pp1_on_one_process(tmp_path):
    """Without --zero-stage: ZeRO stage 0 at pp 2 (Megatron's DDP, said in the log), moezero's 2 at pp 1."""
    argv = _without_zero_stage(PIPELINE_TINY) + ["--data-cache-path", str(tmp_path)]
    board = str(tmp_path / "tb")
    ranks = run_distributed(run_in_process, 2, argv + PP2 + ["--tensorboard-dir", board], timeout=400)
    single, single_output = run_in_process(argv)
    expected = _values(single)
    assert [h["iteration"] for h in single] == [1, 2, 3, 4]
    assert [v is not None for _, _, v in expected] == [False, True, False, True]  # validations at 2 and 4
    for history, _ in ranks:  # every rank reports the step's metrics of the whole pipeline
        got = _values(history)
        assert len(got) == len(expected)
        for step, (a, b) in enumerate(zip(got, expected)):
            for x, y in zip(a, b):
                assert (x is None and y is None) or abs(x - y) <= TOL * abs(y), (step, a, b)
    first, last = (output for _, output in ranks)
    assert "iteration        4/       4 |" in last and "validation loss at iteration 4" in last
    assert "pp 2 (1F1B)" in last and "lm loss" not in first  # Megatron's: the last rank logs
    # Megatron's report_memory after the first console line, once, by every stage's first rank (one process: rank 0)
    for rank, output in enumerate((first, last, single_output)):
        stage = f" | pipeline stage: {rank}" if rank < 2 else ""
        lines = [line for line in output.splitlines() if "memory (MB)" in line]
        assert len(lines) == 1 and lines[0].startswith(
            f"[Rank {rank % 2}] (after 1 iterations) memory (MB){stage} | rss: "
        )
    assert "--pipeline-model-parallel-size=2 without --zero-stage: ZeRO stage 0" in last and "ZeRO stage 0," in last
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(board)
    events.Reload()
    assert [e.value for e in events.Scalars("lm loss")] == pytest.approx(
        [h["lm_loss"] for h in ranks[1][0]], rel=1e-6
    )  # stored in float32


def test_interleaved_virtual_stages_with_mtp_equal_pp1_on_one_process(tmp_path):
    """--num-layers-per-virtual-pipeline-stage 1: pp 2 x 2 virtual stages (torch's interleaved 1F1B) at ZeRO
    stage 2, with an MTP depth (Megatron puts it on the last stage) and --calculate-per-token-loss, the same curve,
    MTP losses and validations as one process; the last rank logs Megatron's 'mtp_1 loss' and 'num zeros'."""
    mtp = ["--mtp-num-layers", "1", "--position-embedding-type", "rope", "--mtp-loss-scaling-factor", "0.3"]
    mtp += ["--calculate-per-token-loss", "--log-num-zeros-in-grad"]
    argv = PIPELINE_TINY + mtp + ["--data-cache-path", str(tmp_path)]
    argv[argv.index("--zero-stage") + 1] = "2"  # ZeRO-2 with the pipeline (DeepSpeed refuses it)
    vpp = PP2 + VPP2
    ranks = run_distributed(run_in_process, 2, argv + vpp, timeout=400)
    single = run_in_process(argv)[0]
    expected = _values(single)
    for history, _ in ranks:
        for step, (a, b) in enumerate(zip(_values(history), expected)):
            for x, y in zip(a, b):
                assert (x is None and y is None) or abs(x - y) <= TOL * abs(y), (step, a, b)
        for got, want in zip(history, single):
            assert abs(got["mtp_1_loss"] - want["mtp_1_loss"]) <= TOL * want["mtp_1_loss"]
    assert "pp 2 (interleaved 1F1B, 2 virtual stages)" in ranks[1][1]
    assert "mtp_1 loss:" in ranks[1][1] and "num zeros:" in ranks[1][1]  # the stages' count (compared elsewhere)


def test_bf16_tied_weights_at_pp2_follow_pp1(tmp_path):
    """--bf16: the copy's gradient (summed in fp32) reaches the first stage's optimizer through a backward pass (a
    bf16 param's gradient lives in ZeRO's fp32 buckets, not in `.grad`); the curve follows pp 1's within bf16's
    rounding of the reassociated sums."""
    argv = [a for a in PIPELINE_TINY if a != "--fp64"] + ["--bf16", "--train-iters", "3", "--eval-interval", "0"]
    argv += ["--data-cache-path", str(tmp_path)]
    ranks = run_distributed(run_in_process, 2, argv + PP2, timeout=400)
    expected = [(h["lm_loss"], h["grad_norm"]) for h in run_in_process(argv)[0]]
    got = [(h["lm_loss"], h["grad_norm"]) for h in ranks[1][0]]
    assert len(got) == len(expected) == 3
    assert got[0][0] == pytest.approx(expected[0][0], rel=1e-6)  # the first forward: the same weights
    for (loss, norm), (want_loss, want_norm) in zip(got, expected):
        assert loss == pytest.approx(want_loss, rel=1e-3) and norm == pytest.approx(want_norm, rel=2e-3)


def _scale_trajectory(output):
    """(loss scale, skipped this iteration) of each iteration's console line (--log-interval 1)."""
    lines = [line for line in output.splitlines() if "loss scale:" in line]
    return [
        (float(line.split("loss scale:")[1].split("|")[0]), int(line.split("skipped iterations:")[1].split("|")[0]))
        for line in lines
    ]


def test_fp16_at_pp2_skips_the_steps_and_scales_as_pp1(tmp_path):
    """--fp16 with a loss scale that overflows (2^20, --hysteresis 1: iterations 1 and 3): at pp 2 the same iterations
    are skipped and the scale halves and holds as at pp 1 (the overflow seen on any stage skips every stage), then
    the curve follows pp 1's within fp16's rounding of the reassociated sums."""
    argv = [a for a in PIPELINE_TINY if a != "--fp64"] + ["--fp16", "--initial-loss-scale", "1048576"]
    argv += ["--hysteresis", "1", "--eval-interval", "0", "--data-cache-path", str(tmp_path)]
    ranks = run_distributed(run_in_process, 2, argv + PP2, timeout=400)
    single, single_output = run_in_process(argv)
    expected = _scale_trajectory(single_output)
    assert {skipped for _, skipped in expected} == {0, 1} and len(expected) == 4  # overflows and steps
    assert _scale_trajectory(ranks[1][1]) == expected
    history = ranks[1][0]
    assert ["grad_norm" in h for h in history] == ["grad_norm" in h for h in single]
    for got, want in zip(history, single):
        assert got["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-3)
        if "grad_norm" in want:
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-2)


def _resumes_at_pp2(argv, saved_at_pp2, saved_at_pp1):
    """At pp 2: iterations 1-2 saved, then 3-4 resumed from that (also with 2 virtual stages) and from a pp 1 run's
    checkpoint."""
    first, _ = run_in_process(argv + PP2 + ["--exit-interval", "2", "--save", saved_at_pp2])
    same_layout, _ = run_in_process(argv + PP2 + ["--load", saved_at_pp2])
    virtual, _ = run_in_process(argv + PP2 + VPP2 + ["--load", saved_at_pp2])
    from_pp1, _ = run_in_process(argv + PP2 + ["--load", saved_at_pp1])
    return first, same_layout, from_pp1, virtual


def test_a_pp2_checkpoint_resumes_at_pp1_and_back_with_the_uninterrupted_losses(tmp_path):
    """Checkpoints keep global names (the train state records every stage's shapes), so a pp 2 run's resumes in one
    process at pp 1, with 2 virtual stages, and a pp 1 run's at pp 2, each on the uninterrupted run's curve (float64,
    1e-10)."""
    argv = PIPELINE_TINY + ["--data-cache-path", str(tmp_path)]
    at_pp2, at_pp1 = str(tmp_path / "pp2"), str(tmp_path / "pp1")
    straight = _values(run_in_process(argv)[0])
    first_pp1, _ = run_in_process(argv + ["--exit-interval", "2", "--save", at_pp1])
    first, same_layout, from_pp1, virtual = run_distributed(_resumes_at_pp2, 2, argv, at_pp2, at_pp1, timeout=400)[1]
    from_pp2, _ = run_in_process(argv + ["--load", at_pp2])
    curves = {
        "pp 2 -> pp 2": first + same_layout,
        "pp 2 -> pp 2 x 2 virtual stages": first + virtual,
        "pp 1 -> pp 2": first_pp1 + from_pp1,
        "pp 2 -> pp 1": first + from_pp2,
    }
    for name, curve in curves.items():
        assert [h["iteration"] for h in curve] == [1, 2, 3, 4], name
        for step, (a, b) in enumerate(zip(_values(curve), straight)):
            for x, y in zip(a, b):
                assert (x is None and y is None) or abs(x - y) <= TOL * abs(y), (name, step, a, b)


def _decoupled_at_pp2(argv, saved, saved_at_pp1):
    """At pp 2: iterations 1-2, saved; iterations 3-4 from a pp 1 run's checkpoint."""
    first = run_in_process(argv + PP2 + ["--exit-interval", "2", "--save", saved])[0]
    return first, run_in_process(argv + PP2 + ["--load", saved_at_pp1])[0]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_decoupled_lr_checkpoints_cross_pp_with_the_uninterrupted_losses(tied, tmp_path):
    """--decoupled-lr: the embedding's (and the untied output layer's) groups on their own peak lr, on the stages
    holding them only (tied, the last stage's optimizer has one group fewer); a pp 2 checkpoint resumes in one
    process, and a pp 1 one at pp 2, on the uninterrupted run's curve (float64, 1e-10)."""
    argv = PIPELINE_TINY + ["--data-cache-path", str(tmp_path), "--eval-interval", "0"]
    argv += [] if tied else ["--untie-embeddings-and-output-weights"]
    decoupled = argv + ["--decoupled-lr", "3e-2"]
    at_pp2, at_pp1 = str(tmp_path / "pp2"), str(tmp_path / "pp1")
    straight = _values(run_in_process(decoupled)[0])
    assert straight[-1] != _values(run_in_process(argv)[0])[-1], "the decoupled lr changes the curve"
    first_pp1, _ = run_in_process(decoupled + ["--exit-interval", "2", "--save", at_pp1])
    first, from_pp1 = run_distributed(_decoupled_at_pp2, 2, decoupled, at_pp2, at_pp1, timeout=400)[1]
    from_pp2, _ = run_in_process(decoupled + ["--load", at_pp2])
    for name, curve in {"pp 2 -> pp 1": first + from_pp2, "pp 1 -> pp 2": first_pp1 + from_pp1}.items():
        assert [h["iteration"] for h in curve] == [1, 2, 3, 4], name
        for step, (a, b) in enumerate(zip(_values(curve), straight)):
            for x, y in zip(a, b):
                assert (x is None and y is None) or abs(x - y) <= TOL * abs(y), (name, step, a, b)


def test_muon_at_pp2_equals_pp1_and_its_checkpoints_cross_pp(tmp_path):
    """--optimizer muon: each stage's optimizer orthogonalises the whole matrices of its own layers (over its dp
    group), Adam for the embedding and the rest, so pp 2 (tied embedding, ZeRO 1) follows one process's curve; a
    pp 2 checkpoint (the momentum buffers under their global names, every stage's Muon and Adam groups) resumes in
    one process, and a pp 1 one at pp 2, on the uninterrupted curve (float64, 1e-10)."""
    argv = PIPELINE_TINY + ["--optimizer", "muon", "--train-iters", "3", "--eval-interval", "0"]
    argv += ["--data-cache-path", str(tmp_path)]
    at_pp2, at_pp1 = str(tmp_path / "pp2"), str(tmp_path / "pp1")
    straight = _values(run_in_process(argv)[0])
    first_pp1, _ = run_in_process(argv + ["--exit-interval", "2", "--save", at_pp1])
    first, from_pp1 = run_distributed(_decoupled_at_pp2, 2, argv, at_pp2, at_pp1, timeout=400)[1]
    from_pp2, _ = run_in_process(argv + ["--load", at_pp2])
    for name, curve in {"pp 2 -> pp 1": first + from_pp2, "pp 1 -> pp 2": first_pp1 + from_pp1}.items():
        assert [h["iteration"] for h in curve] == [1, 2, 3], name
        for step, (a, b) in enumerate(zip(_values(curve), straight)):
            for x, y in zip(a, b):
                assert (x is None and y is None) or abs(x - y) <= TOL * abs(y), (name, step, a, b)


def _dense(argv):
    """The command without its MoE layers (a dense model of the same shape)."""
    moe = {"--num-experts", "--moe-router-topk", "--moe-expert-capacity-factor"}
    return [a for i, a in enumerate(argv) if a not in moe and (i == 0 or argv[i - 1] not in moe)]


def test_upcycling_at_pp2_equals_pp1(tmp_path):
    """--moe-use-upcycling: each stage fills its own layers' experts from the dense checkpoint (the tied copy takes
    the first stage's upcycled embedding with the optimizer), so pp 2's upcycled run follows one process's (dense
    first layer, dropless MoE layers, float64, 1e-10)."""
    dense, cache = str(tmp_path / "dense"), ["--data-cache-path", str(tmp_path)]
    run_in_process(_dense(PIPELINE_TINY) + cache + ["--train-iters", "2", "--save", dense])
    argv = _dense(PIPELINE_TINY) + ["--num-experts", "4", "--moe-router-topk", "2", "--train-iters", "3"]
    argv += cache + ["--load", dense, "--moe-use-upcycling"]
    single, output = run_in_process(argv)
    assert "--moe-use-upcycling: the experts start as the dense MLPs of" in output
    expected = _values(single)
    for history, _ in run_distributed(run_in_process, 2, argv + PP2, timeout=400):
        assert len(history) == len(expected) == 3
        for step, (a, b) in enumerate(zip(_values(history), expected)):
            for x, y in zip(a, b):
                assert (x is None and y is None) or abs(x - y) <= TOL * abs(y), (step, a, b)


def _run_qat(argv):
    """(history, QAT's scalars after the run: a collective over the pipeline) of one run in this process."""
    with contextlib.redirect_stdout(io.StringIO()):
        run = pretraining(configs(argv))
        run.train()
        scalars = run.plugins["qat"].scalars()
    run.destroy_groups()
    return run.history, scalars


def test_qat_at_pp2_equals_pp1(tmp_path):
    """Quantization-aware training on every stage's layers and the tied word embedding (the last stage's copy
    fake-quantized as the first stage's weight, the same stochastic rounding by name), bits lowered at every step:
    pp 2 follows one process's curve (float64, 1e-10), and the logged bits and quantization errors are the whole
    model's (summed over the stages, the embedding once); its checkpoint of iteration 2 (the masters under the
    parametrizations' names, the schedule) resumes in one process on the uninterrupted curve."""
    qat = ["--qat-weight-bits", "4", "--qat-start-bits", "6", "--qat-bits-period", "1", "--qat-groups", "16"]
    qat += ["--qat-modules", "attention,mlp,experts,router,embedding", "--qat-rounding", "stochastic"]
    argv = PIPELINE_TINY + qat + ["--train-iters", "3", "--data-cache-path", str(tmp_path)]
    saved = str(tmp_path / "pp2")
    single, single_scalars = _run_qat(argv)
    assert single_scalars["qat/bits/embedding"] == 4.0 and len(single_scalars) == 10  # 5 groups: bits and error
    ranks = run_distributed(_run_qat, 2, argv + PP2 + ["--save", saved, "--save-interval", "2"], timeout=400)
    resumed, resumed_scalars = _run_qat(argv + ["--load", saved, "--ckpt-step", "2"])
    runs = [("pp 2, rank 0", *ranks[0]), ("pp 2, rank 1", *ranks[1])]
    runs.append(("pp 2 -> pp 1", ranks[1][0][:2] + resumed, resumed_scalars))
    for name, history, scalars in runs:
        assert [h["iteration"] for h in history] == [1, 2, 3], name
        for step, (a, b) in enumerate(zip(_values(history), _values(single))):
            for x, y in zip(a, b):
                assert (x is None and y is None) or abs(x - y) <= TOL * abs(y), (name, step, a, b)
        assert scalars.keys() == single_scalars.keys(), name
        for tag, value in single_scalars.items():
            assert abs(scalars[tag] - value) <= TOL * abs(value), (name, tag, scalars[tag], value)


def test_pp2_by_ep2_on_four_ranks_with_mla_shared_experts_and_mtp_equals_one_process(tmp_path):
    """The issue's layout: pp 2 x ep 2 (x dp 2) on 4 ranks, ZeRO 1, a GPT-MoE with a dense first layer, MoE layers
    with a shared expert, MLA attention, an MTP depth on the last stage and full recompute inside the stages,
    against the same command at pp 1, ep 1 in one process: the curve, MTP losses and validations to 1e-10."""
    model = ["--multi-latent-attention", "--q-lora-rank", "8", "--kv-lora-rank", "8", "--qk-head-dim", "8"]
    model += ["--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--position-embedding-type", "rope"]
    model += ["--moe-shared-expert-intermediate-size", "16", "--disable-bias-linear", "--mtp-num-layers", "1"]
    model += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    argv = PIPELINE_TINY + model + ["--train-iters", "3", "--data-cache-path", str(tmp_path)]
    ranks = run_distributed(run_in_process, 4, argv + PP2 + ["--expert-model-parallel-size", "2"], timeout=600)
    single = run_in_process(argv)[0]
    expected = _values(single)
    assert len(expected) == 3
    for history, _ in ranks:
        assert len(history) == len(expected)
        for step, (a, b) in enumerate(zip(_values(history), expected)):
            for x, y in zip(a, b):
                assert (x is None and y is None) or abs(x - y) <= TOL * abs(y), (step, a, b)
        for got, want in zip(history, single):
            assert abs(got["mtp_1_loss"] - want["mtp_1_loss"]) <= TOL * want["mtp_1_loss"]
    assert "pp 2 (1F1B)" in ranks[3][1]
