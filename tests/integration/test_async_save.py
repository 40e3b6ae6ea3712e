"""--async-save: the checkpoint is written in the background while training goes on, published (with its
checksums) only once every rank finished; a resume from it equals the straight run; a save still in flight
publishes nothing."""

import concurrent.futures
import os

import pytest

from moezero import checkpoint
from moezero.checkpoint import CheckpointError
from moezero.checkpoint.lock import LOCK
from moezero.checkpoint.pending import PendingSave
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, train

FP64 = ["--fp64", "--train-iters", "6"]


def _losses(history):
    return [h["lm_loss"] for h in history]


def _resume_equals_the_straight_run(cache):
    ckpt = os.path.join(cache, "ckpt")
    straight = train(TINY + FP64, cache)
    first = train(TINY + FP64 + ["--save", ckpt, "--save-interval", "2", "--async-save", "--exit-interval", "4"], cache)
    assert checkpoint.saved_iterations(ckpt) == [2, 4] and checkpoint.latest_iteration(ckpt) == 4
    assert not checkpoint.unfinished_saves(ckpt)
    manifest = os.path.join(checkpoint.iteration_dir(ckpt, 4), "checksums.json")
    assert os.path.exists(manifest)  # the background writer hashed its shards too; the resume verifies them
    second = train(TINY + FP64 + ["--load", ckpt], cache)
    return _losses(first) + _losses(second) == _losses(straight)


def test_an_async_checkpoint_resumes_the_run_exactly(tmp_path):
    assert _resume_equals_the_straight_run(str(tmp_path))


def test_an_async_checkpoint_resumes_the_run_exactly_on_two_ranks(tmp_path):
    cache = str(tmp_path)
    assert all(run_distributed(_resume_equals_the_straight_run, 2, cache, timeout=240))


def test_a_save_in_flight_publishes_nothing_and_a_failed_one_is_one_error(tmp_path):
    root = str(tmp_path / "ckpt")
    train(TINY + ["--train-iters", "2", "--save", root], str(tmp_path))
    published = []
    never = concurrent.futures.Future()
    pending = PendingSave(never, checkpoint.iteration_dir(root, 4), lambda: published.append(4), None)
    assert not pending.done_everywhere()  # the job may stop here: nothing is published
    assert checkpoint.latest_iteration(root) == 2 and published == []
    failed = concurrent.futures.Future()
    failed.set_exception(OSError(28, "No space left on device"))
    with pytest.raises(CheckpointError, match="--async-save: writing .*iter_0000004 failed \\(OSError: .*No space"):
        PendingSave(failed, checkpoint.iteration_dir(root, 4), lambda: published.append(4), None).finish()
    assert checkpoint.latest_iteration(root) == 2 and published == []
    # what DCP's writer raises: a CheckpointException, a BaseException in torch (it escaped as a traceback)
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.utils import _wrap_exception

    try:
        raise OSError(28, "No space left on device")
    except OSError as exc:
        wrapped = _wrap_exception(exc)
    failed = concurrent.futures.Future()
    failed.set_exception(CheckpointException("write failed", {0: wrapped}))
    # the cause a rank reported, as the synchronous save says it (not "CheckpointException ranks: ...")
    with pytest.raises(CheckpointError, match="--async-save: writing .*iter_0000004 failed \\(OSError: .*No space"):
        PendingSave(failed, checkpoint.iteration_dir(root, 4), lambda: published.append(4), None).finish()
    assert checkpoint.latest_iteration(root) == 2 and published == []


def test_the_last_checkpoint_is_published_before_the_end_of_run_work_and_a_signal_waits_for_it(tmp_path, monkeypatch):
    """The end of a run: the last (background) checkpoint published before the test split's evaluation (a job's
    grace goes to it), and the signal handlers still installed while it is written (a SIGTERM then killed it)."""
    import signal

    from moezero.recipe import pretraining
    from moezero.training.pretrain import Pretraining
    from tests.integration.pretrain_utils import configs

    root = str(tmp_path / "ckpt")
    seen = {}
    evaluate, save = Pretraining._evaluate, Pretraining._save

    def evaluate_and_look(self, split):
        if split == "test":
            seen["latest at the test evaluation"] = checkpoint.latest_iteration(root)
        return evaluate(self, split)

    def save_and_look(self):
        seen["handler during the save"] = signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        return save(self)

    monkeypatch.setattr(Pretraining, "_evaluate", evaluate_and_look)
    monkeypatch.setattr(Pretraining, "_save", save_and_look)
    run = pretraining(
        configs(
            TINY
            + [
                "--train-iters",
                "3",
                "--save",
                root,
                "--async-save",
                "--exit-signal-handler",
                "--split",
                "80,10,10",
                "--eval-iters",
                "1",
                "--data-cache-path",
                str(tmp_path),
            ]
        )
    )
    run.train()
    run.groups.destroy()
    assert seen == {"handler during the save": True, "latest at the test evaluation": 3}
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back once it is written


def test_a_full_disk_during_an_async_save_is_one_line_naming_it(tmp_path):
    """--save on a 2 MB tmpfs (as test_faults' synchronous case): the first checkpoint fits, the second does not.
    torch's background writer reports it as 'unexpected pos 704 vs 598'; the error says what the synchronous save
    says, 'No space left on device', naming the folder; `latest` stays the first and no partial folder is left."""
    import subprocess

    from moezero.recipe import pretraining
    from tests.integration.pretrain_utils import configs

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        save = str(disk / "ckpt")
        run = pretraining(
            configs(
                TINY
                + [
                    "--train-iters",
                    "6",
                    "--save",
                    save,
                    "--save-interval",
                    "2",
                    "--async-save",
                    "--data-cache-path",
                    str(tmp_path),
                ]
            )
        )
        try:
            with pytest.raises(CheckpointError) as failed:
                run.train()
        finally:
            run.groups.destroy()
        message = str(failed.value)
        assert (
            message.startswith(
                f"--async-save: writing {checkpoint.iteration_dir(save, 4)} failed (No space left on device"
            )
            and len(message.splitlines()) == 1
        ), message
        assert checkpoint.latest_iteration(save) == 2 and not checkpoint.unfinished_saves(save)
        assert not os.path.exists(os.path.join(save, LOCK))  # a run that fails frees its --save too
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
