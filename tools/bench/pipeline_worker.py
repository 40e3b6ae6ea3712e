"""One rank of a pipeline benchmark run (under torchrun): the pretraining script's entry point in this process, its
steps and the pipeline schedule's compute timed from outside the code (wrappers around torch's stage methods).

    python -m torch.distributed.run --nproc_per_node=2 tools/bench/pipeline_worker.py --warmup 2 -- <pretrain flags>

Prints one line `RESULT {json}` on rank 0 with every rank's figures:
- step_s: the median wall time of a training step (after --warmup steps), the slowest rank's;
- schedule_s: the median time inside the schedule (`step` of torch's schedule object: the micro-batches' forwards,
  backwards and the sends between stages), compute_s: the part of it spent in the rank's own chunk forwards and
  backwards (torch's forward_one_chunk / backward_one_chunk); bubble = 1 - compute_s / schedule_s per rank;
- exchange_s (--time-collectives-of m1,m2): the median time per step inside those modules' collectives;
- rss_mb: the peak resident set, base_mb: the resident set before the model was built (the interpreter, torch),
  params: the rank's parameter count.
At pp 1 there is no schedule: the step is the whole training step and the bubble is 0 by definition.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules, stage

from comm_timing import time_collectives_of
from moezero import recipe
from moezero.training import pipeline_step, pretrain
from moezero.training.job import init_distributed


class Clock:
    """The current training step's timings (wrappers add into it)."""

    def __init__(self):
        self.in_step = False
        self.step, self.schedule, self.compute, self.exchange = [], [], [], []
        self._schedule = self._compute = 0.0
        self.collectives = None  # a TimedComm (--time-collectives-of)

    def start_step(self):
        self.in_step, self._schedule, self._compute = True, 0.0, 0.0
        if self.collectives is not None:
            self.collectives.seconds = 0.0

    def end_step(self, seconds: float):
        self.in_step = False
        self.step.append(seconds)
        self.schedule.append(self._schedule)
        self.compute.append(self._compute)
        self.exchange.append(0.0 if self.collectives is None else self.collectives.seconds)


CLOCK = Clock()


def timed_step(function):
    def wrapper(*args, **kwargs):
        CLOCK.start_step()
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            CLOCK.end_step(time.perf_counter() - start)

    return wrapper


def timed_part(function, part: str):
    def wrapper(*args, **kwargs):
        if not CLOCK.in_step:
            return function(*args, **kwargs)
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            setattr(CLOCK, part, getattr(CLOCK, part) + time.perf_counter() - start)

    return wrapper


def instrument():
    """Wrap the training steps (pp 1's and the pipeline's), the schedules' step and the stages' compute."""
    pretrain.train_step = timed_step(pretrain.train_step)
    trainer = pipeline_step.PipelineTrainer
    trainer.train_step = timed_step(trainer.train_step)
    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        cls.step = timed_part(cls.step, "_schedule")
    base = stage._PipelineStageBase
    for name in ("forward_one_chunk", "backward_one_chunk"):
        setattr(base, name, timed_part(getattr(base, name), "_compute"))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--time-collectives-of", default="", help="modules (comma-separated) whose comm calls are timed per step"
    )
    args, flags = parser.parse_known_args()  # the rest: the script's flags
    flags = [flag for flag in flags if flag != "--"]
    base_mb = rss_mb()
    instrument()
    if args.time_collectives_of:
        CLOCK.collectives = time_collectives_of(*args.time_collectives_of.split(","))
    cfg = recipe.parse(flags)
    init_distributed(cfg.parallel.distributed_backend, cfg.train.dist_timeout_minutes)
    run = recipe.pretraining(cfg)
    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet  # the script's console lines
        try:
            run.train()
        finally:
            sys.stdout = stdout
    params = sum(p.numel() for p in run.model.parameters())
    kept = slice(args.warmup, None)
    pipeline = bool(CLOCK.compute[kept]) and any(CLOCK.compute[kept])
    bubbles = [1 - c / s for c, s in zip(CLOCK.compute[kept], CLOCK.schedule[kept])] if pipeline else [0.0]
    mine = {
        "step_s": statistics.median(CLOCK.step[kept]),
        "schedule_s": statistics.median(CLOCK.schedule[kept]) if pipeline else None,
        "compute_s": statistics.median(CLOCK.compute[kept]) if pipeline else None,
        "bubble": statistics.median(bubbles),
        "exchange_s": statistics.median(CLOCK.exchange[kept]),
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "base_mb": base_mb,
        "params": params,
    }
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:  # (a one-rank run may have closed its group)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    if not dist.is_initialized() or dist.get_rank() == 0:
        result = {
            "per_rank": every,
            "step_s": max(r["step_s"] for r in every),
            "exchange_s": max(r["exchange_s"] for r in every),
        }
        print("RESULT " + json.dumps(result), flush=True)
    if dist.is_initialized():
        run.destroy_groups()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
