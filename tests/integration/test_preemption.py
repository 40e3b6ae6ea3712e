"""SIGTERM to torchrun with --exit-signal-handler: the workers finish the iteration, save it and exit;
resuming gives exactly the weights of a run that was never stopped."""

import os
import re
import signal
import sys

import pytest
import torch

from moezero import checkpoint
from moezero.checkpoint.lock import LOCK
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, run_in_process
from tests.integration.scripts import PRETRAIN, started, torchrun

# 1000 planned iterations with a fixed decay length: the schedule and the data order do not depend on
# where a run stops, so runs stopped at different points are comparable
PLAN = TINY + [
    "--train-iters",
    "1000",
    "--lr-decay-iters",
    "40",
    "--expert-model-parallel-size",
    "2",
    "--log-interval",
    "1",
]


def _launch(extra, cache):
    return torchrun(2, PRETRAIN) + PLAN + extra + ["--data-cache-path", cache]


def _on_two_ranks(extra, cache):
    """The run of PLAN + `extra` on the 2 ranks of a pooled gloo world: rank 0's console output (the launch under
    torchrun and its signals is the stopped run's, the one this file is about)."""
    return run_distributed(_console_of_a_run, 2, PLAN + extra + ["--data-cache-path", cache], timeout=180)[0]


def _console_of_a_run(argv):
    return run_in_process(argv)[1]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """(checkpoint folder, console output) of the run never stopped, saved at the --exit-interval asked: run once
    for each interval, whichever test asks first."""
    root, runs = tmp_path_factory.mktemp("straight"), {}

    def straight(end):
        if end not in runs:
            save = str(root / f"exit_{end}")
            runs[end] = save, _on_two_ranks(["--save", save, "--exit-interval", str(end)], str(root))
        return runs[end]

    return straight


def _losses(text):
    return dict(re.findall(r"iteration +(\d+)/ *\d+ .*?\| lm loss: (\S+) \|", text))


def _descendants(pid):
    """Every process under `pid` (torchrun starts its ranks in sessions of their own: a process group's signal
    does not reach them, Slurm's reaches every process of the job step)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return children + [d for c in children for d in _descendants(c)]


def _signal_every_process(pid, sig):
    for target in [pid] + _descendants(pid):
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("to_the_process_tree", [False, True], ids=["torchrun", "process-tree"])
def test_sigterm_saves_the_iteration_reached_and_the_resume_equals_a_straight_run(
    tmp_path, to_the_process_tree, straight_run
):
    """SIGTERM to torchrun only (it forwards it to its workers), or to every process as Slurm's scancel sends it,
    DataLoader workers included (--num-workers 2, the default): they must not die before the save, and a rank
    that gets the scheduler's SIGTERM and torchrun's forwarded one must still save."""
    cache, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    workers = ["--num-workers", "2"] if to_the_process_tree else []
    cmd = _launch(["--save", ckpt, "--exit-signal-handler"] + workers, cache)
    with started(cmd) as proc:
        output = []
        for line in proc.stdout:
            output.append(line)
            if re.search(r"\] iteration +3/", line):
                if to_the_process_tree:  # torchrun, the ranks and their data workers, each once (Slurm's)
                    _signal_every_process(proc.pid, signal.SIGTERM)
                else:
                    proc.send_signal(signal.SIGTERM)
                break
        output.append(proc.communicate(timeout=120)[0])
    text = "".join(output)
    stopped = checkpoint.latest_iteration(ckpt)
    assert stopped is not None and stopped >= 3, text[-3000:]
    assert (
        f"stopped after iteration {stopped} (received SIGTERM); saved {checkpoint.iteration_dir(ckpt, stopped)}" in text
    ), text[-3000:]
    assert not checkpoint.unfinished_saves(ckpt)
    assert not os.path.exists(os.path.join(ckpt, LOCK))  # released on the signal-driven exit

    end = str(stopped + 2)  # --exit-interval: both runs stop (and save) at the first multiple after `stopped`
    resumed = _on_two_ranks(["--load", ckpt, "--save", ckpt, "--exit-interval", end], cache)
    assert f"resumed from {checkpoint.iteration_dir(ckpt, stopped)} at iteration {stopped}" in resumed
    straight, reference = straight_run(int(end))

    a = checkpoint.consolidate_checkpoint(checkpoint.iteration_dir(ckpt, int(end)))
    b = checkpoint.consolidate_checkpoint(checkpoint.iteration_dir(straight, int(end)))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bitwise: masters after the same steps
    losses, reference_losses = {**_losses(text), **_losses(resumed)}, _losses(reference)
    steps = [str(i) for i in range(1, int(end) + 1)]
    assert [losses[i] for i in steps] == [reference_losses[i] for i in steps]


def test_ctrl_c_without_the_handler_stops_at_once_with_exit_code_130(tmp_path):
    """One process, no --exit-signal-handler: SIGINT interrupts the iteration, the run says what is on disk and
    exits 130 (the shell's code for Ctrl-C)."""
    ckpt = str(tmp_path / "ckpt")
    cmd = (
        [sys.executable, PRETRAIN]
        + TINY
        + [
            "--train-iters",
            "1000",
            "--log-interval",
            "1",
            "--save",
            ckpt,
            "--save-interval",
            "2",
            "--data-cache-path",
            str(tmp_path),
        ]
    )
    with started(cmd) as proc:
        output = []
        for line in proc.stdout:
            output.append(line)
            if re.search(r"\] iteration +3/", line):
                proc.send_signal(signal.SIGINT)
                break
        output.append(proc.communicate(timeout=60)[0])
    text = "".join(output)
    assert proc.returncode == 130, text[-2000:]
    assert f"interrupted; the last complete checkpoint is {checkpoint.iteration_dir(ckpt, 2)}" in text, text[-2000:]
    assert "Traceback" not in text
    assert not os.path.exists(os.path.join(ckpt, LOCK))  # the --save folder is free for the next job
