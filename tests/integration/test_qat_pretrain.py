"""QAT in the pretraining script: schedule through a checkpoint resume, TensorBoard scalars, the export
and evaluation tools, and one-line errors for bad QAT flags."""

import importlib.util
import os

import pytest
import torch

from moezero import checkpoint
from moezero.checkpoint.keys import plain_param_name
from moezero.config import ConfigError
from moezero.recipe import pretraining
from tests.integration.pretrain_utils import ASSETS, CORPUS, TINY, configs
from tests.integration.scripts import script_in_process

ROOT = os.path.dirname(os.path.dirname(ASSETS))
QAT = ["--qat-weight-bits", "4", "--qat-groups", "16"]
SCHEDULE = QAT + ["--qat-start-bits", "6", "--qat-bits-period", "2", "--qat-schedule-offset", "1"]


def _run(argv, cache_dir):
    run = pretraining(configs(argv + ["--data-cache-path", cache_dir]))
    run.train()
    run.groups.destroy()
    return run


def _schedule(run):
    qat = run.plugins["qat"]
    return qat.step, qat.bits


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bit_schedule_survives_a_checkpoint_resume_and_is_logged(tmp_path):
    cache, ckpt, tb = str(tmp_path), str(tmp_path / "ckpt"), str(tmp_path / "tb")
    argv = TINY + ["--train-iters", "8"] + SCHEDULE
    straight = _run(argv + ["--log-interval", "2", "--tensorboard-dir", tb], cache)
    first = _run(argv + ["--exit-interval", "4", "--save", ckpt], cache)
    assert _schedule(first) == (4, 5)
    second = _run(argv + ["--load", ckpt], cache)
    assert _schedule(second) == _schedule(straight) == (8, 4)
    resumed = [h["lm_loss"] for h in first.history + second.history]
    assert resumed == [h["lm_loss"] for h in straight.history]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    assert {"qat/bits/attention", "qat/bits/experts", "qat/quant-error/experts"} <= set(events.Tags()["scalars"])
    # with each console line: iteration 1 (Megatron's first line), then every 2
    assert [(e.step, e.value) for e in events.Scalars("qat/bits/experts")] == [
        (1, 6.0),
        (2, 6.0),
        (4, 5.0),
        (6, 4.0),
        (8, 4.0),
    ]
    errors = [e.value for e in events.Scalars("qat/quant-error/experts")]
    assert 0 < errors[0] < errors[-1] < 0.5  # fewer bits, larger error


def test_skipped_fp16_steps_do_not_advance_the_bit_schedule(tmp_path):
    """The schedule counts optimizer steps taken, as DeepSpeed's MoQ (it skips quantize on an overflow): an fp16
    run whose huge initial loss scale overflows the first steps stays at the start bits for them."""
    ckpt = str(tmp_path / "ckpt")
    fp16 = TINY + ["--fp16", "--initial-loss-scale", "1048576"] + SCHEDULE
    run = _run(fp16 + ["--train-iters", "8", "--save", ckpt], str(tmp_path))
    skipped = run.opt.skipped_steps
    assert 0 < skipped < 8 and _schedule(run)[0] == 8 - skipped
    # the count is the run's, not the optimizer's: --no-load-optim (skip counts start over) keeps the schedule
    resumed = _run(fp16 + ["--train-iters", "9", "--load", ckpt, "--no-load-optim"], str(tmp_path))
    assert _schedule(resumed)[0] == 9 - skipped - resumed.opt.skipped_steps


def test_export_and_eval_tools(tmp_path, capsys):
    cache = str(tmp_path)
    ckpt, plain = str(tmp_path / "qat"), str(tmp_path / "plain")
    _run(TINY + QAT + ["--train-iters", "2", "--save", ckpt], cache)
    _run(TINY + ["--train-iters", "2", "--save", plain], cache)
    export, evaluate = _tool("export_quantized"), _tool("eval_quantized")
    out = str(tmp_path / "qat.mzq")
    assert export.main(["--load", ckpt, "--output", out]) == 0
    blob = torch.load(out, weights_only=True)
    w1 = blob["quantized"]["layers.0.mlp.experts.w1"]
    assert w1["codes"].dtype == torch.uint8 and w1["codes"].numel() * 2 == w1["units"] * 32 * 128
    assert (
        export.main(
            [
                "--load",
                plain,
                "--output",
                str(tmp_path / "ptq.mzq"),
                "--weight-bits",
                "8",
                "--no-symmetric",
                "--modules",
                "attention,experts,router,embedding",
            ]
        )
        == 0
    )
    with pytest.raises(SystemExit):
        export.main(["--load", plain, "--output", str(tmp_path / "x.mzq")])  # no QAT, no --weight-bits
    assert "--weight-bits" in capsys.readouterr().err
    data = ["--data-path", CORPUS, "--split", "98,2,0", "--data-cache-path", cache, "--eval-samples", "8"]
    assert evaluate.main(["--quantized", out, "--load", ckpt] + data) == 0
    report = capsys.readouterr().out
    losses = {
        line.split("|")[0].split("(")[0].strip(): float(line.split("lm loss:")[1].split("|")[0])
        for line in report.splitlines()
        if "lm loss:" in line
    }
    assert set(losses) == {"fp model", "fake-quant model", "exported model"}
    assert f"samples of the validation split of --data-path {CORPUS}, world 1" in report  # says what it read
    assert losses["fake-quant model"] == pytest.approx(losses["exported model"], rel=1e-6)
    assert losses["fp model"] != losses["exported model"]


def test_bad_qat_flags_fail_with_one_clear_message(tmp_path, capsys):
    with pytest.raises(ConfigError, match="--qat-weight-bits=17: must be between 2 and 16"):
        configs(TINY + ["--qat-weight-bits", "17"])
    proc = script_in_process(
        TINY + ["--qat-weight-bits", "4", "--qat-groups", "5", "--data-cache-path", str(tmp_path)], capsys
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "--qat-groups=5: does not divide layers.0.attention.qkv.weight" in errors[0], (
        proc.stderr
    )


def test_qat_fine_tunes_a_plain_checkpoint_and_a_plain_run_resumes_a_qat_one(tmp_path):
    """The usual MoQ workflow: QAT from a pretrained (plain) checkpoint; QAT's params are saved under torch's
    parametrized names ('parametrizations.weight.original'), a plain model's under the plain ones. Either way
    the weights load (a raw KeyError before)."""
    cache, plain, quantized = str(tmp_path), str(tmp_path / "plain"), str(tmp_path / "qat")
    _run(TINY + ["--train-iters", "2", "--save", plain], cache)
    tuned = _run(TINY + QAT + ["--train-iters", "2", "--load", plain, "--finetune", "--save", quantized], cache)
    resumed = _run(TINY + QAT + ["--train-iters", "3", "--load", plain], cache)  # optimizer state too
    assert tuned.iteration == 2 and resumed.iteration == 3
    saved = {
        plain_param_name(k): v
        for k, v in checkpoint.consolidate_checkpoint(checkpoint.iteration_dir(quantized, 2)).items()
    }
    back = pretraining(configs(TINY + ["--train-iters", "3", "--load", quantized, "--data-cache-path", cache]))
    with back.opt.full_parameters():
        for name, p in back.model.named_parameters():
            assert torch.equal(p.detach(), saved[name].to(p.dtype)), name  # the QAT run's fp32 masters
    back.train()
    back.groups.destroy()
    assert back.iteration == 3
