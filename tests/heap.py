"""Bytes allocated by this process, from glibc's heap counters (mallinfo2).

Process-wide, so allocations and frees on any thread count (gloo frees on its own threads, which
torch's profiler does not see). Large tensors are mmapped and show in `hblkhd`, the rest in
`uordblks`. The project's machines run glibc (Debian); elsewhere this raises instead of guessing.
"""
import ctypes
import ctypes.util


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_bytes() -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        raise RuntimeError("heap_bytes() needs glibc >= 2.33 (mallinfo2)")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd
