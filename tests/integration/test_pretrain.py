"""End-to-end pretraining: layout invariance, exact resume, TensorBoard, bad flags, golden losses."""

import json
import math
import os
import subprocess
import sys

import pytest

from moezero.config import ConfigError
from moezero.data import DataError
from moezero.training.configs import validate
from tests.dist_utils import run_distributed
from moezero.recipe import pretraining
from tests.integration.pretrain_utils import ASSETS, TINY, configs, train

ITERS = ["--train-iters", "20"]
FP64 = ["--fp64"]  # exactness claims run in float64: a capacity or rounding decision cannot flip between layouts


class _SharedRuns:
    """Runs that several tests compare with, each run once for the module when a test first asks for it."""

    def __init__(self, cache_dir):
        self.cache_dir, self._runs = cache_dir, {}

    def one_process_fp64(self):
        """The float64 loss curve of one process: the layouts' and the resumes' reference."""
        if "fp64" not in self._runs:
            self._runs["fp64"] = [h["lm_loss"] for h in train(TINY + ITERS + FP64, self.cache_dir)]
        return self._runs["fp64"]

    def fp32_ep2_on_two_ranks(self):
        """The history of the fp32 run on 2 ranks at ep 2, not stopped."""
        if "fp32 ep2" not in self._runs:
            argv = TINY + ITERS + ["--expert-model-parallel-size", "2"]
            self._runs["fp32 ep2"] = run_distributed(train, 2, argv, self.cache_dir, timeout=400)[0]
        return self._runs["fp32 ep2"]


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
    return _SharedRuns(str(tmp_path_factory.mktemp("shared_runs")))


# ---- layout invariance ---------------------------------------------------------------------------
FP32_BOUND = 1e-3  # fp32 curves only reassociate sums too, but rounding grows over 20 AdamW steps and depends on
# the CPU's kernels: 2.7e-8 measured on an AMD EPYC (AVX-512), 3.2e-5 reported on another
# AVX-512 CPU; the bound leaves a 30x margin over the worst seen


def _two_rank_layouts(cache_dir, save_dir):
    runs = {}
    for ep in (1, 2):
        for stage in (0, 1, 2, 3):
            if ep == 1 and stage not in (2, 3):
                continue
            argv = TINY + ITERS + FP64 + ["--expert-model-parallel-size", str(ep), "--zero-stage", str(stage)]
            runs[f"2 ranks ep{ep} stage{stage}"] = [h["lm_loss"] for h in train(argv, cache_dir)]
    ep2 = ["--expert-model-parallel-size", "2"]
    # recompute redraws the same dropout masks and jitter, so the curve does not move
    runs["2 ranks ep2 stage2 recompute"] = [
        h["lm_loss"] for h in train(TINY + ITERS + FP64 + ep2 + ["--recompute-activations"], cache_dir)
    ]
    # both layers one stage-3 unit (a run of layers), each layer recomputed whole in backward
    runs["2 ranks ep2 stage3, layers.0..1 one unit, full recompute"] = [
        h["lm_loss"]
        for h in train(
            TINY
            + ITERS
            + FP64
            + ep2
            + [
                "--zero-stage",
                "3",
                "--zero-min-unit-params",
                "5000",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
            cache_dir,
        )
    ]
    # the first half, saved to resume on one process (another dp and ep)
    runs["2 ranks ep2, first half"] = [
        h["lm_loss"]
        for h in train(TINY + ITERS + FP64 + ep2 + ["--exit-interval", "10", "--save", save_dir], cache_dir)
    ]
    return runs


def _four_rank_layouts(cache_dir):
    return {
        f"4 ranks ep{ep} stage{stage}": [
            h["lm_loss"]
            for h in train(
                TINY + ITERS + FP64 + ["--expert-model-parallel-size", str(ep), "--zero-stage", str(stage)], cache_dir
            )
        ]
        for ep, stage in ((2, 3), (4, 2))
    }


def _worst(curve, reference):
    assert len(curve) == len(reference), (curve, reference)
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference))


def test_loss_curve_is_layout_invariant(tmp_path, shared_runs):
    """float64: every layout (1, 2 and 4 ranks, ep 1/2/4, every stage, recompute, a resume on another layout)
    agrees with one process to 1e-10 relative (layouts only reassociate sums); fp32 to FP32_BOUND."""
    cache, save = str(tmp_path), str(tmp_path / "half")
    single = shared_runs.one_process_fp64()
    curves = run_distributed(_two_rank_layouts, 2, cache, save, timeout=400)[0]
    curves.update(run_distributed(_four_rank_layouts, 4, cache, timeout=400)[0])
    first_half = curves.pop("2 ranks ep2, first half")
    assert len(first_half) == 10
    curves["2 ranks ep2, resumed on 1 process"] = first_half + [
        h["lm_loss"] for h in train(TINY + ITERS + FP64 + ["--load", save], cache)
    ]
    fp32 = [h["lm_loss"] for h in shared_runs.fp32_ep2_on_two_ranks()]
    assert single[-1] < single[0] - 0.2, "the loss must fall"
    for name, curve in curves.items():
        assert _worst(curve, single) < 1e-10, (name, curve, single)
    single_fp32 = [h["lm_loss"] for h in train(TINY + ITERS, cache)]
    assert _worst(fp32, single_fp32) < FP32_BOUND, (fp32, single_fp32)


# ---- exact resume ---------------------------------------------------------------------------------
def _stopped_and_resumed(cache_dir, save_dir):
    first = train(
        TINY + ITERS + ["--expert-model-parallel-size", "2", "--exit-interval", "10", "--save", save_dir], cache_dir
    )
    second = train(TINY + ITERS + ["--expert-model-parallel-size", "2", "--load", save_dir], cache_dir)
    return first, second


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, shared_runs):
    straight = shared_runs.fp32_ep2_on_two_ranks()
    first, second = run_distributed(_stopped_and_resumed, 2, str(tmp_path), str(tmp_path / "ckpt"), timeout=400)[0]
    assert [h["iteration"] for h in second] == list(range(11, 21))
    resumed = first + second
    assert [h["lm_loss"] for h in resumed] == [h["lm_loss"] for h in straight]
    assert [h["grad_norm"] for h in resumed] == [h["grad_norm"] for h in straight]


def _resume_across_stages(cache_dir, save_dir):
    ep2 = ["--expert-model-parallel-size", "2"]
    curves = {}
    for first_stage, second_stage in ((2, 3), (3, 2)):
        path = f"{save_dir}/{first_stage}to{second_stage}"
        first = train(
            TINY + ITERS + FP64 + ep2 + ["--zero-stage", str(first_stage), "--exit-interval", "10", "--save", path],
            cache_dir,
        )
        second = train(TINY + ITERS + FP64 + ep2 + ["--zero-stage", str(second_stage), "--load", path], cache_dir)
        curves[(first_stage, second_stage)] = [h["lm_loss"] for h in first + second]
    return curves


def test_a_stage2_checkpoint_resumes_at_stage3_and_back(tmp_path, shared_runs):
    """float64: stopped at one stage and resumed at the other, the curve is the one process's (which every 2-rank
    layout's is, to 1e-10: test_loss_curve_is_layout_invariant)."""
    straight = shared_runs.one_process_fp64()
    curves = run_distributed(_resume_across_stages, 2, str(tmp_path), str(tmp_path / "ckpt"), timeout=400)[0]
    for name, curve in curves.items():
        assert len(curve) == len(straight)
        assert max(abs(a - b) / b for a, b in zip(curve, straight)) < 1e-10, (name, curve, straight)


# ---- TensorBoard ------------------------------------------------------------------------------------
def test_tensorboard_scalars_are_written(tmp_path):
    """Megatron's tags for what both log (and their 'vs samples' series over consumed samples), then
    moezero's own; the params norm is the trained weights' norm."""
    tb = str(tmp_path / "tb")
    run = pretraining(
        configs(
            TINY
            + [
                "--train-iters",
                "3",
                "--log-interval",
                "2",
                "--eval-interval",
                "3",
                "--eval-iters",
                "1",
                "--tensorboard-dir",
                tb,
                "--log-throughput",
                "--log-params-norm",
                "--log-num-zeros-in-grad",
                "--moe-per-layer-logging",
                "--data-cache-path",
                str(tmp_path),
            ]
        )
    )
    run.train()
    params_norm = sum(float((p.detach().double() ** 2).sum()) for p in run.model.parameters() if p.requires_grad) ** 0.5
    run.groups.destroy()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    megatron = [
        "lm loss",
        "learning-rate",
        "batch-size",
        "grad-norm",
        "iteration-time",
        "throughput",
        "loss-scale",
        "params-norm",
        "num-zeros",
        "lm loss validation",
        "lm loss validation ppl",
        "load_balancing_loss",
        "z_loss",
        "moe/load_balancing_loss_layer_0",
        "moe/z_loss_layer_1",
    ]
    series = [
        f"{t} vs samples"
        for t in (
            "lm loss",
            "learning-rate",
            "batch-size",
            "grad-norm",
            "params-norm",
            "loss-scale",
            "num-zeros",
            "lm loss validation",
            "lm loss validation ppl",
        )
    ]
    own = [
        "aux loss",
        "z loss",
        "tokens-per-sec",
        "memory/max-rss-mb",
        "moe/layer0/max-mean-load-ratio",
        "moe/layer1/dropped-fraction",
        "moe/layer0/tokens-per-expert/3",
    ]
    for tag in megatron + series + own:
        assert tag in tags, tag
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3]  # --tensorboard-log-interval 1
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [8, 16, 24]
    # with the console line: the first iteration (Megatron's), every --log-interval, the last
    assert [e.step for e in events.Scalars("moe/layer0/max-mean-load-ratio")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("loss-scale")] == [1.0, 1.0, 1.0]  # Megatron's, without fp16
    assert events.Scalars("params-norm")[-1].value == pytest.approx(params_norm, rel=1e-6)
    assert all(0 < e.value for e in events.Scalars("throughput") + events.Scalars("load_balancing_loss"))


def test_megatrons_tensorboard_switches(tmp_path):
    """--no-log-loss-scale-to-tensorboard leaves out loss-scale (the console keeps it), --log-world-size-to-tensorboard
    writes world-size and its series over samples; --tensorboard-queue-size, --timing-log-option and
    --log-memory-interval are taken as Megatron scripts pass them. The MoE losses are written every iteration
    whatever --tensorboard-log-interval says, as Megatron's tracker writes them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    run = pretraining(
        configs(
            TINY
            + [
                "--train-iters",
                "2",
                "--tensorboard-dir",
                tb,
                "--no-log-loss-scale-to-tensorboard",
                "--log-world-size-to-tensorboard",
                "--tensorboard-queue-size",
                "5",
                "--timing-log-option",
                "max",
                "--log-memory-interval",
                "2",
                "--tensorboard-log-interval",
                "2",
                "--moe-per-layer-logging",
                "--position-embedding-type",
                "rope",
                "--mtp-num-layers",
                "1",
                "--data-cache-path",
                str(tmp_path),
            ]
        )
    )
    run.train()
    run.groups.destroy()
    events = EventAccumulator(tb)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert "loss-scale" not in tags and "loss-scale vs samples" not in tags and "lm loss" in tags
    assert [(e.step, e.value) for e in events.Scalars("world-size")] == [(2, 1.0)]
    assert [e.step for e in events.Scalars("world-size vs samples")] == [16]
    assert [e.step for e in events.Scalars("lm loss")] == [2]
    for moe_tag in ("load_balancing_loss", "z_loss", "moe/load_balancing_loss_layer_0", "mtp_1 loss"):
        assert [e.step for e in events.Scalars(moe_tag)] == [1, 2], moe_tag


def test_skip_train_evaluates_the_loaded_weights_and_saves_nothing(tmp_path, capsys):
    """Megatron's --skip-train: no step, no save, no TensorBoard; the validation of --load's weights on
    --eval-iters global batches from the split's start, as that run's own validation after training read them
    (its checkpoint is at --train-iters: nothing would be left to train)."""
    from moezero import checkpoint

    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    common = TINY + ["--train-iters", "2", "--eval-iters", "1", "--data-cache-path", str(tmp_path)]
    trained = pretraining(configs(common + ["--eval-interval", "100", "--save", ckpt]))
    trained.train()
    trained.groups.destroy()
    capsys.readouterr()
    evaluated = pretraining(configs(common + ["--load", ckpt, "--save", ckpt, "--skip-train", "--tensorboard-dir", tb]))
    evaluated.train()
    evaluated.groups.destroy()
    out = capsys.readouterr().out
    assert "skipping training (--skip-train is on)" in out and "saved checkpoint" not in out
    assert evaluated.history == [] and checkpoint.saved_iterations(ckpt) == [2]
    line = next(line for line in out.splitlines() if "validation loss at iteration 2 on validation set" in line)
    assert float(line.split("lm loss value:")[1].split("|")[0]) == pytest.approx(
        trained.history[-1]["validation_loss"], rel=1e-6
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    assert "lm loss validation" not in events.Tags()["scalars"]  # Megatron's write_to_tensorboard=not skip_train


def test_a_resume_from_an_older_checkpoint_logs_each_step_once(tmp_path):
    """A run logs 6 iterations (checkpoints at 3 and 6), a resume from iteration 3 logs 4-6 again into the same
    folder: each series shows each step once, iterations 4-6 with the resumed run's values; the 'vs samples'
    series keep their history before the resume point."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, ckpt = str(tmp_path / "tb"), str(tmp_path / "ckpt")
    argv = TINY + [
        "--train-iters",
        "6",
        "--tensorboard-dir",
        tb,
        "--save",
        ckpt,
        "--save-interval",
        "3",
        "--log-interval",
        "5",
        "--data-cache-path",
        str(tmp_path),
    ]
    for extra in ([], ["--load", ckpt, "--ckpt-step", "3", "--lr", "9e-3", "--override-opt_param-scheduler"]):
        run = pretraining(configs(argv + extra))
        run.train()
        run.groups.destroy()
    resumed = [h["lm_loss"] for h in run.history]
    events = EventAccumulator(tb)
    events.Reload()
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [8, 16, 24, 32, 40, 48]
    assert [e.step for e in events.Scalars("learning-rate")] == [1, 2, 3, 4, 5, 6]
    # with the console lines of a run never stopped (the first, every --log-interval, the last), not also at the
    # resume's first
    assert [e.step for e in events.Scalars("moe/layer0/max-mean-load-ratio")] == [1, 5, 6]
    assert [e.value for e in events.Scalars("lm loss")][3:] == pytest.approx(resumed, rel=1e-6)
    assert "arguments/text_summary" in events.Tags()["tensors"]  # the first run's, kept


# ---- bad configurations -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra,world,needle",
    [
        (["--num-experts", "3", "--expert-model-parallel-size", "1"], 2, None),
        (
            ["--expert-model-parallel-size", "3"],
            2,
            "--expert-model-parallel-size=3: must divide the number of processes",
        ),
        (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4, "--num-experts=6: must be divisible"),
        (["--global-batch-size", "10"], 2, "--global-batch-size (10) must be divisible"),
        (["--split", "100,0,0", "--eval-interval", "5"], 1, "--eval-interval=5: needs a validation split"),
    ],
)
def test_flag_combinations_fail_with_one_clear_message(extra, world, needle):
    cfg = configs(TINY + extra)
    if needle is None:
        validate(cfg, world)  # valid: 3 experts, no expert parallelism
        return
    with pytest.raises(ConfigError) as info:
        validate(cfg, world)
    assert needle in str(info.value)


def test_bad_values_and_missing_data_exit_with_one_line(tmp_path, capsys):
    """The first case through the script in a process of its own, the others through its entry point
    (moezero.recipe.main) in this one: exit code 2 and one error line each."""
    from tests.integration.scripts import script_in_process

    script = os.path.join(os.path.dirname(ASSETS), "..", "examples_moe", "pretrain_gpt_moe.py")
    cases = [
        (["--moe-router-topk", "9"], "--moe-router-topk=9: must be between 1 and --num-experts (4)"),
        (["--zero-stage", "4"], "--zero-stage"),
        (["--data-path", str(tmp_path / "missing")], "--data-path"),
    ]
    for number, (extra, needle) in enumerate(cases):
        argv = TINY + extra + ["--data-cache-path", str(tmp_path)]
        if number == 0:
            proc = subprocess.run([sys.executable, script] + argv, capture_output=True, text=True, timeout=120)
            code, err = proc.returncode, proc.stderr
        else:
            proc = script_in_process(argv, capsys)
            code, err = proc.returncode, proc.stderr
        assert code == 2, err
        errors = [line for line in err.splitlines() if "error" in line]
        assert len(errors) == 1 and needle in errors[0], err


def test_missing_data_is_a_data_error(tmp_path):
    from moezero.data import build_datasets

    cfg = configs(TINY + ["--data-path", str(tmp_path / "nothing")])
    with pytest.raises(DataError, match="--data-path"):
        build_datasets(cfg.data, 32, 1, num_samples=(8, 0, 0))


# ---- golden losses ------------------------------------------------------------------------------------
GOLDEN = os.path.join(ASSETS, "golden_losses.json")
GOLDEN_ARGS = TINY + ["--train-iters", "10"] + FP64


def _recorded_args():
    """GOLDEN_ARGS as the file records them (the data path relative to the repository)."""
    repo = os.path.dirname(os.path.dirname(ASSETS))
    return [os.path.relpath(a, repo) if a.startswith(ASSETS) else a for a in GOLDEN_ARGS]


def test_golden_loss_curve(tmp_path, capsys):
    """float64, so another CPU's kernels (other SIMD widths, other summation orders) agree to ~1e-13.
    The file records the arguments it was made with: a regeneration with other arguments (or a change of
    these) fails here instead of passing silently. Regenerate (after an intended change, and only then):
    python -m tests.integration.test_pretrain. The absolute oracle is tests/unit/test_gpt_oracle.py."""
    with open(GOLDEN) as f:
        recorded = json.load(f)
    assert recorded["args"] == _recorded_args(), "the golden file was made with other arguments"
    golden = recorded["lm_loss"]
    losses = [h["lm_loss"] for h in train(GOLDEN_ARGS, str(tmp_path))]
    # GELU and biases in MoE layers without --no-bias-gelu-fusion: the tanh GELU, which Megatron refuses there
    assert "the MLPs and experts use the tanh GELU" in capsys.readouterr().out
    assert len(losses) == len(golden)
    for i, (a, b) in enumerate(zip(losses, golden)):
        assert math.isclose(a, b, rel_tol=1e-9), (i, a, b)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        values = [h["lm_loss"] for h in train(GOLDEN_ARGS, cache)]
    with open(GOLDEN, "w") as f:
        json.dump({"args": _recorded_args(), "lm_loss": values}, f, indent=1)
    print(f"wrote {GOLDEN}: {values}")
