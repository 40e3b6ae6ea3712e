"""What a launched collective gives back, whichever transport carries it: a `Work`.

torch's own work handles, the point-to-point exchanges, the pipes' messages, the shared-memory rings' exchanges
and what comm.py and small_reduce.py build on them (a reduce-scatter summed here, a short all-reduce reduced here,
an all-to-all inside autograd) all answer these two calls, so a caller (the bucket launch queue, a watched wait)
waits for a collective without knowing which transport (transport.py) carries it.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional, Protocol, runtime_checkable


@runtime_checkable
class Work(Protocol):
    """A launched collective.

    `is_completed()`: whether `wait()` would return at once; never blocks.
    `wait(timeout=None)`: block until done and give what the collective gives (True where it wrote in place; the
    rows of an all-to-all, the counts of a count exchange). With a `timeout` a wait ends after it with RuntimeError
    and a later wait resumes (a watched wait's slice, `agreement.watched_wait`); only works whose waits can resume
    take one: torch's collectives and the pipes' messages. An exchange with point-to-point receives is waited whole
    (a gloo receive waited with a timeout is abandoned) and refuses a timeout (`whole_waits_only`).
    """

    def is_completed(self) -> bool: ...

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> Any: ...


class Ready:
    """The work of a collective with nothing to move (a group of one): done, `wait()` gives `value` at once."""

    def __init__(self, value: Any = True):
        self.value = value

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> Any:
        return self.value


def wait_for(work: Any, timeout: Optional[datetime.timedelta]) -> Any:
    """`work.wait(timeout)` for torch's work handles too, whose wait takes no None."""
    return work.wait() if timeout is None else work.wait(timeout)


def whole_waits_only(timeout: Optional[datetime.timedelta], what: str) -> None:
    """Refuse a timeout for a work that cannot resume a wait that ended early."""
    if timeout is not None:
        raise ValueError(
            f"{what} is waited whole: its point-to-point receives would be abandoned by a wait that ends at a timeout"
        )
