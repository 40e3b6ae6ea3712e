"""Launch order: the buckets reduced over one process group, in the one order every rank uses.

Collectives on one process group pair up by issue order, so every rank must launch the same
buckets in the same order on it. Families that share a group (two dtypes of dense params) form
one queue: all buckets of the first family, then the next, each in index order. A bucket is
launched once it and every bucket before it in its queue are staged; nothing here ever blocks
inside backward (completed reductions are only polled), so no rank waits on a collective that
another rank can only join later.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Deque, List, Sequence, Tuple


@dataclass
class InFlight:
    """A launched bucket reduction and what to do once it completed."""

    work: Any
    finish: Callable[[], None]

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.finish()


class LaunchQueue:
    """Buckets of the families that reduce over one process group.

    Args:
        entries: (family pass state, bucket index) in launch order; the state has `staged[bucket]`
            and `strategy.launch(bucket)`.
    """

    def __init__(self, entries: Sequence[Tuple[Any, int]]):
        self.entries = list(entries)
        self.next = 0
        self.inflight: Deque[InFlight] = collections.deque()

    def launch_ready(self) -> None:
        while self.next < len(self.entries) and self._staged(self.next):
            self._launch_next()

    def launch_up_to(self, count: int) -> None:
        """Launch entries until `count` are launched, staged or not (aligning with peers)."""
        while self.next < min(count, len(self.entries)):
            self._launch_next()

    def poll(self) -> None:
        """Finish reductions that already completed, oldest first; never blocks."""
        while self.inflight and self.inflight[0].done():
            self.inflight.popleft().wait()

    def wait_all(self) -> None:
        while self.inflight:
            self.inflight.popleft().wait()

    def rewind(self) -> None:
        """A new backward pass (or reduction round) launches from the first bucket again."""
        self.wait_all()
        self.next = 0

    def _staged(self, position: int) -> bool:
        state, bucket = self.entries[position]
        return state.staged[bucket]

    def _launch_next(self) -> None:
        state, bucket = self.entries[self.next]
        self.inflight.append(state.strategy.launch(bucket))
        self.next += 1


def build_queues(states: Sequence[Any]) -> List[LaunchQueue]:
    """One queue per distinct process group object, families in their (rank-independent) order."""
    by_group: dict = {}
    for state in states:
        by_group.setdefault(id(state.family.group), []).extend(
            (state, b) for b in range(state.family.num_buckets))
    return [LaunchQueue(entries) for entries in by_group.values()]
