"""Megatron's one-time memory report (training.py's `report_memory`), printed after the run's first console line by
the first data-parallel rank of every stage, so each pipeline stage's memory is seen (the stages hold different
layers, and the first one holds the in-flight activations of the most micro-batches):

    [Rank 1] (after 1 iterations) memory (MB) | pipeline stage: 1 | rss: 412.3 | max rss: 433.0

Megatron's values are the CUDA caching allocator's (allocated, max allocated, reserved, max reserved), which follow
on a GPU; on the CPU the process's resident set and its peak are the memory.
"""

from __future__ import annotations

import resource
from typing import Optional

import torch

from moezero.training.host_memory import resident_bytes

MB = 2**20


def memory_report(rank: int, iteration: int, pipeline_stage: Optional[int] = None) -> str:
    """The line rank `rank` prints after `iteration` iterations (`pipeline_stage`: its stage at pp > 1)."""
    values = {}
    if pipeline_stage is not None:
        values["pipeline stage"] = str(pipeline_stage)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        values["allocated"] = f"{torch.cuda.memory_allocated() / MB:.1f}"
        values["max allocated"] = f"{torch.cuda.max_memory_allocated() / MB:.1f}"
        values["reserved"] = f"{torch.cuda.memory_reserved() / MB:.1f}"
        values["max reserved"] = f"{torch.cuda.max_memory_reserved() / MB:.1f}"
    rss = resident_bytes() / MB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: kB, counted lazily (may lag rss)
    values["rss"], values["max rss"] = f"{rss:.1f}", f"{max(rss, peak):.1f}"
    fields = "".join(f" | {name}: {value}" for name, value in values.items())
    return f"[Rank {rank}] (after {iteration} iterations) memory (MB){fields}"
