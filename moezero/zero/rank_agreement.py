"""The optimizer's agreement points: what every rank states before a collective that pairs by order.

    a stage-3 unit gather   (forward schedule, backward schedule, on demand, full_parameters; a pass's end)
    an MoE layer's exchanges (riding on them; at stage 3 also in the gathers' sequence: SiteRecords)
    the end of a backward that reduces gradients (its reductions are then waited for; launched when the
        backward begins, at stage 3 when it ends: a rank may gather a freed unit again mid-backward,
        stating a record its peers do not, and only a record launched after that meets it)
    reduce_gradients() / step()
    modify_model()

Each record carries the activity, the unit and this rank's counts of forwards and of reducing
backwards, so a rank that ran an extra forward, gathered units in another order or had a backward
that reached no parameter meets its peers at differing records and every rank raises
`RanksDisagree` (`parallel/agreement.py`) naming what each was doing, instead of hanging.
"""

from __future__ import annotations

import collections
import enum
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Deque, List, Optional, Sequence, Tuple

import torch

from moezero.parallel import comm
from moezero.parallel.agreement import Agreement, ExchangeRecord, RanksDisagree, not_arrived_message
from moezero.torch_internals import in_backward


class Activity(enum.IntEnum):
    FORWARD_GATHER = 1
    BACKWARD_GATHER = 2
    ON_DEMAND_GATHER = 3
    FULL_PARAMETERS = 4
    END_OF_BACKWARD = 5
    REDUCE = 6
    MODIFY_MODEL = 7
    RECOVERY = 8
    LEAVE_FULL_PARAMETERS = 9  # the unit field: modifier_rank (-1: none)
    MODEL_COLLECTIVE = 10  # the unit field: which of the model's collective sites (an MoE layer)
    FORWARD_GATHERS_END = 11  # a forward's schedule has no unit left to gather
    BACKWARD_GATHERS_END = 12
    UNIT_PLAN = 13  # the unit field: unit_plan_fingerprint()


@dataclass
class Progress:
    """This rank's counts, as its records state them."""

    forwards: int = 0  # root forwards of a stage-3 model (not recomputes inside backward)
    backwards: int = 0  # backwards that gathered units (stage 3)
    reducing_backwards: int = 0  # backwards whose gradients were reduced (every stage)


class RankAgreement:
    """Makes and checks the records of one optimizer (group None: a world of one, nothing to check).

    Records pair by launch order on the agreement group, so they are checked in that order too:
    settling one first settles every record launched before it (a mismatch already paired is found
    without waiting on a later record that may never pair).
    """

    def __init__(self, group: Optional[Any], unit_names: Optional[List[str]] = None):
        self.group = group
        self.unit_names = list(unit_names or [])
        self.site_names: List[str] = []  # the model's modules with collectives in forward (MODEL_COLLECTIVE)
        self.progress = Progress()
        self.launched = 0
        self._pending: Deque[Agreement] = collections.deque()

    def check(self, activity: Activity, unit: int = -1, flag: int = 0) -> int:
        """Collective: every rank states this; raises RanksDisagree on every rank if any states otherwise.
        Returns the bits of `flag` set on any rank (it rides along, not compared)."""
        agreement = self.launch(activity, unit, flag)
        self.settle(agreement)
        return agreement.flag_anywhere

    def launch(self, activity: Activity, unit: int = -1, flag: int = 0) -> Agreement:
        """The same, launched now and settled later: a record ahead of the gather it guards."""
        return self.launch_many([(activity, unit)], flag)

    def launch_many(self, entries: Sequence[Tuple[Activity, int]], flag: int = 0) -> Agreement:
        """Several (activity, unit) records in one message (at most RECORDS_PER_MESSAGE), launched now."""
        agreement = Agreement([self.record(a, u) for a, u in entries], self.group, self.describe, flag)
        self._pending.append(agreement)
        self.launched += 1
        return agreement

    def record(self, activity: Activity, unit: int = -1) -> Tuple[int, ...]:
        p = self.progress
        return int(activity), unit, p.forwards, p.backwards, p.reducing_backwards, int(torch.is_grad_enabled())

    def settle(self, agreement: Optional[Agreement] = None) -> None:
        """Check `agreement` and every record launched before it (None: every record launched so far)."""
        if agreement is not None and agreement.checked:  # a message of several records, settled for another
            return
        while self._pending:
            first = self._pending.popleft()
            first.check()
            if first is agreement:
                return

    def check_arrived(self) -> None:
        """Check the records launched so far that every rank launched (RanksDisagree); never waits."""
        while self._pending and self._pending[0].arrived():
            self._pending.popleft().check()

    def waited_in_vain(self, doing: str, exc: BaseException) -> None:
        """A wait outside the records (a unit's gather) failed: raise RanksDisagree, from a record that arrived
        and differs if there is one (the peer went elsewhere and stated it), else naming where this rank waited."""
        self.check_arrived()
        raise RanksDisagree(not_arrived_message(doing, exc)) from None

    def realign(self, control_group: Optional[Any]) -> None:
        """Collective, after a pass failed part-way on every rank (at different points): launch the records
        the others launched and this rank did not, and drop the failed pass's unchecked records."""
        count = torch.tensor([self.launched], dtype=torch.int64)
        comm.all_reduce(count, control_group, op=torch.distributed.ReduceOp.MAX)
        while self.launched < int(count.item()):
            self.launch(Activity.RECOVERY)
        while self._pending:
            self._pending.popleft().wait()

    def _site(self, index: int) -> str:
        return self.site_names[index] if 0 <= index < len(self.site_names) else f"collective site {index}"

    def describe(self, record: Sequence[int]) -> str:
        activity, unit, forwards, backwards, reducing, grad = record[:6]
        if activity == 0:  # an unused slot of a message
            return "had no agreement record left in that message (a pass with fewer unit gathers)"
        names = activity <= Activity.ON_DEMAND_GATHER and 0 <= unit < len(self.unit_names)
        where = f"unit '{self.unit_names[unit] or '<root>'}'" if names else ""
        text = {
            Activity.FORWARD_GATHER: f"was gathering {where} for a forward ({'with' if grad else 'without'} grad)",
            Activity.BACKWARD_GATHER: f"was gathering {where} for a backward",
            Activity.ON_DEMAND_GATHER: f"was gathering {where} on demand (a read outside its module's forward)",
            Activity.FULL_PARAMETERS: "was entering opt.full_parameters()",
            Activity.END_OF_BACKWARD: "was ending a backward (reducing its gradients)",
            Activity.REDUCE: "was in step() / reduce_gradients()",
            Activity.MODIFY_MODEL: "was entering opt.modify_model()",
            Activity.RECOVERY: "was cleaning up after a backward that raised",
            Activity.LEAVE_FULL_PARAMETERS: f"was leaving opt.full_parameters(modifier_rank={unit})",
            Activity.MODEL_COLLECTIVE: f"was entering the exchanges of '{self._site(unit)}' in a forward "
            f"({'with' if grad else 'without'} grad)",
            Activity.UNIT_PLAN: f"built a ZeroOptimizer whose stage-3 plan has {unit >> 32} gather units "
            f"(fingerprint {unit & 0xFFFFFFFF:08x}; every rank must pass the same model and "
            "min_unit_params / --zero-min-unit-params)",
            Activity.FORWARD_GATHERS_END: "was heading for the end of a forward's unit gathers",
            Activity.BACKWARD_GATHERS_END: "was heading for the end of a backward's unit gathers",
        }.get(activity, f"was doing activity {activity}")
        if activity in (Activity.END_OF_BACKWARD, Activity.REDUCE):
            return f"{text}, after {reducing} reducing backwards"
        if activity == Activity.UNIT_PLAN:
            return text
        return f"{text}, after {forwards} forwards and {backwards} backwards of the stage-3 model"


def unit_plan_fingerprint(unit_names: Sequence[str]) -> int:
    """The unit count and a CRC-32 of the units' names in one integer (a UNIT_PLAN record's unit field)."""
    return (len(unit_names) << 32) | zlib.crc32("\n".join(unit_names).encode())


class SiteRecords:
    """Set on a model module whose forward exchanges with other ranks (an MoE layer, as `exchange_record`):
    called in its forward, it gives the record that rides on that exchange. Holds the agreement weakly and is
    inert in a copy of the model (copy.deepcopy gives None).

    `on_channel` (stage 3): the record is also checked on the agreement group first. There a rank can wait in
    this exchange while a peer waits in a unit gather (another group), each for the other; with the record in
    the same sequence as the gathers' records, the two meet at differing records and both raise.
    """

    def __init__(self, agreement: RankAgreement, site: int, on_channel: bool = False):
        self._ref = weakref.ref(agreement)
        self.site = site
        self.on_channel = on_channel

    def __call__(self) -> Optional[ExchangeRecord]:
        agreement = self._ref()
        if agreement is None or in_backward():  # a recompute follows the forward every rank agreed on
            return None
        channel = None
        if self.on_channel:
            message = agreement.launch(Activity.MODEL_COLLECTIVE, self.site)
            channel = (lambda: agreement.settle(message), agreement.check_arrived)
        return ExchangeRecord(agreement.record(Activity.MODEL_COLLECTIVE, self.site), agreement.describe, channel)

    def __deepcopy__(self, memo):
        return None
