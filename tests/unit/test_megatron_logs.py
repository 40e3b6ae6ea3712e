"""The console line as Megatron's training_log prints it (megatron/training/training.py, megatron-core 0.19.2):
its fields in its order and formats, the losses averaged over the iterations since the last line, the MoE
losses under its tracker's names (mean over MoE layers, before the coefficient), the skipped and nan counts of
the interval, the learning rate its scheduler holds after the step; moezero's fields after Megatron's."""

import math
import re

import pytest

from moezero.training.log_interval import LogInterval
from moezero.training.lr_schedule import LearningRateSchedule
from tests.integration.pretrain_utils import TINY, configs, train

MEGATRON_LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| "
    r"elapsed time per iteration \(ms\): \d+\.\d \| learning rate: (\S+) \| global batch size: +8 \| "
    r"lm loss: (\d\.\d{6}E[+-]\d\d) \| load_balancing_loss: (\S+) \| z_loss: (\S+) \| loss scale: 1\.0 \| "
    r"grad norm: \d+\.\d{3} \| number of skipped iterations: +0 \| number of nan iterations: +0 \| "
    r"tokens/s: \d+ \| .* \| ETA: \S+ \|$"
)


def test_the_console_line_is_megatrons(tmp_path, capsys):
    history = train(TINY + ["--train-iters", "6", "--log-interval", "4"], str(tmp_path))
    lines = [line for line in capsys.readouterr().out.splitlines() if "] iteration " in line]
    parsed = [MEGATRON_LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [int(m[1]) for m in parsed] == [1, 4, 6] and {int(m[2]) for m in parsed} == {6}  # first, every 4th, last
    assert [int(m[3]) for m in parsed] == [8, 32, 48]
    losses = [h["lm_loss"] for h in history]
    # the mean since the last line; the first line keeps its sums (Megatron's should_reset = not
    # is_first_iteration), so the line at 4 averages from the run's start
    for m, window in zip(parsed, (losses[0:1], losses[0:4], losses[4:6])):
        assert m[5] == f"{sum(window) / len(window):.6E}"
    schedule = LearningRateSchedule.from_config(configs(TINY + ["--train-iters", "6"]).train)
    assert [float(m[4]) for m in parsed] == pytest.approx([schedule.lr(8 * i) for i in (1, 4, 6)], rel=1e-6)
    assert all(0.5 < float(m[6]) < 2 for m in parsed)  # Switch's loss is ~1 for balanced routing (no coefficient)


def test_an_interval_averages_stepped_iterations_and_counts_the_rest():
    interval = LogInterval()
    interval.add(0.1, {"lm_loss": 2.0, "z_loss": 1.0}, True)
    interval.add(0.3, {"lm_loss": float("nan"), "z_loss": 5.0}, False)  # skipped, not finite: a nan iteration
    interval.add(0.2, {"lm_loss": 4.0, "z_loss": 3.0}, True)
    interval.add(0.2, {"lm_loss": 9.0, "z_loss": 9.0}, False)  # skipped (an fp16 overflow)
    assert interval.summary() == pytest.approx(
        {"lm_loss": 3.0, "z_loss": 2.0, "step_time_ms": 200.0, "skipped_iterations": 2, "nan_iterations": 1}
    )
    interval.reset()
    assert interval.summary() == {"step_time_ms": 0.0, "skipped_iterations": 0, "nan_iterations": 0}
    assert math.isfinite(interval.summary()["step_time_ms"])


def test_a_line_whose_every_step_was_skipped_shows_no_loss(tmp_path, capsys):
    """fp16 overflows from a huge initial loss scale skip every step: Megatron's line then has no lm loss (its
    averages add stepped iterations only) and counts the skips; the last step's own loss is not shown instead."""
    train(TINY + ["--train-iters", "2", "--log-interval", "2", "--fp16", "--initial-loss-scale", "1e38"], str(tmp_path))
    lines = [line for line in capsys.readouterr().out.splitlines() if "] iteration " in line]
    assert len(lines) == 2 and "number of skipped iterations:   1" in lines[0], lines
    assert not any("lm loss" in line or "load_balancing_loss" in line for line in lines), lines


def test_wandb_gets_the_scalars_tensorboard_gets(tmp_path, monkeypatch):
    """Megatron's --wandb-* flags; an offline run (local files, no network) read back: the same scalars at the
    same iterations as TensorBoard, and the run's flags as its config."""
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.wandb_records import history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tb, runs = str(tmp_path / "tb"), str(tmp_path / "wandb")
    train(
        TINY
        + [
            "--train-iters",
            "3",
            "--tensorboard-dir",
            tb,
            "--wandb-project",
            "moezero-test",
            "--wandb-exp-name",
            "tiny",
            "--wandb-save-dir",
            runs,
        ],
        str(tmp_path),
    )
    rows = history(runs)
    assert sorted(rows) == [1, 2, 3]
    events = EventAccumulator(tb)
    events.Reload()
    for tag in (
        "lm loss",
        "learning-rate",
        "grad-norm",
        "loss-scale",
        "load_balancing_loss",
        "z_loss",
        "moe/layer0/max-mean-load-ratio",
    ):
        board = {e.step: e.value for e in events.Scalars(tag)}
        assert {step: rows[step][tag] for step in board} == pytest.approx(board, rel=1e-6), tag
    assert not any(key.endswith(" vs samples") for row in rows.values() for key in row)  # TensorBoard's only


def test_wandb_needs_a_place_to_write():
    from moezero.config import ConfigError
    from moezero.training.configs import validate

    with pytest.raises(ConfigError, match="--wandb-project=p: needs --wandb-save-dir or --save"):
        validate(configs(TINY + ["--wandb-project", "p"]), world_size=1)
    with pytest.raises(ConfigError, match="--wandb-exp-name='': give the W&B run a name"):
        configs(TINY + ["--wandb-project", "p", "--wandb-exp-name", ""])


def test_gpu_memory_tags_are_megatrons(monkeypatch):
    """--log-memory-to-tensorboard on a GPU: Megatron's four tags from the caching allocator's statistics."""
    import torch

    from moezero.metrics import tensorboard_scalars
    from moezero.training.pretrain import megatron_cuda_memory

    stats = {
        "reserved_bytes.all.current": 4096,
        "allocated_bytes.all.current": 1024,
        "allocated_bytes.all.peak": 2048,
        "allocation.all.current": 7,
    }
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: stats)
    assert tensorboard_scalars(megatron_cuda_memory()) == {
        "mem-reserved-bytes": 4096,
        "mem-allocated-bytes": 1024,
        "mem-max-allocated-bytes": 2048,
        "mem-allocated-count": 7,
    }
