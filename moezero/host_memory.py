"""Keep host memory from creeping over a long run: trim glibc's heap when the resident set grows.

Training allocates and frees large tensors every step, from several threads (compute, gloo), in an
order that changes from step to step; MoE adds tensors whose sizes change too (tokens per expert).
glibc reuses freed chunks, but the holes they leave do not always fit later requests, so the heap it
holds grows: measured on a 2-rank GPT-MoE (fp32, ZeRO-2), RSS went 528 -> 757 MB in 40 steps while
the memory in use stayed flat. Pinning glibc's mmap threshold stops that, but then every large tensor
is mapped anew and its pages fault in every step (22% slower in the same run). Instead, glibc keeps
its fast default, and after an optimizer step that ends `slack` bytes above the warmed-up ceiling
(the highest step-end RSS of the first steps, raised when memory really in use grows),
malloc_trim(0) returns the free pages to the OS: RSS stays within the slack, and the pages fault
back in only after the rare trim (measured: ~2% of step time, RSS 539 -> ~590 MB instead of ~890 MB).

ZeroOptimizer calls `after_step()`; MOEZERO_KEEP_MALLOC=1 turns it off. Linux/glibc only.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Optional

SLACK_BYTES = 64 * 2 ** 20


def _libc() -> Optional[ctypes.CDLL]:
    if os.environ.get("MOEZERO_KEEP_MALLOC") == "1" or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


WARMUP_STEPS = 3


class HeapTrimmer:
    """Trims the heap after a step that ends `slack` bytes above the warmed-up ceiling."""

    def __init__(self, slack: int = SLACK_BYTES):
        self.slack = slack
        self._libc = _libc()
        self._ceiling = 0
        self._steps = 0
        self.trims = 0

    def after_step(self) -> None:
        if self._libc is None:
            return
        self._steps += 1
        rss = resident_bytes()
        if self._steps <= WARMUP_STEPS:
            self._ceiling = max(self._ceiling, rss)
        elif rss > self._ceiling + self.slack:
            self._libc.malloc_trim(0)
            self.trims += 1
            # memory really in use grew (more params, bigger batches): the ceiling follows it
            self._ceiling = max(self._ceiling, resident_bytes() + self.slack)
