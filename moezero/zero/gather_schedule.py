"""One pass (forward or backward) over the stage-3 units in schedule order (`units.py`): which units a rank
skipped and must still gather to keep its collectives paired, what to prefetch, and the agreement record of
each position and of the pass's end, launched ahead so that checking one costs no wait when ranks are in step.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set

from moezero.parallel.agreement import Agreement
from moezero.zero.agreement_points import Activity, RankAgreement

RECORDS_AHEAD = 2   # a schedule position's agreement record is launched this many positions before its gather


class GatherSchedule:
    """One pass (forward or backward) over the units in schedule order: catch-up, prefetch, and the
    agreement record of each position, launched ahead so that checking it costs no wait."""

    def __init__(self, order: List[int], activity: Activity, end: Activity, agreement: RankAgreement,
                 recorded: Set[int]):
        self.order = order
        self.recorded_units = recorded   # units whose gather talks to other ranks (the others need no record)
        self.position = {u: i for i, u in enumerate(order)}
        self.activity, self.end_activity, self.agreement = activity, end, agreement
        # the pass's end has a record too (when any gather has one), launched ahead like the others, so that a
        # rank waiting in the last gathers still has a record ahead for a peer elsewhere to meet
        self.records_end = len(order) + int(any(u in recorded for u in order))
        self.reset(launch_records=False)

    def reset(self, launch_records: bool = True) -> None:
        """A new pass (launch_records=False: a pass that gathers nothing, after a failed one)."""
        self.visited: Set[int] = set()
        self.cursor = 0
        self.issued = 0  # schedule positions whose gather was started (visited or prefetched), in order
        self.records: Dict[int, Agreement] = {}
        self.recorded = 0
        if launch_records:
            self._launch_records(RECORDS_AHEAD)

    def settle_record(self, unit: int) -> None:
        """Before the gather of `unit`'s position: its record must agree on every rank (RanksDisagree)."""
        position = self.position[unit]
        self._launch_records(position + 1)
        record = self.records.pop(position, None)
        if record is not None:
            self.agreement.settle(record)
        self._launch_records(position + 1 + RECORDS_AHEAD)

    def settle_end(self) -> None:
        """The pass reached its end (its skipped units caught up with): the end's record must agree."""
        self._launch_records(self.records_end)
        record = self.records.pop(len(self.order), None)
        if record is not None:
            self.agreement.settle(record)

    def _launch_records(self, stop: int) -> None:
        while self.recorded < min(stop, self.records_end):
            if self.recorded == len(self.order):
                self.records[self.recorded] = self.agreement.launch(self.end_activity)
            elif self.order[self.recorded] in self.recorded_units:
                self.records[self.recorded] = self.agreement.launch(self.activity, self.order[self.recorded])
            self.recorded += 1

    def skipped_before(self, unit: Optional[int]) -> List[int]:
        """Units the schedule reaches before `unit` (None: the end) that this pass has not visited."""
        stop = len(self.order) if unit is None else self.position.get(unit, 0)
        out = []
        while self.cursor < stop:
            u = self.order[self.cursor]
            if u not in self.visited:
                out.append(u)
            self.cursor += 1
        return out

    def next_after(self, unit: int) -> Optional[int]:
        i = self.position.get(unit)
        while i is not None and i + 1 < len(self.order):
            i += 1
            if self.order[i] not in self.visited:
                return self.order[i]
        return None
