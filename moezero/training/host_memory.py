"""Keep host memory from creeping over a long run: trim glibc's heap when the resident set grows.

Training allocates and frees large tensors every step, from several threads (compute, gloo), in an
order that changes from step to step; MoE adds tensors whose sizes change too (tokens per expert).
glibc reuses freed chunks, but the holes they leave do not always fit later requests, so the heap it
holds grows over a run while the memory in use stays flat. Pinning glibc's mmap threshold stops that,
but then every large tensor is mapped anew and its pages fault in every step, which costs more time than
it saves. Instead, glibc keeps its fast default, and after an optimizer step that ends `slack` bytes above
the warmed-up ceiling (the highest step-end RSS of the first steps, raised when memory really in use
grows), malloc_trim(0) returns the free pages to the OS: RSS stays within the slack, and the pages fault
back in only after the rare trim.

Freed memory stays with the process between trims: the trimmer also sets glibc's thresholds (`mallopt`) so
that free() neither returns the top of the heap to the OS nor maps tensors under 32 MB on their own. glibc's
defaults did both every step for the routing-sized activations of an MoE layer, so their pages faulted in
anew each step; with the thresholds set, the heap grows to its peak once and then serves them without a
fault: steps are faster, at the price of a heap held at its peak (RSS grows a little more at first, then
stays flat). The figures are on the docs' benchmark pages (tools/bench_memory.py, tools/bench_vs_peers.py).
A process whose environment sets any MALLOC_* variable or GLIBC_TUNABLES keeps its own settings.

A process-wide policy, so the training loop chooses it (the pretraining script does, unless
--no-host-heap-policy); a loop of one's own applies it explicitly:

    heap = HeapTrimmer()        # sets glibc's thresholds for the whole process (once)
    for batch in ...:
        ...; opt.step(); heap.after_step(); opt.zero_grad()

MOEZERO_KEEP_MALLOC=1 turns all of it off. Linux/glibc only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Optional

SLACK_BYTES = 64 * 2**20
# mallopt parameters (malloc.h) and the values set: glibc's own ceiling for its dynamic mmap threshold, and a
# top-of-heap size free() never reaches (the trimmer returns memory instead)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 2**30


def _libc() -> Optional[ctypes.CDLL]:
    if os.environ.get("MOEZERO_KEEP_MALLOC") == "1" or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def _user_tunes_malloc() -> bool:
    return "GLIBC_TUNABLES" in os.environ or any(name.startswith("MALLOC_") for name in os.environ)


_thresholds_set = [False]


def keep_freed_memory(libc: ctypes.CDLL) -> None:
    """Once per process: large frees stay in the heap until the trimmer returns them (module docstring)."""
    if _thresholds_set[0] or _user_tunes_malloc() or not hasattr(libc, "mallopt"):
        return
    _thresholds_set[0] = True
    libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(MMAP_THRESHOLD_BYTES))
    libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(TRIM_THRESHOLD_BYTES))


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


WARMUP_STEPS = 3


class HeapTrimmer:
    """The host heap policy: built, it sets glibc's thresholds for the whole process (`keep_freed_memory`, once);
    `after_step()`, called after each optimizer step, trims the heap after a step that ends `slack` bytes above
    the warmed-up ceiling. `steps` counts the steps it saw, `trims` the trims (both 0 where it is off)."""

    def __init__(self, slack: int = SLACK_BYTES):
        self.slack = slack
        self._libc = _libc()
        if self._libc is not None:
            keep_freed_memory(self._libc)
        self._ceiling = 0
        self.steps = 0
        self.trims = 0

    def after_step(self) -> None:
        if self._libc is None:
            return
        self.steps += 1
        rss = resident_bytes()
        if self.steps <= WARMUP_STEPS:
            self._ceiling = max(self._ceiling, rss)
        elif rss > self._ceiling + self.slack:
            self._libc.malloc_trim(0)
            self.trims += 1
            # memory really in use grew (more params, bigger batches): the ceiling follows it
            self._ceiling = max(self._ceiling, resident_bytes() + self.slack)
