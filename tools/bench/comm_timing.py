"""The time a module spends in its collectives, measured from outside the code: a stand-in for the `comm` module
(moezero/parallel/comm.py) that the module imported, each call's wall time added up (an async launch: its caller's
wait counts where the caller waits)."""

import importlib
import time

from moezero.parallel import comm

_UNTIMED = ("group_size", "group_rank")


class TimedComm:
    """comm.py's functions, each call's wall time added to `seconds`."""

    def __init__(self):
        self.seconds = 0.0

    def __getattr__(self, name):
        function = getattr(comm, name)
        if name in _UNTIMED or not callable(function):
            return function

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def time_collectives_of(*module_names: str) -> TimedComm:
    """One TimedComm in place of `comm` in each named module."""
    timer = TimedComm()
    for name in module_names:
        setattr(importlib.import_module(name), "comm", timer)
    return timer
