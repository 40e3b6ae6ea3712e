"""Resume problems end the real script with one line naming the file or the flag (no traceback); the
checkpoint flags that load less (or from elsewhere) do what they say."""
import os
import shutil
import sys

import pytest

from moezero import checkpoint
from tests.integration.pretrain_utils import TINY, train
from tests.integration.scripts import PRETRAIN, run, tool

RUN = TINY + ["--log-interval", "1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of iteration 2 (and of 1), one process."""
    root = tmp_path_factory.mktemp("ckpt")
    proc = run([sys.executable, PRETRAIN] + RUN + ["--train-iters", "2", "--save", str(root / "ckpt"),
                                                   "--save-interval", "1", "--data-cache-path", str(root)])
    assert proc.returncode == 0, proc.stderr
    return root


def _copy(saved, tmp_path):
    target = str(tmp_path / "ckpt")
    shutil.copytree(str(saved / "ckpt"), target)
    return target


def _damage_shard(path):
    with open(os.path.join(checkpoint.iteration_dir(path, 2), "__0_0.distcp"), "r+b") as f:
        f.seek(8000)
        f.write(b"\0" * 4000)


def _truncate_shard(path):
    os.truncate(os.path.join(checkpoint.iteration_dir(path, 2), "__0_0.distcp"), 5000)


def _garble_metadata(path):
    with open(os.path.join(checkpoint.iteration_dir(path, 2), ".metadata"), "wb") as f:
        f.write(os.urandom(300))


CASES = {
    "truncated shard": (_truncate_shard, [], "__0_0.distcp: is truncated (5,000 of"),
    "damaged shard": (_damage_shard, [], "damaged"),
    "garbled metadata": (_garble_metadata, [], ".metadata: unreadable, the file is damaged"),
    "another model": (None, ["--hidden-size", "64", "--num-experts", "8"],
                      "--hidden-size: 32 in the checkpoint, 64 now; --ffn-hidden-size: 128 in the checkpoint, 256 "
                      "now; --num-experts: 4 in the checkpoint, 8 now); give the checkpoint's values or "
                      "--use-checkpoint-args"),
    "no such step": (None, ["--ckpt-step", "7"], "--ckpt-step=7: --load="),
    "train-iters below": (None, ["--train-iters", "1"], "--train-iters=1: below the iteration of the checkpoint"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_resume_exits_with_one_line(case, saved, tmp_path):
    damage, extra, needle = CASES[case]
    path = _copy(saved, tmp_path)
    if damage:
        damage(path)
    proc = run([sys.executable, PRETRAIN] + RUN + ["--train-iters", "4", "--load", path,
                                                   "--data-cache-path", str(saved)] + extra)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_load_must_exist_unless_it_is_also_save(saved, tmp_path):
    missing = str(tmp_path / "typo")
    proc = run([sys.executable, PRETRAIN] + RUN + ["--train-iters", "1", "--load", missing])
    assert proc.returncode == 2 and proc.stderr.strip() == \
        f"[rank 0] error: --load={missing}: does not exist (for a first run, give the same path to --save)"
    proc = run([sys.executable, PRETRAIN] + RUN + ["--train-iters", "1", "--load", missing, "--save", missing,
                                            "--data-cache-path", str(saved)])
    assert proc.returncode == 0 and f"no checkpoint in --load={missing} yet (it is also --save)" in proc.stdout
    assert checkpoint.latest_iteration(missing) == 1


def test_a_finished_run_relaunched_says_so_and_exits_0(saved):
    proc = run([sys.executable, PRETRAIN] + RUN + ["--train-iters", "2", "--load", str(saved / "ckpt")])
    assert proc.returncode == 0 and "is at iteration 2 = --train-iters: nothing to train" in proc.stderr


def test_the_tools_report_a_damaged_checkpoint_in_one_line(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _truncate_shard(path)
    for cmd in ([sys.executable, tool("consolidate_checkpoint"), "--load", path, "--output", str(tmp_path / "m.pt")],
                [sys.executable, tool("generate"), "--load", path, "--prompt", "x"]):
        proc = run(cmd)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "is truncated" in lines[0], proc.stderr


# ---- the flags that load less, or choose what to load (in-process) ---------------------------------
def test_finetune_no_load_optim_ckpt_step_and_checkpoint_args(saved, tmp_path):
    ckpt, cache = str(saved / "ckpt"), str(saved)
    finetuned = train(RUN + ["--train-iters", "2", "--load", ckpt, "--finetune"], cache)
    assert [h["iteration"] for h in finetuned] == [1, 2]
    fresh_optimizer = train(RUN + ["--train-iters", "3", "--load", ckpt, "--no-load-optim", "--no-load-rng"], cache)
    resumed = train(RUN + ["--train-iters", "3", "--load", ckpt], cache)
    assert [h["iteration"] for h in fresh_optimizer] == [3] == [h["iteration"] for h in resumed]
    assert fresh_optimizer[0]["lm_loss"] == resumed[0]["lm_loss"]        # the same weights, ...
    assert fresh_optimizer[0]["grad_norm"] == resumed[0]["grad_norm"]
    from_step_1 = train(RUN + ["--train-iters", "3", "--load", ckpt, "--ckpt-step", "1"], cache)
    assert [h["iteration"] for h in from_step_1] == [2, 3]
    args = train(RUN + ["--train-iters", "3", "--load", ckpt, "--hidden-size", "64", "--use-checkpoint-args"], cache)
    assert args == resumed                                               # the checkpoint's 32 wide model


def test_keep_last_checkpoints(saved):
    save = str(saved / "kept")
    train(RUN + ["--train-iters", "5", "--save", save, "--save-interval", "1", "--keep-last-checkpoints", "2"],
          str(saved))
    assert checkpoint.saved_iterations(save) == [4, 5] and checkpoint.latest_iteration(save) == 5
