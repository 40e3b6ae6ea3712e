"""Timing shared by tools/bench_ops.py and its row modules: alternating medians and the op table's row."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _time_once(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def median_ms(fns: Dict[str, Callable[[], object]], reps: int, device: str) -> Dict[str, float]:
    """Median time of each fn; the fns take turns in every round, so a slow phase of the machine
    (other jobs, memory bandwidth) hits all of them alike."""
    for fn in fns.values():
        fn()  # warm-up: allocator, lazy init
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_time_once(fn, device))
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


# ---- pure-torch candidates, each computing exactly what the reference computes -------------


COMPILED = "compiled"
Row = Tuple[str, str, float, str, float]  # op, config, compiled ms, best torch name, best torch ms
