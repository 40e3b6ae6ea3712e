"""A rank killed mid-run ends the job with a clear message in bounded time; the last checkpoint loads."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from moezero import checkpoint
from tests.integration.pretrain_utils import TINY, train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker_pid(torchrun_pid: int, rank: int, wait_s: float = 10.0) -> int:
    """The pid of the torchrun worker whose environment holds RANK=<rank> (looked for up to `wait_s`: on a busy
    machine a listing can fall between a process's start and its /proc entries being readable)."""
    deadline = time.monotonic() + wait_s
    while True:
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == torchrun_pid:
                continue
            try:
                if not _descends_from(int(entry), torchrun_pid):
                    continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"RANK={rank}".encode() in f.read().split(b"\0"):
                        return int(entry)
            except OSError:
                continue
        if time.monotonic() > deadline:
            raise AssertionError(f"no worker with RANK={rank} under torchrun {torchrun_pid}")
        time.sleep(0.1)


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().split()[3])
    return False


def _script_on_two_ranks(flags, torchrun_flags=()):
    """The command line of the pretraining script on 2 torchrun ranks with TINY and `flags`."""
    return (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *torchrun_flags]
        + [os.path.join(REPO, "examples_moe", "pretrain_gpt_moe.py")]
        + TINY
        + list(flags)
    )


def _start(cmd):
    """The run in a session of its own (its whole tree can be killed), stdout and stderr in one pipe."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )


@pytest.mark.parametrize(
    "layout",
    [["--expert-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]],
    ids=["ep2", "pp2"],
)
def test_killed_rank_ends_the_job_and_the_last_checkpoint_loads(tmp_path, layout):
    """SIGKILL of rank 1 (at pp 2 the last stage, which stage 0 waits on in a pipeline receive): the job ends in
    bounded time, and its last checkpoint consolidates and resumes in one process."""
    save = str(tmp_path / "ckpt")
    cmd = _script_on_two_ranks(
        [
            "--train-iters",
            "100000",
        ]
        + layout
        + [
            "--save",
            save,
            "--save-interval",
            "2",
            "--log-interval",
            "1",
            "--data-cache-path",
            str(tmp_path),
            "--distributed-timeout-minutes",
            "0.5",
        ]
    )
    proc = _start(cmd)
    output = []
    try:
        for line in proc.stdout:
            output.append(line)
            if "saved checkpoint" in line and "iter_0000004" in line:
                break
        else:
            raise AssertionError("the run ended before its second checkpoint:\n" + "".join(output))
        killed_at = time.monotonic()
        os.kill(_worker_pid(proc.pid, 1), signal.SIGKILL)
        rest, _ = proc.communicate(timeout=120)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "".join(output) + rest
    assert proc.returncode != 0
    assert elapsed < 90, f"the job took {elapsed:.0f}s to end after a rank died"
    assert "exitcode" in text and "-9" in text or "a collective failed" in text, text[-3000:]
    last = checkpoint.latest_iteration(save)
    assert last is not None and last >= 4
    model = checkpoint.consolidate_checkpoint(checkpoint.iteration_dir(save, last))
    assert model["layers.0.mlp.experts.w1"].shape[0] == 4  # all global experts, gathered from every rank
    assert "layers.1.mlp.experts.w1" in model and "output.weight" not in model  # both stages, the tied weight once
    # resume the 2-rank checkpoint on one process (ep 1, pp 1): a different layout
    history = train(TINY + ["--train-iters", str(last + 1), "--load", save], str(tmp_path))
    assert [h["iteration"] for h in history] == [last + 1]
    assert torch.isfinite(torch.tensor(history[0]["lm_loss"]))


def test_a_stalled_rank_ends_every_rank_within_the_distributed_timeout(tmp_path):
    """SIGSTOP one rank past --distributed-timeout-minutes (0.1 = 6 s): the other rank's next collective, on any
    of moezero's groups, fails at that timeout (not torch's 30-minute default for new groups) with one line."""
    cmd = _script_on_two_ranks(
        [
            "--train-iters",
            "100000",
            "--expert-model-parallel-size",
            "2",
            "--log-interval",
            "1",
            "--data-cache-path",
            str(tmp_path),
            "--distributed-timeout-minutes",
            "0.1",
        ]
    )
    proc = _start(cmd)
    output, stalled = [], None
    try:
        for line in proc.stdout:
            output.append(line)
            if "] iteration        3/" in line:
                break
        else:
            raise AssertionError("the run ended before iteration 3:\n" + "".join(output))
        stalled = _worker_pid(proc.pid, 1)
        os.kill(stalled, signal.SIGSTOP)
        stopped_at = time.monotonic()
        reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
        reader.start()
        while time.monotonic() - stopped_at < 90 and "a collective failed" not in "".join(output):
            time.sleep(0.5)  # bounded: without the timeout on every group this would wait 30 minutes
        elapsed = time.monotonic() - stopped_at
    finally:
        if stalled is not None:
            os.kill(stalled, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = "".join(output)
    assert "[rank 0] error: a collective failed" in text, text[-3000:]
    assert elapsed < 60, f"rank 0 waited {elapsed:.0f}s for the stalled rank (timeout 6 s)"


def _straight_losses(cache, iterations):
    history = train(TINY + ["--train-iters", str(iterations), "--expert-model-parallel-size", "2"], cache)
    return [f"{h['lm_loss']:.6E}" for h in history]


def test_three_elastic_restarts_resume_into_the_uninterrupted_run(tmp_path):
    """torchrun --max-restarts 3 with --load = --save: rank 1 is SIGKILLed during iterations 5, 9 and 13; each
    restart attempt forms its process groups afresh (no stale address of a dead rank), resumes from the latest
    checkpoint, and the job ends with exit 0 with every iteration's loss that of an uninterrupted run."""
    from tests.dist_utils import run_distributed

    save, iterations = str(tmp_path / "ckpt"), 16
    cmd = _script_on_two_ranks(
        [
            "--train-iters",
            str(iterations),
            "--expert-model-parallel-size",
            "2",
            "--load",
            save,
            "--save",
            save,
            "--save-interval",
            "2",
            "--log-interval",
            "1",
            "--data-cache-path",
            str(tmp_path),
            "--distributed-timeout-minutes",
            "0.5",
        ],
        torchrun_flags=("--max-restarts", "3"),
    )
    proc = _start(cmd)
    output, kill_at, losses = [], [5, 9, 13], {}
    try:
        for line in proc.stdout:
            output.append(line)
            found = re.search(r"\] iteration +(\d+)/ +\d+ \|.*lm loss: (\S+) \|", line)
            if found:
                losses[int(found.group(1))] = found.group(2)  # a repeated iteration: the last attempt's
                if kill_at and int(found.group(1)) == kill_at[0]:
                    kill_at.pop(0)
                    time.sleep(0.3)  # into the next iteration
                    os.kill(_worker_pid(proc.pid, 1), signal.SIGKILL)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "".join(output)
    assert proc.returncode == 0 and not kill_at, text[-3000:]
    assert "connectFullMesh" not in text
    straight = run_distributed(_straight_losses, 2, str(tmp_path), iterations, timeout=240)[0]
    assert [losses[i] for i in range(1, iterations + 1)] == straight


def test_a_process_group_that_cannot_form_is_one_line(tmp_path):
    """init_process_group failing (here: MASTER_PORT already taken by another program) prints one line."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(taken.getsockname()[1]),
        )
        proc = subprocess.run(
            [sys.executable, os.path.join(REPO, "examples_moe", "pretrain_gpt_moe.py")]
            + TINY
            + ["--train-iters", "1", "--distributed-timeout-minutes", "0.1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert "[rank 0] error: joining the process group failed (" in lines[0] and "Traceback" not in proc.stderr


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """--save on a 2 MB tmpfs: the first checkpoint (1.3 MB) fits, the second does not. One line says so (rank 0,
    as every refusal), the partial folder is removed, `latest` stays the first, and the job stops (exit != 0)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        save = str(disk / "ckpt")
        cmd = _script_on_two_ranks(
            ["--train-iters", "6", "--save", save, "--save-interval", "2", "--data-cache-path", str(tmp_path)]
        )
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1")
        )
        failures = [line for line in proc.stderr.splitlines() if "] error: --save=" in line]
        assert proc.returncode != 0 and len(failures) == 1, proc.stderr[-3000:]
        assert (
            "saving iteration 4 failed (" in failures[0]
            and "No space left on device" in failures[0]
            and "previous checkpoint stays latest" in failures[0]
        ), failures
        assert checkpoint.latest_iteration(save) == 2 and not checkpoint.unfinished_saves(save)
        assert "Traceback" not in "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[rank"))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_diverged_run_on_two_ranks_stops_every_rank_in_one_line(tmp_path):
    """A loss that goes to NaN (lr 1e9) under --check-for-nan-in-loss-and-grad (the default) ends both ranks at the
    same iteration, promptly and in one line, and the step is not saved: `latest` is the last finite iteration's."""
    from tests.integration.scripts import PRETRAIN, run, torchrun

    save = str(tmp_path / "ckpt")
    proc = run(
        torchrun(2, PRETRAIN)
        + [
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "2",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "2",
            "--num-experts",
            "4",
            "--expert-model-parallel-size",
            "2",
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "96",
            "--train-iters",
            "20",
            "--lr",
            "1e9",
            "--clip-grad",
            "0",
            "--num-workers",
            "0",
            "--eval-interval",
            "100",
            "--eval-iters",
            "1",
            "--log-interval",
            "1",
            "--save",
            save,
            "--save-interval",
            "1",
        ],
        timeout=180,
    )
    errors = re.findall(r"error: iteration (\d+): the loss or the gradient is not finite", proc.stdout + proc.stderr)
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback (most recent call last)" not in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-2000:]
    )
    stopped_at = int(errors[0])
    assert stopped_at > 1 and checkpoint.latest_iteration(save) == stopped_at - 1
