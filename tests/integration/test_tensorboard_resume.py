"""A resume rewrites only its own run's TensorBoard event files (their names are recorded in each checkpoint), says
what it dropped, and never touches another run's file in the same folder (`make train` and the example script
both log to runs/gpt_moe_small)."""

import glob
import hashlib
import os

from moezero import checkpoint
from moezero.recipe import pretraining
from moezero.training.tensorboard_resume import trim_after
from tests.integration.pretrain_utils import TINY, configs


def _run(argv, cache):
    run = pretraining(configs(TINY + argv + ["--data-cache-path", cache]))
    run.train()
    run.groups.destroy()
    return run


def _files(tb):
    return set(glob.glob(os.path.join(tb, "events.out.tfevents.*")))


def _digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _steps(path, tag="lm loss"):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [
        e.step
        for e in EventFileLoader(path).Load()
        if e.HasField("summary") and e.summary.value and e.summary.value[0].tag == tag
    ]


def test_a_resume_rewrites_only_its_own_runs_event_files_and_says_so(tmp_path, capsys):
    tb, ckpt, cache = str(tmp_path / "tb"), str(tmp_path / "ckpt"), str(tmp_path)
    common = ["--train-iters", "4", "--tensorboard-dir", tb, "--log-interval", "1"]
    _run(common, cache)  # another run in the same folder
    (other,) = _files(tb)
    other_digest = _digest(other)
    _run(common + ["--save", ckpt, "--save-interval", "2", "--seed", "8"], cache)
    (first,) = _files(tb) - {other}
    assert checkpoint.read_train_state(checkpoint.iteration_dir(ckpt, 2))["tensorboard_files"] == [
        os.path.basename(first)
    ]
    out = capsys.readouterr().out
    assert f" TensorBoard: events to {first} (view: tensorboard --logdir {tb})" in out
    _run(common + ["--load", ckpt, "--ckpt-step", "2", "--save", ckpt, "--save-interval", "2", "--seed", "8"], cache)
    out = capsys.readouterr().out
    dropped = [line for line in out.splitlines() if "TensorBoard: dropped" in line]
    assert len(dropped) == 1 and f"logged after iteration 2 (steps 3-4) from {first}" in dropped[0], out
    (resumed,) = _files(tb) - {other, first}
    assert _digest(other) == other_digest and _steps(other) == [1, 2, 3, 4]  # never rewritten
    assert _steps(first) == [1, 2] and _steps(resumed) == [3, 4]
    # the lineage: the resumed run's checkpoints name both of its files, so a later resume trims both
    assert sorted(checkpoint.read_train_state(checkpoint.iteration_dir(ckpt, 4))["tensorboard_files"]) == sorted(
        os.path.basename(f) for f in (first, resumed)
    )


def test_a_checkpoint_that_records_no_event_files_rewrites_none(tmp_path):
    """A checkpoint saved before the names were recorded: nothing is rewritten, and a line says so."""
    tb, cache = str(tmp_path / "tb"), str(tmp_path)
    _run(["--train-iters", "3", "--tensorboard-dir", tb], cache)
    (only,) = _files(tb)
    before = _digest(only)
    lines = trim_after(tb, 1, 8, None)
    assert len(lines) == 1 and "does not record which event files" in lines[0] and _digest(only) == before
    assert trim_after(tb, 1, 8, []) == [] and _digest(only) == before  # a lineage that logged nothing here


def _two_rank_run(tmp):
    tb, ckpt = os.path.join(tmp, "tb"), os.path.join(tmp, "ckpt")
    _run(["--train-iters", "2", "--tensorboard-dir", tb, "--save", ckpt], tmp)
    return checkpoint.read_train_state(checkpoint.iteration_dir(ckpt, 2))["tensorboard_files"]


def test_every_rank_records_rank_0s_event_file(tmp_path):
    """Only rank 0 writes events; DCP keeps one rank's copy of the train state, so every rank must hold its names."""
    from tests.dist_utils import run_distributed

    recorded = run_distributed(_two_rank_run, 2, str(tmp_path), timeout=240)
    assert recorded[0] == recorded[1] == [os.path.basename(f) for f in _files(str(tmp_path / "tb"))]
