"""The data position is the samples a run consumed (Megatron's consumed samples): a resume with another
--global-batch-size, a batch-size ramp and the validation windows all read on from where the run stood."""

import pytest

from moezero import checkpoint
from moezero.config import ConfigError
from tests.integration.pretrain_utils import TINY, TINY_SAMPLES, configs
from moezero.recipe import pretraining


class Recording:
    """A split that remembers which global sample indices were read, in order."""

    def __init__(self, samples):
        self.samples, self.read = samples, []

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        self.read.append(int(index))
        return self.samples[index]


def _run(argv, cache):
    run = pretraining(configs(argv + ["--data-cache-path", cache]))
    run.data.train = Recording(run.data.train)
    if run.data.valid is not None:
        run.data.valid = Recording(run.data.valid)
    run.train()
    run.groups.destroy()
    return run


def _saved_progress(root):
    return checkpoint.read_train_state(checkpoint.iteration_dir(root, checkpoint.latest_iteration(root)))["progress"]


def test_a_resume_with_another_batch_size_reads_on_from_the_consumed_samples(tmp_path):
    cache, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    evals = ["--eval-interval", "2", "--eval-iters", "1"]
    first = _run(TINY + evals + ["--train-iters", "10", "--exit-interval", "5", "--save", ckpt], cache)
    assert first.data.train.read == list(range(40))
    assert first.data.valid.read == list(range(16))  # evaluations at 2 and 4: windows 0..7 and 8..15
    assert _saved_progress(ckpt)["consumed_train_samples"] == 40
    resume = TINY + evals + ["--train-iters", "10", "--global-batch-size", "16", "--load", ckpt, "--save", ckpt]
    with pytest.raises(ConfigError, match="learning-rate schedule differs"):  # in samples, as Megatron's
        _run(resume, cache)
    second = _run(resume + ["--override-opt_param-scheduler"], cache)
    assert second.data.train.read[:16] == list(range(40, 56))  # not 80..95 (iteration 5 x 16)
    assert second.data.train.read == list(range(40, 120))
    # at 6, 8 and 10 (batches of 16 now), then once after the final save (Megatron's): not in the checkpoint
    assert second.data.valid.read == list(range(16, 16 + 4 * 16))
    assert [h["iteration"] for h in second.history] == [6, 7, 8, 9, 10]
    assert _saved_progress(ckpt)["consumed_train_samples"] == 120
    assert _saved_progress(ckpt)["consumed_valid_samples"] == 64


def test_a_ramp_grows_the_batch_by_consumed_samples_and_resumes_on_it(tmp_path):
    cache, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    ramp = TINY_SAMPLES + [
        "--rampup-batch-size",
        "4",
        "4",
        "24",
        "--global-batch-size",
        "16",
        "--train-samples",
        "80",
        "--lr-warmup-samples",
        "8",
    ]
    straight = _run(ramp, cache)
    sizes = [4, 4, 8, 12, 16, 16, 16]  # Megatron 0.16.1's count: the partial last batch is dropped
    assert len(straight.history) == len(sizes) and straight.data.train.read == list(range(sum(sizes)))
    # 2 worker processes read ahead (nothing recorded here then): they only read, the numbers stay
    first = _run(ramp + ["--exit-interval", "3", "--save", ckpt, "--num-workers", "2"], cache)
    assert first.progress.consumed_train_samples == 16
    # Megatron's checkpoint whenever the number of micro-batches changes (before steps 3 and 4: 4 -> 8 -> 12)
    assert checkpoint.saved_iterations(ckpt) == [2, 3]
    second = _run(ramp + ["--load", ckpt], cache)
    assert second.data.train.read == list(range(16, sum(sizes)))
    assert [h["lm_loss"] for h in first.history + second.history] == [h["lm_loss"] for h in straight.history]


def test_validation_runs_at_each_interval_then_after_the_final_save(tmp_path, capsys):
    """Megatron's order: in the loop only at multiples of --eval-interval; after training (and its final save)
    one more validation, printed '... on validation set', whose window the checkpoint does not count, so a
    longer run resumed from it validates there again. The last iteration off the interval (5) is not an in-loop
    validation."""
    cache, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    evals = ["--eval-interval", "2", "--eval-iters", "1"]
    first = _run(TINY + evals + ["--train-iters", "5", "--save", ckpt], cache)
    out = capsys.readouterr().out
    assert first.data.valid.read == list(range(24))  # at 2 and 4, then after training
    assert [line.split("|")[0].strip() for line in out.splitlines() if "validation loss at" in line] == [
        "validation loss at iteration 2",
        "validation loss at iteration 4",
        "validation loss at iteration 5 on validation set",
    ]
    assert _saved_progress(ckpt)["consumed_valid_samples"] == 16
    longer = _run(TINY + evals + ["--train-iters", "6", "--load", ckpt, "--save", ckpt], cache)
    assert longer.data.valid.read == list(range(16, 32))  # at 6 the window after-training read, then the next
