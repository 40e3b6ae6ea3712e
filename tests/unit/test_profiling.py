"""Megatron's --profile flags (moezero/training/profiling.py): which iterations a trace holds, where it goes."""

import gzip
import json
import os

import pytest
import torch

from moezero.config import ConfigError
from moezero.training.configs import validate
from moezero.training.profiling import ProfilingConfig, StepProfiler
from tests.integration.pretrain_utils import TINY, configs, train

ITERS = ["--train-iters", "6", "--micro-batch-size", "4", "--global-batch-size", "4"]


def trace_of(tmp_path, rank=0):
    with gzip.open(tmp_path / "torch_profile" / f"rank-{rank}.json.gz") as f:
        return json.load(f)["traceEvents"]


def iterations_in(events):
    return sorted(int(e["name"].split()[1]) for e in events if e.get("name", "").startswith("iteration "))


def test_a_trace_holds_the_iterations_start_to_end_minus_one(tmp_path):
    """--profile-step-start 2 --profile-step-end 4: the log's iterations 2 and 3, each a named range, with the ops
    and their shapes (--pytorch-profiler-collect-shapes); the trace goes next to the TensorBoard directory."""
    train(
        TINY
        + ITERS
        + [
            "--profile",
            "--use-pytorch-profiler",
            "--profile-step-start",
            "2",
            "--profile-step-end",
            "4",
            "--pytorch-profiler-collect-shapes",
            "--tensorboard-dir",
            str(tmp_path / "tb"),
        ],
        str(tmp_path / "cache"),
    )
    events = trace_of(tmp_path)
    assert iterations_in(events) == [2, 3]
    assert sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep")) == [
        "ProfilerStep#2",
        "ProfilerStep#3",
    ]  # Megatron's profiler steps: the same numbers on a fresh run
    mm = [e for e in events if e.get("name") == "aten::mm"]
    assert mm and all(e["args"].get("Input Dims") for e in mm)


def test_a_resumed_run_profiles_the_flags_iterations(tmp_path):
    """Saved after iteration 3, resumed with the window 2..5: iterations 4 and 5 (2 and 3 ran before), not the
    resumed loop's second and third (Megatron's count from the loop's start)."""
    cache, save = str(tmp_path / "cache"), str(tmp_path / "ckpt")
    train(TINY + ITERS + ["--exit-interval", "3", "--save", save], cache)
    train(
        TINY
        + ITERS
        + [
            "--load",
            save,
            "--profile",
            "--use-pytorch-profiler",
            "--profile-step-start",
            "2",
            "--profile-step-end",
            "6",
            "--tensorboard-dir",
            str(tmp_path / "tb"),
        ],
        cache,
    )
    assert iterations_in(trace_of(tmp_path)) == [4, 5]


def test_a_run_that_ends_inside_the_window_still_writes_its_trace(tmp_path):
    """... and its Chakra execution trace (--pytorch-profiler-collect-chakra), next to the profile."""
    train(
        TINY
        + ITERS
        + [
            "--profile",
            "--use-pytorch-profiler",
            "--profile-step-start",
            "5",
            "--profile-step-end",
            "20",
            "--pytorch-profiler-collect-chakra",
            "--tensorboard-dir",
            str(tmp_path / "tb"),
        ],
        str(tmp_path / "cache"),
    )
    assert iterations_in(trace_of(tmp_path)) == [5, 6]
    with gzip.open(tmp_path / "chakra" / "rank-0.json.gz") as f:
        assert json.load(f)["nodes"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--profile", "--use-pytorch-profiler"], "--use-pytorch-profiler: needs --tensorboard-dir"),
        (
            [
                "--profile",
                "--use-pytorch-profiler",
                "--tensorboard-dir",
                "tb",
                "--profile-step-start",
                "4",
                "--profile-step-end",
                "4",
            ],
            "--profile-step-end",
        ),
        (
            ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb", "--profile-ranks", "-1"],
            "--profile-ranks",
        ),
    ],
)
def test_bad_profiling_flags_are_named(argv, message):
    with pytest.raises(ConfigError, match=message):
        validate(configs(TINY + ITERS + argv), 1)


def test_nsys_profiling_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--profile without --use-pytorch-profiler .* no CUDA device"):
        validate(configs(TINY + ITERS + ["--profile"]), 1)


def test_profile_ranks_choose_who_profiles(tmp_path):
    cfg = ProfilingConfig(
        profile=True, use_pytorch_profiler=True, profile_step_start=100, profile_step_end=101, profile_ranks=[1, 3]
    )
    chosen = [rank for rank in range(4) if StepProfiler(cfg, rank, str(tmp_path / "tb"), 0).active]
    everyone = [
        rank
        for rank in range(4)
        if StepProfiler(ProfilingConfig(profile=True, use_pytorch_profiler=True), rank, str(tmp_path / "tb"), 0).active
    ]
    off = [rank for rank in range(4) if StepProfiler(ProfilingConfig(), rank, None, 0).active]
    assert (chosen, everyone, off) == ([1, 3], [0, 1, 2, 3], [])


def test_nsys_capture_range_is_megatrons(monkeypatch):
    """Without --use-pytorch-profiler: cudaProfilerStart before the log's iteration start + 1, Stop after
    iteration end (Megatron's window for nsys), each once."""
    calls = []

    class FakeCudart:
        def cudaProfilerStart(self):
            calls.append("start")
            return 0

        def cudaProfilerStop(self):
            calls.append("stop")
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(torch.cuda, "check_error", lambda code: None)
    profiler = StepProfiler(ProfilingConfig(profile=True, profile_step_start=2, profile_step_end=4), 0, None, 0)
    for done in range(6):
        profiler.before_iteration(done)
        calls.append(f"iteration {done + 1}")
        profiler.after_iteration(done + 1)
    profiler.close()
    assert calls == [
        "iteration 1",
        "iteration 2",
        "start",
        "iteration 3",
        "iteration 4",
        "stop",
        "iteration 5",
        "iteration 6",
    ]
    assert not os.path.exists("torch_profile")


def test_an_iteration_that_raises_inside_the_window_keeps_its_error_and_the_trace(tmp_path, monkeypatch):
    """The error reaches the caller as it was; the trace holds the iterations up to the one that raised."""
    import moezero.training.pretrain as pretrain

    real, calls = pretrain.train_step, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a step that fails")
        return real(*args, **kwargs)

    monkeypatch.setattr(pretrain, "train_step", failing)
    with pytest.raises(RuntimeError, match="a step that fails"):
        train(
            TINY
            + ITERS
            + [
                "--profile",
                "--use-pytorch-profiler",
                "--profile-step-start",
                "2",
                "--profile-step-end",
                "6",
                "--tensorboard-dir",
                str(tmp_path / "tb"),
            ],
            str(tmp_path / "cache"),
        )
    assert iterations_in(trace_of(tmp_path)) == [2, 3]
