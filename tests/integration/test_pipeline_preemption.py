"""Stopping and saving at --pipeline-model-parallel-size 2 (the script's entry point in-process on 2 gloo ranks): a
SIGTERM that reaches one stage only, or --exit-duration-in-mins, stops every stage after the same iteration, which
every rank saves and the resume continues on the uninterrupted run's curve (float64, 1e-10); a stage that cannot
write its part leaves nothing published, and every rank says so."""

import signal

import torch.distributed as dist

from moezero import checkpoint
from moezero.checkpoint import checksums
from moezero.checkpoint.errors import CheckpointError
from moezero.training.stopping import StopConditions
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import run_in_process
from tests.integration.test_pipeline_pretrain import PIPELINE_TINY, PP2, TOL, _values

ARGV = PIPELINE_TINY + ["--eval-interval", "0"]


def _sigterm_to_rank_0_after(iteration):
    """StopConditions as if the scheduler's SIGTERM reached rank 0 (the first stage, which does not log) during
    `iteration`, and no other rank. Returns the undo."""
    reason = StopConditions.reason

    def signalled(self, done):
        if done == iteration and dist.get_rank() == 0:
            signal.raise_signal(signal.SIGTERM)  # the handler records it
        return reason(self, done)

    StopConditions.reason = signalled
    return lambda: setattr(StopConditions, "reason", reason)


def _stopped_and_resumed(argv, by_signal, by_duration):
    """At pp 2: a run stopped by SIGTERM on one rank after iteration 2 and resumed to the end; a run stopped by
    --exit-duration-in-mins after its first iteration. (curve, stop reason, latest saved) of each."""
    undo = _sigterm_to_rank_0_after(2)
    try:
        run = _run_keeping(argv + PP2 + ["--exit-signal-handler", "--save", by_signal])
    finally:
        undo()
    resumed = _run_keeping(argv + PP2 + ["--load", by_signal, "--save", by_signal])
    timed = _run_keeping(argv + PP2 + ["--exit-duration-in-mins", "1e-9", "--save", by_duration])
    return [
        (run[0] + resumed[0], run[1], checkpoint.latest_iteration(by_signal)),
        (timed[0], timed[1], checkpoint.latest_iteration(by_duration)),
    ]


def _run_keeping(argv):
    """(history, stop reason) of one in-process run."""
    from moezero.recipe import pretraining
    from tests.integration.pretrain_utils import configs

    run = pretraining(configs(argv))
    try:
        run.train()
    finally:
        run.destroy_groups()
    return run.history, run.stop_reason


def test_sigterm_on_one_stage_and_the_duration_limit_stop_every_stage_after_the_same_saved_iteration(tmp_path):
    argv = ARGV + ["--data-cache-path", str(tmp_path)]
    by_signal, by_duration = str(tmp_path / "signal"), str(tmp_path / "duration")
    ranks = run_distributed(_stopped_and_resumed, 2, argv, by_signal, by_duration, timeout=400)
    straight = _values(run_in_process(argv)[0])
    for (curve, reason, latest), (timed, timed_reason, timed_latest) in ranks:
        assert reason == "received SIGTERM" and latest == 4, (reason, latest)  # stopped at 2, resumed to the end
        assert [h["iteration"] for h in curve] == [1, 2, 3, 4]
        for step, (a, b) in enumerate(zip(_values(curve), straight)):
            for x, y in zip(a, b):
                assert (x is None and y is None) or abs(x - y) <= TOL * abs(y), (step, a, b)
        assert timed_reason.startswith("--exit-duration-in-mins=1e-09 reached") and timed_latest == 1
        assert [h["iteration"] for h in timed] == [1]
    assert checkpoint.saved_iterations(by_signal) == [2, 4] and not checkpoint.unfinished_saves(by_signal)


def _a_stage_fails_to_write(argv, save):
    """At pp 2 with --save-interval 1: rank 1 (the last stage) cannot write its part of iteration 2. (latest saved,
    the error each rank raised)"""
    write_data = checksums.HashingWriter.write_data

    def failing(self, plan, planner):
        if dist.get_rank() == 1 and "iter_0000002" in str(self.path):
            raise OSError(28, "No space left on device")
        return write_data(self, plan, planner)

    checksums.HashingWriter.write_data = failing
    try:
        _run_keeping(argv + PP2 + ["--save", save, "--save-interval", "1"])
    except CheckpointError as exc:
        return checkpoint.latest_iteration(save), str(exc)
    finally:
        checksums.HashingWriter.write_data = write_data
    return checkpoint.latest_iteration(save), None


def test_a_stage_that_cannot_write_its_part_leaves_nothing_published(tmp_path):
    save = str(tmp_path / "ckpt")
    ranks = run_distributed(_a_stage_fails_to_write, 2, ARGV + ["--data-cache-path", str(tmp_path)], save, timeout=400)
    for latest, error in ranks:
        assert latest == 1, latest
        assert (
            error is not None and "saving iteration 2 failed" in error and "previous checkpoint stays latest" in error
        )
    assert checkpoint.saved_iterations(save) == [1] and not checkpoint.unfinished_saves(save)
