"""One pass (forward or backward) over the stage-3 units in schedule order (`units.py`): which units a rank
skipped and must still gather to keep its collectives paired, what to prefetch, and the agreement record of
each position and of the pass's end, launched ahead so that checking one costs no wait when ranks are in step.

How many records share a message (an all-reduce: the messages, not the records, are what a step pays for):
one in forward, where an MoE layer's exchange or an on-demand gather states its record between the
positions' records, so that a rank about to wait in a gather has always launched a record that a peer which
went elsewhere meets (and both raise); as many as fit in backward, where nothing else states a record between
them (a peer elsewhere, in step() or another backward, still meets the backward's first message).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

from moezero.parallel.agreement import RECORDS_PER_MESSAGE, Agreement
from moezero.zero.rank_agreement import Activity, RankAgreement

RECORDS_AHEAD = 2  # a schedule position's agreement record is launched at least this many positions before its gather
LEAD = -1  # the records' key of the unit gathered at the pass's start, outside the order (the root)


class GatherSchedule:
    """One pass (forward or backward) over the units in schedule order: catch-up, prefetch, and the
    agreement record of each position, launched ahead so that checking it costs no wait."""

    def __init__(
        self,
        order: List[int],
        activity: Activity,
        end: Activity,
        agreement: RankAgreement,
        recorded: Set[int],
        lead: Optional[int] = None,
        per_message: int = 1,
    ):
        self.order = order
        self.per_message = per_message
        self.position = {u: i for i, u in enumerate(order)}
        self.activity, self.end_activity, self.agreement = activity, end, agreement
        self.lead = lead if lead in recorded else None
        # positions whose gather talks to other ranks (the others need no record); the pass's end has a record too
        # (when any gather has one), launched ahead like the others, so that a rank waiting in the last gathers
        # still has a record ahead for a peer elsewhere to meet
        self.record_positions = [i for i, u in enumerate(order) if u in recorded]
        if self.record_positions or self.lead is not None:
            self.record_positions.append(len(order))
        self.reset(launch_records=False)

    def reset(self, launch_records: bool = True) -> None:
        """A new pass (launch_records=False: a pass that gathers nothing, after a failed one). The first message
        holds the lead unit's record (settle_lead()) beside the first positions'."""
        self.visited: Set[int] = set()
        self.cursor = 0
        self.issued = 0  # schedule positions whose gather was started (visited or prefetched), in order
        self.records: Dict[int, Agreement] = {}
        self.next_record = 0  # index into record_positions of the first one not launched
        if launch_records:
            self._launch_message([] if self.lead is None else [LEAD])  # last: a report names a block first
            self._launch_records(RECORDS_AHEAD)

    def settle_lead(self) -> None:
        """Before the lead unit's gather at the pass's start: its record must agree (RanksDisagree)."""
        record = self.records.pop(LEAD, None)
        if record is not None:
            self.agreement.settle(record)

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
        self._launch_records(len(self.order) + 1)
        record = self.records.pop(len(self.order), None)
        if record is not None:
            self.agreement.settle(record)

    def _launch_records(self, stop: int) -> None:
        """Launch messages until every record of a position before `stop` is launched."""
        while self.next_record < len(self.record_positions) and self.record_positions[self.next_record] < stop:
            self._launch_message([])

    def _launch_message(self, extra: List[int]) -> None:
        """One message: the records of the next `per_message` positions not launched, and those of `extra`."""
        room = min(self.per_message, RECORDS_PER_MESSAGE - len(extra))
        upcoming = self.record_positions[self.next_record : self.next_record + room]
        positions = upcoming + extra
        if not positions:
            return
        self.next_record += len(upcoming)
        message = self.agreement.launch_many([self._entry(p) for p in positions])
        for p in positions:
            self.records[p] = message

    def _entry(self, position: int) -> Tuple[Activity, int]:
        if position == LEAD:
            return self.activity, self.lead
        if position == len(self.order):
            return self.end_activity, -1
        return self.activity, self.order[position]

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
