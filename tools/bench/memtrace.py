"""Per-step memory of this process: resident set, glibc heap in use, and the heap glibc holds but
does not use (fragmentation and free lists). Linux/glibc; other systems report RSS only."""

import ctypes
import ctypes.util
import os


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


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def heap_mb():
    """(bytes in use, bytes held free inside the heap) in MB, or (nan, nan) without glibc."""
    if _LIBC is None:
        return float("nan"), float("nan")
    info = _LIBC.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20, info.fordblks / 2**20


def sample() -> dict:
    used, free = heap_mb()
    return {"rss_mb": rss_mb(), "heap_used_mb": used, "heap_free_mb": free}
