"""Bytes allocated by this process, from glibc's heap counters (mallinfo2).

Process-wide, so allocations and frees on any thread count (gloo frees on its own threads, which
torch's profiler does not see). Large tensors are mmapped and show in `hblkhd`, the rest in
`uordblks`. The project's machines run glibc (Debian); elsewhere this raises instead of guessing.
"""

import ctypes
import ctypes.util


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo() -> _MallInfo2:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        raise RuntimeError("heap accounting needs glibc >= 2.33 (mallinfo2)")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2()


def heap_bytes() -> int:
    """Bytes in use (heap chunks and mmapped blocks)."""
    info = _mallinfo()
    return info.uordblks + info.hblkhd


def heap_free_bytes() -> int:
    """Bytes the heap holds but does not use (free holes: what fragmentation costs in RSS)."""
    return _mallinfo().fordblks
