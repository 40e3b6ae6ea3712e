"""One job per --save folder: a second job stops at start in one line naming the holder (host, pid, start); a lock
left by a process that is gone (same host: no such pid, or the pid reused by a later process) is taken over with a
line; every rank learns the outcome; the lock is removed when the run ends (normally, by an error, by a signal:
see test_preemption and test_async_save)."""

import json
import os
import socket
import subprocess
import sys

from moezero.checkpoint import CheckpointError
from moezero.checkpoint.lock import LOCK, process_start
from moezero.recipe import pretraining
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, configs
from tests.integration.scripts import REPO, script_in_process

RUN = TINY + ["--train-iters", "1", "--log-interval", "1"]
HOLD = (
    "import sys; from moezero.checkpoint.lock import acquire; acquire(sys.argv[1], print); print('held', "
    "flush=True); sys.stdin.read()"
)


def _plant(save, pid, start, host=None):
    os.makedirs(save, exist_ok=True)
    with open(os.path.join(save, LOCK), "w") as f:
        json.dump(
            {
                "host": host or socket.gethostname(),
                "pid": pid,
                "start": start,
                "boot": None,
                "since": "2026-01-01T00:00:00",
            },
            f,
        )


def _lines(proc):
    return proc.stderr.strip().splitlines()


def test_a_second_job_stops_at_start_and_a_dead_holders_lock_is_taken_over(tmp_path, capsys):
    """Another job (a process holding the lock as a run does) on the folder: refused in one line naming it, its
    lock untouched. Once it is gone (killed: it released nothing), the next run takes the lock over with a line,
    trains, and removes the lock at its end."""
    save, cache = str(tmp_path / "ckpt"), str(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, save], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(os.path.join(save, LOCK)) as f:
            held = f.read()
        proc = script_in_process(RUN + ["--save", save, "--data-cache-path", cache], capsys)
        assert proc.returncode == 2 and len(_lines(proc)) == 1, proc.stderr
        assert (
            f"error: --save={save}: in use by another job (pid {holder.pid} on host {socket.gethostname()}, since "
            in _lines(proc)[0]
            and "iteration" not in proc.stdout
        ), proc.stderr
        with open(os.path.join(save, LOCK)) as f:
            assert f.read() == held
    finally:
        holder.kill()
        holder.wait()
    proc = script_in_process(RUN + ["--save", save, "--data-cache-path", cache], capsys)
    assert proc.returncode == 0, proc.stderr
    assert (
        f" --save={save}: took over the lock of a job that ended without releasing it (pid {holder.pid} on "
        f"host {socket.gethostname()}, since "
        in proc.stdout
        and f"no process {holder.pid} runs)" in proc.stdout
    )
    assert not os.path.exists(os.path.join(save, LOCK))


def test_a_planted_lock_of_a_live_process_is_refused_and_of_a_reused_pid_taken_over(tmp_path, capsys):
    """Without a flock (a file system that has none, or a planted file) the file decides: a live process with
    the recorded start time holds it; the same pid with another start time is a later program (the pid reused)."""
    save, cache = str(tmp_path / "ckpt"), str(tmp_path)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        _plant(save, sleeper.pid, process_start(sleeper.pid))
        proc = script_in_process(RUN + ["--save", save, "--data-cache-path", cache], capsys)
        assert proc.returncode == 2 and len(_lines(proc)) == 1, proc.stderr
        assert f"in use by another job (pid {sleeper.pid} on host" in _lines(proc)[0]
        _plant(save, sleeper.pid, "1")
        proc = script_in_process(RUN + ["--save", save, "--data-cache-path", cache], capsys)
        assert proc.returncode == 0, proc.stderr
        assert (
            f"(pid {sleeper.pid} on host {socket.gethostname()}, since 2026-01-01T00:00:00: process "
            f"{sleeper.pid} is another program started later (the pid was reused))" in proc.stdout
        ), proc.stdout
        _plant(save, sleeper.pid, process_start(sleeper.pid), host="another-host")  # cannot be checked: refused
        proc = script_in_process(RUN + ["--save", save, "--data-cache-path", cache], capsys)
        assert (
            proc.returncode == 2
            and "which cannot be checked from this host; save elsewhere, or remove the "
            "lock file once that job has ended"
            in _lines(proc)[0]
        ), proc.stderr
    finally:
        sleeper.kill()
        sleeper.wait()


def _two_ranks(tmp):
    """A planted live lock: every rank raises the same error (none waits); a free folder: rank 0 holds the lock
    for the run, and it is gone after."""
    try:
        pretraining(configs(RUN + ["--save", os.path.join(tmp, "planted"), "--data-cache-path", tmp]))
        refused = None
    except CheckpointError as exc:
        refused = str(exc)
    free = os.path.join(tmp, "free")
    run = pretraining(configs(RUN + ["--save", free, "--data-cache-path", tmp]))
    with open(os.path.join(free, LOCK)) as f:
        holder = json.load(f)["pid"]
    run.train()
    run.groups.destroy()
    return refused, holder, os.getpid()


def test_every_rank_learns_the_outcome_and_only_rank_0_holds_it(tmp_path):
    _plant(str(tmp_path / "planted"), os.getpid(), process_start(os.getpid()))  # this live test process
    results = run_distributed(_two_ranks, 2, str(tmp_path), timeout=240)
    refusals = [r[0] for r in results]
    assert refusals[0] is not None and refusals[0] == refusals[1] and f"(pid {os.getpid()} on host" in refusals[0]
    assert results[0][1] == results[1][1] == results[0][2]  # rank 0's pid
    assert not os.path.exists(str(tmp_path / "free" / LOCK))  # released at the end of the run


def test_a_lock_file_this_run_cannot_write_is_one_line(tmp_path, capsys):
    proc = script_in_process(RUN + ["--save", "/proc/moezero-ckpt"], capsys)
    assert proc.returncode == 2 and _lines(proc) == [
        "[rank 0] error: --save=/proc/moezero-ckpt: cannot write there (FileNotFoundError: [Errno 2] No such file "
        "or directory: '/proc/moezero-ckpt')"
    ], proc.stderr


def test_a_run_refused_at_start_leaves_no_folder_it_made_and_keeps_one_it_found(tmp_path, capsys):
    """A bad flag after the lock is taken: the --save folder the lock made is removed with the lock (it holds nothing
    of this run's); a folder that was there before, with the user's file in it, is left as it was."""
    cache = str(tmp_path)
    made = str(tmp_path / "new")
    proc = script_in_process(
        RUN + ["--save", made, "--data-cache-path", cache, "--load", str(tmp_path / "none"), "--ckpt-step", "5"], capsys
    )
    assert proc.returncode == 2 and len(_lines(proc)) == 1, proc.stderr
    assert not os.path.exists(made)
    found = tmp_path / "found"
    found.mkdir()
    (found / "notes.txt").write_text("mine")
    proc = script_in_process(
        RUN + ["--save", str(found), "--data-cache-path", cache, "--load", str(tmp_path / "none"), "--ckpt-step", "5"],
        capsys,
    )
    assert proc.returncode == 2 and len(_lines(proc)) == 1, proc.stderr
    assert sorted(os.listdir(found)) == ["notes.txt"]
