"""Batch-size ramps (--rampup-batch-size against megatron-core's own calculator, --step-batch-size-schedule)
and the sample-counting lr schedule along them."""

import logging

import pytest

from moezero.config import ConfigError
from moezero.training.batch_schedule import BatchSchedule
from moezero.training.configs import TrainConfig, validate
from moezero.training.lr_schedule import LearningRateSchedule
from tests.integration.pretrain_utils import TINY, TINY_SAMPLES, configs


@pytest.mark.filterwarnings("ignore:Transformer Engine and Apex")
@pytest.mark.parametrize(
    "start,increment,samples,final",
    [(4, 4, 24, 16), (32, 32, 1000, 1024), (2, 6, 7, 20), (16, 16, 300_000, 4096), (8, 8, 3, 64)],
)
def test_rampup_is_megatrons(start, increment, samples, final):
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    logging.getLogger("megatron.core.num_microbatches_calculator").setLevel(logging.ERROR)
    megatron = RampupBatchsizeNumMicroBatchesCalculator(final, 1, 1, False, 1, start, increment, samples)
    ours = BatchSchedule.from_config(
        TrainConfig(global_batch_size=final, rampup_batch_size=[start, increment, samples]), 64
    )
    points = sorted(
        set(range(0, min(samples, 5000) + 3))
        | {samples // 3 * k + d for k in range(4) for d in (-1, 0, 1) if samples // 3 * k + d >= 0}
    )
    for consumed in points:
        megatron.update(consumed, consistency_check=False)
        assert ours.batch_size(consumed) == megatron.get_current_global_batch_size(), consumed


def test_step_schedule_counts_tokens_with_suffixes():
    t = TrainConfig(step_batch_size_schedule="0:8 1K:16, 2.5K:32")
    assert t.global_batch_size == 32  # the schedule's last size (Megatron's --global-batch-size then)
    assert TrainConfig(step_batch_size_schedule="0:8 1K:16, 2.5K:32", global_batch_size=32).global_batch_size == 32
    schedule = BatchSchedule.from_config(t, seq_length=100)  # thresholds: 0, 10, 25 samples
    assert [schedule.batch_size(c) for c in (0, 9, 10, 24, 25, 10**9)] == [8, 8, 16, 16, 32, 32]
    assert schedule.sizes_from(12) == [16, 32] and schedule.sizes_from(0) == [8, 16, 32]
    assert schedule.iterations_between(0, 100) == 6  # 0 8 16 32 64 96 -> 128
    assert schedule.consumed_after(0, 6) == 128
    assert BatchSchedule.from_config(TrainConfig(global_batch_size=8), 100).iterations_between(40, 100) == 7


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(step_batch_size_schedule="8:16 0:4 8:32"), "thresholds must differ"),
        (dict(step_batch_size_schedule="5:16"), "the first threshold must be 0"),
        (dict(step_batch_size_schedule="0-16"), "'0-16' is not THRESHOLD:BATCH_SIZE"),
        (dict(step_batch_size_schedule="0:8", rampup_batch_size=[4, 4, 8]), "not both"),
        (dict(step_batch_size_schedule="0:8 1K:16", global_batch_size=8), "schedule ends at 16: give that, or leave"),
        (
            dict(rampup_batch_size=[4, 5, 100], global_batch_size=16),
            "INCREMENT must divide --global-batch-size - START",
        ),
        (dict(rampup_batch_size=[32, 4, 100], global_batch_size=16), "START (<= --global-batch-size)"),
    ],
)
def test_bad_ramps_name_their_flag(kwargs, needle):
    with pytest.raises(ConfigError, match="--(rampup|step|global)-batch-size") as err:
        TrainConfig(**kwargs)
    assert needle in str(err.value)


def test_every_batch_still_to_come_must_split_into_micro_steps():
    cfg = configs(TINY + ["--rampup-batch-size", "2", "2", "64", "--global-batch-size", "8"])
    with pytest.raises(ConfigError, match="the batch-size ramp: a global batch of 2: .*divisible by --micro-batch"):
        validate(cfg, world_size=2)
    validate(cfg, world_size=2, start_iteration=40, consumed_samples=100)  # past the sizes 2 and 6: fine
    assert cfg.train.global_batch_size == 8


def test_train_samples_along_a_ramp_count_the_steps_they_take():
    cfg = configs(
        TINY_SAMPLES + ["--rampup-batch-size", "4", "4", "24", "--global-batch-size", "16", "--train-samples", "80"]
    )
    validate(cfg, world_size=1)
    # Megatron 0.16.1's update_train_iters: 4 4 8 12 over the ramp (28 > 24), then (80 - 28) // 16 = 3 whole
    # batches, the partial last one thrown away: 7 steps, 76 samples
    assert cfg.train.train_iters == 7
    assert BatchSchedule.from_config(cfg.train, 32).consumed_after(0, 7) == 76
    cfg = configs(TINY_SAMPLES + ["--train-samples", "100"])  # resumed at 40 with batch 8
    validate(cfg, world_size=1, start_iteration=5, consumed_samples=40)
    assert cfg.train.train_iters == 5 + 60 // 8


def test_the_lr_schedule_follows_consumed_samples():
    """Megatron's scheduler advances by each step's samples: along a ramp (or after a batch-size change) the
    lr is that of the samples consumed, not of the iteration."""
    t = TrainConfig(
        global_batch_size=16,
        train_samples=160,
        lr=1.0,
        min_lr=0.0,
        lr_warmup_samples=32,
        lr_decay_style="linear",
        rampup_batch_size=[4, 4, 24],
    )
    lr = LearningRateSchedule.from_config(t).lr
    assert lr(4) == pytest.approx(4 / 32) and lr(32) == pytest.approx(1.0)
    assert lr(96) == pytest.approx(1 - (96 - 32) / 128)
    iters = TrainConfig(global_batch_size=16, train_iters=10, lr=1.0, min_lr=0.0, lr_decay_style="linear")
    assert LearningRateSchedule.from_config(iters).lr(40) == pytest.approx(1 - 40 / 160)  # iteration 2.5 of 10


def _without_global_batch(argv):
    at = argv.index("--global-batch-size")
    return argv[:at] + argv[at + 2 :]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_without_global_batch_size_it_is_the_micro_batch_times_the_processes(world_size):
    """Megatron's validate_args: global_batch_size = micro_batch_size x data_parallel_size when not given
    (megatron/training/arguments.py), also for a --train-samples run's step count."""
    cfg = configs(_without_global_batch(TINY))
    assert cfg.train.global_batch_size is None
    assert validate(cfg, world_size=world_size) == 1 and cfg.train.global_batch_size == 2 * world_size
    samples = configs(_without_global_batch(TINY_SAMPLES) + ["--train-samples", "64"])
    validate(samples, world_size=world_size)
    assert samples.train.train_iters == 64 // (2 * world_size)
    assert LearningRateSchedule.from_config(samples.train).decay == 64
    with pytest.raises(ConfigError, match="--train-samples=2: must be >= --global-batch-size \\(4\\)"):
        validate(configs(_without_global_batch(TINY_SAMPLES) + ["--train-samples", "2"]), world_size=2)
