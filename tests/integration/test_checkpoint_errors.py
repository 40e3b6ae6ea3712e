"""Resume problems end the real script with one line naming the file or the flag (no traceback); the
checkpoint flags that load less (or from elsewhere) do what they say."""

import os
import shutil
import sys

import pytest

import torch

from moezero import checkpoint
from moezero.recipe import pretraining
from tests.integration.pretrain_utils import TINY, configs, train
from tests.integration.scripts import PRETRAIN, run, script_in_process, tool

RUN = TINY + ["--log-interval", "1"]
FP64 = ["--fp64"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of iteration 2 (and of 1), one process."""
    root = tmp_path_factory.mktemp("ckpt")
    train(RUN + ["--train-iters", "2", "--save", str(root / "ckpt"), "--save-interval", "1"], str(root))
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


def _shard_of_iteration_1(path):
    """The same rank's shard of the previous checkpoint, cut or padded to this one's length (the two may differ by
    a few bytes of train state): past every length check, a silent wrong resume without checksums."""
    target = os.path.join(checkpoint.iteration_dir(path, 2), "__0_0.distcp")
    with open(os.path.join(checkpoint.iteration_dir(path, 1), "__0_0.distcp"), "rb") as f:
        data = f.read()
    size = os.path.getsize(target)
    with open(target, "wb") as f:
        f.write(data[:size] + b"\0" * max(0, size - len(data)))


def _flip_64_bytes(path):
    shard = os.path.join(checkpoint.iteration_dir(path, 2), "__0_0.distcp")
    with open(shard, "r+b") as f:
        data = bytearray(f.read())
        for offset in torch.randint(2000, len(data) - 2000, (64,), generator=torch.Generator().manual_seed(0)):
            data[int(offset)] ^= 0x5A
        f.seek(0)
        f.write(bytes(data))


def _manifest_of_iteration_1(path):
    shutil.copyfile(
        os.path.join(checkpoint.iteration_dir(path, 1), "checksums.json"),
        os.path.join(checkpoint.iteration_dir(path, 2), "checksums.json"),
    )


def _garble_metadata(path):
    with open(os.path.join(checkpoint.iteration_dir(path, 2), ".metadata"), "wb") as f:
        f.write(os.urandom(300))


def _garble_metadata_of_an_unverified_checkpoint(path):
    """As written before checksums.json: the unpickler finds the damage."""
    _garble_metadata(path)
    os.remove(os.path.join(checkpoint.iteration_dir(path, 2), "checksums.json"))


CASES = {
    "truncated shard": (_truncate_shard, [], "__0_0.distcp: is truncated (5,000 of"),
    "damaged shard": (_damage_shard, [], "damaged"),
    "garbled metadata": (_garble_metadata, [], ".metadata: holds 300 bytes, the checkpoint wrote"),  # checked first
    "garbled metadata, no checksums": (
        _garble_metadata_of_an_unverified_checkpoint,
        [],
        ".metadata: unreadable, the file is damaged",
    ),
    "shard of another iteration": (
        _shard_of_iteration_1,
        [],
        "iter_0000002/__0_0.distcp: its contents differ from what the checkpoint wrote (checksum mismatch",
    ),
    "64 flipped bytes": (_flip_64_bytes, [], "iter_0000002/__0_0.distcp: its contents differ"),
    "manifest of another iteration": (
        _manifest_of_iteration_1,
        [],
        "checksums.json: records iteration 1, but the folder is iteration 2",
    ),
    "another model": (
        None,
        ["--hidden-size", "64", "--num-experts", "8"],
        "--hidden-size: 32 in the checkpoint, 64 now; --ffn-hidden-size: 128 in the checkpoint, 256 "
        "now; --kv-channels: 16 in the checkpoint, 32 now; --num-experts: 4 in the checkpoint, 8 now); "
        "give the checkpoint's values or "
        "--use-checkpoint-args",
    ),
    "no such step": (None, ["--ckpt-step", "7"], "--ckpt-step=7: --load="),
    "train-iters below": (None, ["--train-iters", "1"], "--train-iters=1: below the iteration of the checkpoint"),
    "another lr schedule": (
        None,
        ["--lr", "1e-2", "--lr-decay-style", "linear"],
        "learning-rate schedule differs (--lr: 0.003 in the checkpoint, 0.01 now; "
        "--lr-decay-style: cosine in the checkpoint, linear now); give "
        "--override-opt_param-scheduler",
    ),
    # Megatron's scheduler refuses another start/end weight decay the same way (the optimizer's state would
    # otherwise bring the checkpoint's back silently)
    "another weight decay": (None, ["--weight-decay", "0.5"], "(--weight-decay: 0.01 in the checkpoint, 0.5 now)"),
}


def _resume_argv(case, saved, tmp_path):
    damage, extra, _ = CASES[case]
    path = _copy(saved, tmp_path)
    if damage:
        damage(path)
    return RUN + ["--train-iters", "4", "--load", path, "--data-cache-path", str(saved)] + extra


def test_a_bad_resume_ends_the_real_script_with_one_line(saved, tmp_path):
    """One case through the script in a process of its own: exit code 2, one line, no traceback."""
    proc = run([sys.executable, PRETRAIN] + _resume_argv("truncated shard", saved, tmp_path))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and CASES["truncated shard"][2] in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_resume_exits_with_one_line(case, saved, tmp_path, capsys):
    """Every case through the script's entry point (moezero.recipe.main, what the script calls), in this process:
    the same exit code and line, without a Python start per case."""
    proc = script_in_process(_resume_argv(case, saved, tmp_path), capsys)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and CASES[case][2] in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_load_must_exist_unless_it_is_also_save(saved, tmp_path, capsys):
    missing = str(tmp_path / "typo")
    proc = script_in_process(RUN + ["--train-iters", "1", "--load", missing], capsys)
    assert (
        proc.returncode == 2
        and proc.stderr.strip()
        == f"[rank 0] error: --load={missing}: does not exist (for a first run, give the same path to --save)"
    )
    proc = script_in_process(
        RUN + ["--train-iters", "1", "--load", missing, "--save", missing, "--data-cache-path", str(saved)], capsys
    )
    assert proc.returncode == 0 and f"no checkpoint in --load={missing} yet (it is also --save)" in proc.stdout
    assert checkpoint.latest_iteration(missing) == 1


def test_iter_folders_no_pointer_names_are_not_trained_over(saved, tmp_path, capsys):
    """A first save whose pointer write failed (or folders copied in) leaves complete iter folders and no
    pointer: a relaunch with --load = --save once trained from scratch and wrote over them; it is refused in one
    line naming them (as is such a --save of another --load), and --ckpt-step or --load DIR/iter_N resumes one.
    --exit-on-missing-checkpoint refuses an empty --load too."""
    from moezero.checkpoint import CheckpointError

    path = _copy(saved, tmp_path)
    os.remove(os.path.join(path, checkpoint.POINTER))
    proc = script_in_process(
        RUN + ["--train-iters", "4", "--load", path, "--save", path, "--data-cache-path", str(saved)], capsys
    )
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"[rank 0] error: --load={path}: holds iter folders [1, 2] but no {checkpoint.POINTER} naming one: resume "
        "one with --ckpt-step N, or move them away to start a new run there"
    ), proc.stderr
    assert checkpoint.saved_iterations(path) == [1, 2] and checkpoint.latest_iteration(path) is None
    with pytest.raises(CheckpointError, match=f"--save={path}: holds iter folders \\[1, 2\\] but no"):
        _built(["--train-iters", "3", "--load", _copy(saved, tmp_path / "other"), "--save", path], str(saved))
    for by_name in (["--load", path, "--ckpt-step", "2"], ["--load", checkpoint.iteration_dir(path, 2)]):
        run_ = _built(["--train-iters", "3", "--save", path] + by_name, str(saved))
        assert run_.iteration == 2
        run_.groups.destroy()
    with pytest.raises(CheckpointError, match="holds no checkpoint \\(--exit-on-missing-checkpoint\\)"):
        empty = str(tmp_path / "empty")
        _built(["--train-iters", "1", "--load", empty, "--save", empty, "--exit-on-missing-checkpoint"], str(saved))


def test_another_runs_checkpoints_in_save_are_not_written_over(saved, tmp_path):
    """A new run (no --load, or another --load) whose --save holds a finished run's checkpoints once wrote its own
    iter_N over them and moved `latest` (Megatron's too): refused in one line, the folder untouched."""
    from moezero.checkpoint import CheckpointError

    path = _copy(saved, tmp_path)
    before = {name: os.path.getmtime(os.path.join(path, name)) for name in os.listdir(path)}
    for load in ([], ["--load", _copy(saved, tmp_path / "other")]):
        with pytest.raises(CheckpointError) as refused:
            _built(["--train-iters", "3", "--save", path] + load, str(saved))
        assert str(refused.value) == (
            f"--save={path}: holds another run's checkpoints (iterations [1, 2]), which "
            f"this run would write over: resume that run (--load {path}), or save "
            "elsewhere"
        )
    assert {name: os.path.getmtime(os.path.join(path, name)) for name in os.listdir(path)} == before


def test_a_finished_run_relaunched_says_so_and_does_the_end_it_owes(tmp_path, capsys):
    """A job killed after its final checkpoint (or a finished one requeued) trains nothing, and does the end of a
    run as Megatron's relaunch does: the validation after training, the test split, the --save-hf folder (which
    the killed job never wrote)."""
    ckpt, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    llama = [
        "--swiglu",
        "--disable-bias-linear",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--untie-embeddings-and-output-weights",
        "--train-iters",
        "1",
        "--eval-iters",
        "1",
        "--eval-interval",
        "10",
        "--split",
        "90,5,5",
        "--data-cache-path",
        str(tmp_path),
    ]
    first = _built(llama + ["--save", ckpt], str(tmp_path))
    first.train()
    first.groups.destroy()
    capsys.readouterr()
    again = _built(llama + ["--load", ckpt, "--save", ckpt, "--save-hf", hf], str(tmp_path))
    again.train()
    again.groups.destroy()
    out = capsys.readouterr().out
    assert "is at iteration 1 = --train-iters: nothing to train" in out and "] iteration " not in out
    assert "validation loss at iteration 1 on validation set" in out and "on test set" in out
    assert os.path.isfile(os.path.join(hf, "iter_0000001", "config.json")) and checkpoint.saved_iterations(ckpt) == [1]


def test_the_tools_report_a_damaged_checkpoint_in_one_line(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _truncate_shard(path)
    for cmd in (
        [sys.executable, tool("consolidate_checkpoint"), "--load", path, "--output", str(tmp_path / "m.pt")],
        [sys.executable, tool("generate"), "--load", path, "--prompt", "x"],
    ):
        proc = run(cmd)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "is truncated" in lines[0], proc.stderr


# ---- the flags that load less, or choose what to load (in-process) ---------------------------------
def _built(argv, cache):
    """A run as built for `argv`: its checkpoint (if any) loaded, nothing trained yet."""
    return pretraining(configs(RUN + argv + ["--data-cache-path", cache]))


def _weights(run):
    with run.opt.full_parameters():
        return {name: p.detach().clone() for name, p in run.model.named_parameters()}


def _has_optimizer_state(run):
    return any(piece["state"] for pieces in run.opt.state_dict()["pieces"].values() for piece in pieces)


def _saved_torch_rng(path):
    from moezero.checkpoint import keys
    from moezero.checkpoint.store import _load

    request = {keys.rng_key(0): b""}
    _load(request, path)
    return keys.decode(request[keys.rng_key(0)])["torch"]


def test_what_resume_finetune_no_load_optim_and_no_load_rng_load(saved, tmp_path):
    """The effects, not the iteration numbers: which weights, optimizer state and RNG state each flag loads,
    and what the first step after it does (float64, one process: a resume equals the straight run bitwise)."""
    ckpt, cache = str(tmp_path / "ckpt"), str(saved)
    train(RUN + FP64 + ["--train-iters", "2", "--save", ckpt], cache)
    saved_weights = checkpoint.consolidate_checkpoint(checkpoint.iteration_dir(ckpt, 2))
    saved_rng = _saved_torch_rng(checkpoint.iteration_dir(ckpt, 2))
    runs = {}
    for name, flags in (
        ("resume", []),
        ("finetune", ["--finetune"]),
        ("fresh optimizer", ["--no-load-optim"]),
        ("fresh rng", ["--no-load-rng"]),
        ("from scratch", None),
    ):
        torch.manual_seed(99)  # what the process's RNG holds before: a flag that loads no RNG leaves it
        run_ = runs[name] = _built(
            FP64 + ["--train-iters", "3"] + (["--load", ckpt] + flags if flags is not None else []), cache
        )
        weights = _weights(run_)
        loaded = all(torch.equal(weights[n], saved_weights[n]) for n in weights)
        assert loaded == (flags is not None), (name, "weights")
        assert _has_optimizer_state(run_) == (name in ("resume", "fresh rng")), (name, "optimizer state")
        assert torch.equal(torch.get_rng_state(), saved_rng) == (name in ("resume", "fresh optimizer")), (name, "rng")
    assert (runs["finetune"].iteration, runs["resume"].iteration, runs["fresh optimizer"].iteration) == (0, 2, 2)
    # the lr schedule is loaded with the optimizer (Megatron's): 2 steps of 8 samples, or from its start
    assert [runs[n].lr_schedule_steps for n in ("resume", "fresh rng", "fresh optimizer", "finetune")] == [16, 16, 0, 0]
    straight = _built(FP64 + ["--train-iters", "3"], cache)  # three iterations in one go: what a resume must equal
    for run_ in (straight, runs["resume"], runs["fresh optimizer"]):
        run_.train()
    resumed, fresh_state, expected = (_weights(r) for r in (runs["resume"], runs["fresh optimizer"], straight))
    assert all(torch.equal(resumed[n], expected[n]) for n in expected), "a resume continues the run exactly"
    assert not all(torch.equal(fresh_state[n], expected[n]) for n in expected), "--no-load-optim: AdamW starts over"
    for run_ in list(runs.values()) + [straight]:
        run_.groups.destroy()


def test_ckpt_step_and_checkpoint_args(saved):
    ckpt, cache = str(saved / "ckpt"), str(saved)
    resumed = train(RUN + ["--train-iters", "3", "--load", ckpt], cache)
    from_step_1 = train(RUN + ["--train-iters", "3", "--load", ckpt, "--ckpt-step", "1"], cache)
    assert [h["iteration"] for h in from_step_1] == [2, 3]
    args = train(RUN + ["--train-iters", "3", "--load", ckpt, "--hidden-size", "64", "--use-checkpoint-args"], cache)
    assert args == resumed  # the checkpoint's 32 wide model


def test_keep_last_checkpoints(saved):
    save = str(saved / "kept")
    train(
        RUN + ["--train-iters", "5", "--save", save, "--save-interval", "1", "--keep-last-checkpoints", "2"], str(saved)
    )
    assert checkpoint.saved_iterations(save) == [4, 5] and checkpoint.latest_iteration(save) == 5


def test_an_unwritable_save_is_one_line_at_start(tmp_path, capsys):
    """Found before training (write and remove a probe), not as a traceback at the first save."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for save in (str(blocker / "ckpt"), "/proc/moezero-ckpt"):  # under a file; a read-only filesystem
        proc = script_in_process(RUN + ["--train-iters", "2", "--save", save], capsys)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert f"error: --save={save}: cannot write there (" in lines[0] and "iteration" not in proc.stdout


def test_a_weight_decay_changed_on_resume_is_the_command_lines_with_override(saved, tmp_path):
    """--override-opt_param-scheduler takes the command line's --weight-decay (the optimizer's state holds the
    checkpoint's); --use-checkpoint-opt_param-scheduler keeps the checkpoint's; biases and norms stay at 0."""
    ckpt, cache = str(tmp_path / "ckpt"), str(saved)
    train(RUN + ["--train-iters", "2", "--save", ckpt], cache)
    for flag, expected in (("--override-opt_param-scheduler", 0.5), ("--use-checkpoint-opt_param-scheduler", 0.01)):
        resumed = _built(["--train-iters", "3", "--load", ckpt, "--weight-decay", "0.5", flag], cache)
        resumed.train()
        assert sorted(g["weight_decay"] for g in resumed.opt.param_groups) == [0.0, expected], flag
        resumed.groups.destroy()


def test_a_disk_that_fills_while_publishing_is_one_error_and_the_previous_checkpoint_stays(
    saved, tmp_path, monkeypatch
):
    """The shards written, rank 0's manifest (or pointer) write fails: a CheckpointError (one line), not rank 0's
    OSError traceback while the others report a dead peer; `latest` still names the previous checkpoint."""
    from moezero.checkpoint import CheckpointError, checksums

    path = _copy(saved, tmp_path)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checksums, "write_manifest", full)
    run_ = _built(["--train-iters", "3", "--load", path, "--save", path], str(saved))
    with pytest.raises(CheckpointError, match="publishing iteration 3 failed \\(OSError: .*No space left"):
        run_.train()
    run_.groups.destroy()
    assert checkpoint.latest_iteration(path) == 2


def test_a_resume_on_another_sample_stream_says_so(saved, tmp_path, capsys):
    """Another --data-path blend, --split, --seq-length or --seed on resume: Megatron goes on at its sample count
    without a word (documents already trained on may come again, or move to the validation split); moezero does
    the same and names each change. An unchanged stream says nothing."""
    path, cache = _copy(saved, tmp_path), str(saved)
    data = RUN[RUN.index("--data-path") + 1]
    for spelled in ([], ["--data-path", os.path.relpath(data), "--split", "49,1"]):  # the same stream
        same = _built(["--train-iters", "3", "--load", path] + spelled, cache)
        assert "sample stream" not in capsys.readouterr().out, spelled
        same.groups.destroy()
    changed = _built(
        [
            "--train-iters",
            "3",
            "--load",
            path,
            "--data-path",
            "30",
            data,
            "70",
            data,
            "--split",
            "90,10,0",
            "--seed",
            "8",
        ],
        cache,
    )
    line = [line for line in capsys.readouterr().out.splitlines() if "sample stream" in line]
    assert line == [
        f" the sample stream is not the checkpoint's (--data-path: {data} in the checkpoint, 30 {data} "
        f"70 {data} now; --split: 98,2,0 in the checkpoint, 90,10,0 now; --seed: 7 in the checkpoint, 8 "
        "now): training goes on at sample 16 of the new one, as Megatron's resume does"
    ], line
    changed.groups.destroy()


# ---- a checkpoint runs no code --------------------------------------------------------------------
class _Planted:
    """A pickle that writes a marker file when it is unpickled (what a crafted checkpoint file would run)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _plant_metadata(path, marker, update_digest):
    import json
    import pickle

    from moezero.checkpoint import checksums

    folder = checkpoint.iteration_dir(path, 2)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(_Planted(marker), f)
    if update_digest:  # a checksums.json that matches the planted file: only the unpickler stands in the way
        manifest_file = os.path.join(folder, checksums.MANIFEST)
        with open(manifest_file) as f:
            manifest = json.load(f)
        manifest["files"][".metadata"] = checksums.file_record(os.path.join(folder, ".metadata"))
        with open(manifest_file, "w") as f:
            json.dump(manifest, f)


@pytest.mark.parametrize("update_digest", [False, True], ids=["digest as saved", "digest updated"])
def test_a_planted_pickle_in_metadata_is_refused_and_never_runs(update_digest, saved, tmp_path, capsys):
    """A .metadata that runs code when unpickled, through every load path (resume, --finetune, the consolidation
    tool): refused in one line, before any of it runs; with its checksum updated too, by the unpickler that admits
    only DCP's metadata classes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("consolidate_checkpoint", tool("consolidate_checkpoint"))
    consolidate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(consolidate)
    path, marker = _copy(saved, tmp_path), str(tmp_path / "marker")
    _plant_metadata(path, marker, update_digest)
    expected = (
        ".metadata: holds 1"
        if not update_digest
        else ".metadata: refused, it names builtins.exec, which a checkpoint never holds"
    )
    for extra in ([], ["--finetune"]):
        proc = script_in_process(
            RUN + ["--train-iters", "4", "--load", path, "--data-cache-path", str(saved)] + extra, capsys
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], (extra, proc.stderr)
    with pytest.raises(SystemExit):
        consolidate.main(["--load", path, "--output", str(tmp_path / "m.pt")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert expected in lines[-1] and "Traceback" not in "\n".join(lines), lines
    assert not os.path.exists(marker)
