"""Megatron's --profile: torch.profiler traces of chosen iterations, or nsys's capture range on a GPU.

  --profile --use-pytorch-profiler   a torch.profiler trace of the iterations the log numbers
                                     --profile-step-start .. --profile-step-end - 1 (one warm-up
                                     iteration before them), written by every rank in --profile-ranks
                                     (all when empty) to <tensorboard-dir>/../torch_profile/rank-N.json.gz,
                                     which Perfetto, chrome://tracing and TensorBoard's profiler plugin read;
                                     each iteration is a range named "iteration N" (N as in the log);
  --profile                          cudaProfilerStart before the log's iteration start + 1 and
                                     cudaProfilerStop after iteration end, as Megatron's, for
                                     `nsys profile --capture-range=cudaProfilerApi` (GPU runs).

Megatron counts the PyTorch profiler's window from where the loop starts, so a resumed run profiles other
iterations than the flags say; here the window is the flags' iterations, which on a fresh run are the same.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

import torch

from moezero.config import ConfigError, Validated, option


@dataclass
class ProfilingConfig(Validated):
    """Megatron's profiling flags."""

    section = "profiling"
    profile: bool = option(
        False,
        "profile iterations --profile-step-start .. --profile-step-end - 1: with "
        "--use-pytorch-profiler a torch.profiler trace per rank, else nsys's capture range (GPU)",
        flag="--profile",
    )
    profile_step_start: int = option(10, "the first profiled iteration", flag="--profile-step-start")
    profile_step_end: int = option(12, "the iteration after the last profiled one", flag="--profile-step-end")
    profile_ranks: List[int] = option(
        default_factory=list, help="global ranks that profile (all when empty)", flag="--profile-ranks", nargs="+"
    )
    use_pytorch_profiler: bool = option(
        False,
        "--profile with torch.profiler: a trace per rank in <tensorboard-dir>/../torch_profile",
        flag="--use-pytorch-profiler",
    )
    pytorch_profiler_collect_shapes: bool = option(
        False, "the trace records tensor shapes", flag="--pytorch-profiler-collect-shapes"
    )
    pytorch_profiler_collect_callstack: bool = option(
        False, "the trace records Python call stacks", flag="--pytorch-profiler-collect-callstack"
    )
    pytorch_profiler_collect_chakra: bool = option(
        False,
        "also an execution trace (Chakra) per rank in <tensorboard-dir>/../chakra",
        flag="--pytorch-profiler-collect-chakra",
    )

    def __post_init__(self):
        if not self.profile:
            return
        self._require(self.profile_step_start >= 0, "profile_step_start", "must be >= 0")
        self._require(
            self.profile_step_end > self.profile_step_start,
            "profile_step_end",
            f"must be > --profile-step-start ({self.profile_step_start})",
        )
        self._require(all(rank >= 0 for rank in self.profile_ranks), "profile_ranks", "ranks are >= 0")


def check_profiling(cfg: ProfilingConfig, tensorboard_dir: Optional[str]) -> None:
    """What a profile needs besides its own flags (raises ConfigError naming them)."""
    if not cfg.profile:
        return
    if cfg.use_pytorch_profiler and tensorboard_dir is None:
        raise ConfigError(
            "--use-pytorch-profiler: needs --tensorboard-dir (the traces go to "
            "<tensorboard-dir>/../torch_profile, as Megatron's)"
        )
    if not cfg.use_pytorch_profiler and not torch.cuda.is_available():
        raise ConfigError(
            "--profile without --use-pytorch-profiler is nsys's CUDA capture range, and this machine "
            "has no CUDA device: add --use-pytorch-profiler for a torch.profiler trace"
        )


class StepProfiler:
    """Calls around each training iteration; does nothing unless this rank profiles."""

    def __init__(self, cfg: ProfilingConfig, rank: int, tensorboard_dir: Optional[str], first_iteration: int):
        self.cfg = cfg
        self.active = cfg.profile and (not cfg.profile_ranks or rank in cfg.profile_ranks)
        self._prof: Optional[torch.profiler.profile] = None
        self._capturing = False
        self._mark: Optional[torch.profiler.record_function] = None  # names the iteration in the trace
        if self.active and cfg.use_pytorch_profiler:
            self._prof = self._torch_profiler(rank, tensorboard_dir, first_iteration)

    def _torch_profiler(self, rank: int, tensorboard_dir: str, first: int) -> Optional[torch.profiler.profile]:
        # step() before iteration i (0-based) makes it profiler step i - first + 1; the log calls it i + 1
        recorded_from = self.cfg.profile_step_start - first  # the profiler step of the first profiled one
        warmup = 1 if recorded_from > 0 else 0
        wait = max(recorded_from - 1, 0)
        active = self.cfg.profile_step_end - first - wait - warmup
        if active <= 0:  # resumed past the window
            return None
        parent = os.path.dirname(os.path.abspath(tensorboard_dir))
        trace = os.path.join(parent, "torch_profile", f"rank-{rank}.json.gz")

        def save(prof) -> None:
            os.makedirs(os.path.dirname(trace), exist_ok=True)
            prof.export_chrome_trace(trace)

        observer = None
        if self.cfg.pytorch_profiler_collect_chakra:
            os.makedirs(os.path.join(parent, "chakra"), exist_ok=True)
            observer = torch.profiler.ExecutionTraceObserver().register_callback(
                os.path.join(parent, "chakra", f"rank-{rank}.json.gz")
            )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active),
            on_trace_ready=save,
            record_shapes=self.cfg.pytorch_profiler_collect_shapes,
            with_stack=self.cfg.pytorch_profiler_collect_callstack,
            execution_trace_observer=observer,
        )
        prof.start()
        return prof

    def before_iteration(self, done: int) -> None:
        """`done` iterations are complete; the next one starts."""
        if not self.active:
            return
        if self._prof is not None:
            self._prof.step()
            self._mark = torch.profiler.record_function(f"iteration {done + 1}")  # the log's number
            self._mark.__enter__()
        elif not self.cfg.use_pytorch_profiler and done == self.cfg.profile_step_start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self._capturing = True

    def after_iteration(self, done: int) -> None:
        """`done` iterations are complete (the one just run included)."""
        if not self.active:
            return
        self._end_mark()
        if self._prof is not None and done == self.cfg.profile_step_end - 1:
            self.close()
        elif self._capturing and done == self.cfg.profile_step_end:
            self.close()

    def _end_mark(self) -> None:
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None

    def close(self) -> None:
        """End a profile in progress (the run ended inside the window, or the window closed): its trace is saved."""
        self._end_mark()  # an iteration that raised leaves its range open
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
            if prof.execution_trace_observer is not None:
                prof.execution_trace_observer.unregister_callback()
        if self._capturing:
            self._capturing = False
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
