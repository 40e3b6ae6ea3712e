"""Stage 3: gathering and freeing the units (`unit_plan.py` says which they are) around forward and backward.

Collectives pair up by order, so every rank gathers every unit once per forward and once per
backward, in one schedule: module (pre-)order in forward, reverse post-order in backward. A unit
a rank skips (a branch some ranks do not take, LayerDrop) is gathered and freed at once when that rank
reaches the next unit of the schedule, or at the end; the unit the backward starts with is kept after a
forward with grad on every rank, whether the rank ran it or caught up with it, so that no rank gathers it
again in backward where its peers do not; a unit run out of schedule order is
gathered on demand (every rank must then run the same order). The next unit of the schedule is
prefetched (async) when a unit starts. In backward a unit is freed once all its trainable params
got their gradient (a unit holding frozen params: at the end of backward, since autograd still
reads them for the input gradient), or at the end of backward.

Every gather waits for an agreement record (`rank_agreement.py`: the unit, why, this rank's forward
and backward counts), so ranks that run different forwards or another unit order raise instead of
hanging or mixing units. The records of a pass's schedule positions, and of its end, are launched
two positions ahead, so ranks in step find them settled (`gather_schedule.py`: in forward a message
each, the root's riding with the first; in backward together); a gather outside the schedule states
its record then. A gather's wait cannot be interrupted, so before it every record launched so far must
agree: a peer that went elsewhere (a retried forward, another unit order, an MoE layer's exchange,
whose record joins this sequence) has then launched a differing record, and both raise.
A read of a param whose unit is free (`param_guard.py`) gathers it on demand while the model's
forward or a backward runs, and raises outside them.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from moezero.parallel import comm
from moezero.parallel.agreement import RECORDS_PER_MESSAGE
from moezero.zero.rank_agreement import Activity, RankAgreement
from moezero.zero.gather_schedule import GatherSchedule
from moezero.zero.hooks import WeakHook
from moezero.zero.param_guard import COMPILE_REFUSED, expose, guard
from moezero.zero.reducer import BackwardListener
from moezero.zero.saved_params import SavedParamHooks
from moezero.zero.unit_plan import UnitPlan
from moezero.torch_internals import current_backward, in_backward, queue_end_of_backward

DOUBLE_BACKWARD_REFUSED = (
    "a backward with create_graph=True (torch.autograd.grad(..., create_graph=True): a gradient penalty, a double "
    "backward) through a model the stage-3 ZeroOptimizer shards: the graph it records reads params whose units are "
    "freed once it ends. Use stage=2 (params stay whole on every rank; higher-order gradients there are torch's)"
)


class UnitState(enum.Enum):
    FREE = "free"  # storage resized to zero
    INFLIGHT = "inflight"  # all-gather launched, not waited for
    READY = "ready"  # full values here


class UnitGatherer(BackwardListener):
    """Gathers and frees stage-3 units around forward and backward (see the module docstring). The gradient
    reducer's listener: it hears when a backward begins and when each param got its gradient.

    Args:
        plan: the units.
        parts: per unit, the (ShardedParams, unit) pairs that hold its params (one per family).
        params_per_unit: per unit, how many trainable params must get their gradient before the unit is
            freed in backward (None: the unit holds frozen params and stays until the end of backward).
        agreement: the records every rank states before a gather.
        take_written: given the ZeroParams written in place while their unit was gathered (see below).

    While the schedule holds a unit gathered its params are exposed (their own type: no per-op check). When a
    gathered unit is let go, exposed or not (an on-demand gather, the last block kept for backward), params
    written in place meanwhile (a `clamp_()` in forward, `nn.Embedding(max_norm=...)`, `w.data.clamp_()`, a
    write between forward and backward) are handed to `take_written` before the values go, so the writes reach
    the shards and the master weights: the gathered copy of this rank's slice is compared with its shard.
    """

    records_mid_backward = True  # a freed unit gathered again in backward states a record of its own

    def __init__(
        self,
        plan: UnitPlan,
        parts: Dict[int, List[Tuple[Any, int]]],
        params_per_unit: Dict[int, Optional[int]],
        agreement: RankAgreement,
        take_written: Callable[[List[Any]], None],
    ):
        self.plan = plan
        self.parts = parts
        self.params_per_unit = params_per_unit
        self.agreement = agreement
        n = len(plan.modules)
        self.state = [UnitState.FREE] * n
        self.works: List[List[Any]] = [[] for _ in range(n)]
        self.collective_units = {u for u, held in parts.items() if any(not storage.local for storage, _ in held)}
        self.forward = GatherSchedule(
            plan.forward_order,
            Activity.FORWARD_GATHER,
            Activity.FORWARD_GATHERS_END,
            agreement,
            self.collective_units,
            lead=0,
        )
        self.backward = GatherSchedule(
            plan.backward_order,
            Activity.BACKWARD_GATHER,
            Activity.BACKWARD_GATHERS_END,
            agreement,
            self.collective_units,
            per_message=RECORDS_PER_MESSAGE,
        )
        self.forward_active = False  # between the root's forward pre-hook and its end
        self._forward_open = False  # a forward began and did not reach its end (root_post_forward) yet
        self._on_demand: Set[int] = set()  # units a read gathered during this forward
        self._backward_task: Optional[int] = None
        self._graph_checked = False  # whether this backward was seen not to record a graph
        self._pending: Dict[int, Optional[int]] = {}
        self._exposed: Set[int] = set()  # units whose params have their own type (no per-op check)
        # a write to a gathered unit's params, exposed or not (an on-demand gather, the last block kept for
        # backward), made in any way (the param, an alias, `.data`, which has a version counter of its own), reaches
        # the shards when the unit goes: the gathered copy of this rank's slice differs from its shard then
        # (ShardedParams.written). A local unit's params are its shard: only masters of a narrower dtype need
        # telling, by the params' version counters (unit -> (zero param, version when gathered or handed on)).
        self._versions: Dict[int, List[Tuple[Any, int]]] = {}
        self.hold_depth = 0  # full_parameters() blocks open (nested ones count): units stay gathered until all end
        self._kept_at_hold: Set[int] = set()  # units the schedule held when the outermost block began
        self._released_in_hold: Set[int] = set()  # of those, the ones the schedule let go of meanwhile
        self.take_written = take_written
        ref = weakref.ref(self)
        self.saved = SavedParamHooks(lambda unit: _regather_saved(ref, unit))
        self._handles = [plan.modules[0].register_forward_hook(WeakHook(self, "_root_done"), always_call=True)]
        for unit in plan.forward_order:  # a run starts at the first of its blocks that runs (a rank may skip some)
            for module in plan.members[unit]:
                self._handles.append(module.register_forward_pre_hook(WeakHook(self, "_pre_forward", unit)))
            last = plan.last_modules[unit]
            self._handles.append(last.register_forward_hook(WeakHook(self, "_post_forward", unit, pass_last=True)))
        self._forward_held: Set[int] = set()  # units this forward's schedule gathered and has not let go of

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def gathers_in_forward(self) -> bool:
        """Whether a forward gathers units from other ranks after the root (its records then guard waits)."""
        return any(unit in self.collective_units for unit in self.plan.forward_order)

    # ---- gather and free -----------------------------------------------------------------------
    def start(self, unit: int, activity: Optional[Activity], schedule: Optional[GatherSchedule] = None) -> None:
        """Launch the unit's gather once every rank agreed: on the record of its position in `schedule`
        (launched ahead), or on a record for `activity` stated now (None: already agreed)."""
        if self.state[unit] is not UnitState.FREE or unit not in self.parts:
            return
        if schedule is not None:
            schedule.settle_record(unit)
        elif activity is not None and unit in self.collective_units:
            self.agreement.check(activity, unit)
        self.works[unit] = [w for storage, key in self.parts[unit] for w in storage.gather(key)]
        self.state[unit] = UnitState.INFLIGHT

    def ensure(
        self, unit: int, activity: Optional[Activity], schedule: Optional[GatherSchedule] = None, exposed: bool = True
    ) -> None:
        """The unit's values here (`exposed`: the schedule's gather, its params of their own type)."""
        self.start(unit, activity, schedule)
        if self.state[unit] is UnitState.INFLIGHT:
            # a gather's wait cannot be interrupted (gloo): first every record launched ahead must agree, so a
            # rank whose peer went elsewhere (another forward, a layer's exchange) raises instead of waiting
            self.agreement.settle()
            try:
                for work in self.works[unit]:
                    work.wait()
            except RuntimeError as exc:  # the group's timeout, or a peer that exited
                self.agreement.waited_in_vain(
                    f"was gathering unit '{self.plan.names[unit] or '<root>'}' for a "
                    f"{'backward' if in_backward() else 'forward'}",
                    exc,
                )
            self.works[unit] = []
            self.state[unit] = UnitState.READY
            self._note_versions(unit)
        if exposed and unit not in self._exposed and unit in self.parts:
            self._expose(unit)

    def free(self, unit: int) -> None:
        """Let the unit go: writes made while it was exposed are handed on; its storage is freed (inside
        full_parameters() it stays, guarded)."""
        if self.state[unit] is UnitState.FREE:
            return
        self.ensure(unit, None, exposed=False)  # an in-flight gather must finish before its buffer goes
        self._unexpose(unit)
        if self.hold_depth:
            self._released_in_hold.add(unit)
            return
        for storage, key in self.parts.get(unit, []):
            storage.free(key)
        self.state[unit] = UnitState.FREE
        self._versions.pop(unit, None)

    def _members(self, unit: int) -> List[Any]:
        return [zp for storage, key in self.parts.get(unit, []) for zp in storage.members(key)]

    def _note_versions(self, unit: int) -> None:
        self._versions[unit] = [
            (zp, zp.param._version)
            for storage, key in self.parts.get(unit, [])
            if storage.local
            for zp in storage.members(key)
        ]

    def _hand_on_writes(self, unit: int) -> None:
        """Params of the unit written in place since it was gathered (or since the last hand-on) give their
        values to the shards and masters."""
        written = [zp for zp, version in self._versions.get(unit, []) if zp.param._version != version]
        written += [zp for storage, key in self.parts.get(unit, []) for zp in storage.written(key)]
        if written:
            self.take_written(written)
            self._note_versions(unit)

    def _expose(self, unit: int) -> None:
        for zp in self._members(unit):
            expose(zp.param)
        self._exposed.add(unit)
        for storage, key in self.parts[unit]:
            if not storage.local:
                self.saved.unit_of_storage[storage.storage_pointer(key)] = unit

    def _unexpose(self, unit: int, hand_on: bool = True) -> None:
        """Writes are handed on; an exposed unit's params are guarded again (it may stay gathered)."""
        if hand_on:
            self._hand_on_writes(unit)
        if unit not in self._exposed:
            return
        self._exposed.discard(unit)
        for storage, key in self.parts[unit]:
            if not storage.local:
                self.saved.unit_of_storage.pop(storage.storage_pointer(key), None)
        for zp in self._members(unit):
            guard(zp.param)

    def _visit(self, schedule: GatherSchedule, unit: int) -> None:
        forward = schedule is self.forward
        if forward:  # a unit whose last module did not run on this rank ends when the schedule passes it
            for held in self._forward_held - self._ancestors(unit):
                self._let_go_in_forward(held)
        for skipped in schedule.skipped_before(unit):  # keep the collectives paired with ranks that ran it
            self.ensure(skipped, None, schedule, exposed=False)
            if forward:
                self._let_go_in_forward(skipped)
            else:
                self.free(skipped)
            schedule.visited.add(skipped)
        self.ensure(unit, None, schedule)
        if forward:
            self._forward_held.add(unit)
        schedule.visited.add(unit)
        schedule.issued = max(schedule.issued, schedule.position[unit] + 1)
        upcoming = schedule.next_after(unit)
        if upcoming is not None:
            self.start(upcoming, None, schedule)
            schedule.issued = max(schedule.issued, schedule.position[upcoming] + 1)

    # ---- reads of a free unit's params (param_guard.py) ------------------------------------------
    def is_ready(self, unit: int) -> bool:
        return self.state[unit] is UnitState.READY

    def may_gather_on_demand(self) -> bool:
        """Inside the model's forward or a backward every rank runs the same code (else the records
        differ); elsewhere a read may be one rank's alone, and waiting for peers would hang."""
        return self.forward_active or in_backward()

    def gather_on_demand(self, unit: int) -> None:
        if in_backward():  # a read inside a recompute, or a backward formula's: the next hook checks the graph
            self._pre_backward(unit, recomputing=True)
            return
        self.ensure(unit, Activity.ON_DEMAND_GATHER, exposed=False)
        self._on_demand.add(unit)  # freed when the forward ends; backward gathers it again

    def ensure_before_backward(self, unit: int) -> None:
        """Autograd is about to run the backward of an op that read a param of `unit`: the unit's
        backward starts here if it did not yet (through the schedule, so skipped units stay paired)."""
        self._pre_backward(unit)

    # ---- forward -------------------------------------------------------------------------------
    def root_pre_forward(self) -> None:
        if torch.compiler.is_compiling():
            raise RuntimeError(COMPILE_REFUSED)
        if in_backward():
            return
        self.finish_aborted_forward()
        self.agreement.progress.forwards += 1
        self.forward.reset()
        self._forward_held.clear()
        self._forward_open = True
        self.forward_active = True
        self.saved.push()
        self.forward.settle_lead()  # the root's record leads the forward's first message
        self.ensure(0, None)

    def _pre_forward(self, unit: int) -> None:
        if in_backward():  # recompute of a checkpointed block inside backward
            self._pre_backward(unit, recomputing=True)
            return
        if unit in self.forward.visited:
            self.ensure(unit, Activity.FORWARD_GATHER)  # a unit run twice, or out of schedule order
            return
        self._visit(self.forward, unit)

    def _post_forward(self, unit: int, output: Any) -> None:
        if in_backward():
            return
        if torch.is_grad_enabled():
            ref = weakref.ref(self)
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(_pre_backward_hook(ref, unit))
        if unit in self._forward_held:
            self._let_go_in_forward(unit)
        else:
            self.free(unit)

    def _let_go_in_forward(self, unit: int) -> None:
        """The forward is done with the unit: freed, except the unit the backward starts with, which a forward with
        grad keeps (guarded) for it, as the root. The same on every rank, whether the rank ran the unit or caught
        up with it: a rank that skipped the last block must not gather it again in backward where its peers
        do not."""
        self._forward_held.discard(unit)
        if torch.is_grad_enabled() and self.backward.order[:1] == [unit]:
            self._unexpose(unit)
        else:
            self.free(unit)

    def _ancestors(self, unit: int) -> Set[int]:
        out = set()
        while unit in self.plan.parent:
            unit = self.plan.parent[unit]
            out.add(unit)
        return out

    def root_post_forward(self, output: Any) -> None:
        if in_backward():
            return
        self._forward_open = False
        for held in list(self._forward_held):
            self._let_go_in_forward(held)
        for skipped in self.forward.skipped_before(None):
            self.ensure(skipped, None, self.forward, exposed=False)
            self._let_go_in_forward(skipped)
        self.forward.settle_end()
        if not any(t.requires_grad for t in _tensors(output)):  # no backward follows; otherwise the root stays
            self.free(0)
            for unit in self.backward.order[:1]:
                self.free(unit)

    def _root_done(self) -> None:
        """The root's forward ended, normally or by an exception: reads no longer gather on demand."""
        if in_backward():
            return
        self.forward_active = False
        self.saved.pop()
        for unit in self._on_demand - {0}:
            self.free(unit)
        self._on_demand.clear()

    def finish_aborted_forward(self) -> None:
        """Collective, before anything else after a forward that raised (and the loop caught it): the gathers its
        schedule still owes are made, in schedule order, so that a peer whose forward ran on is not left waiting in
        one (a forward retried on this rank alone then meets that peer's backward at differing records, and every
        rank raises RanksDisagree); every unit is freed."""
        if not self._forward_open:
            return
        self._forward_open = False
        self._forward_held.clear()
        for skipped in self.forward.skipped_before(None):
            self.ensure(skipped, None, self.forward, exposed=False)
            self.free(skipped)
        self.forward.settle_end()
        self.free_all()

    # ---- backward ------------------------------------------------------------------------------
    def begin_backward(self, recomputing: bool = False) -> None:
        """The backward's first event starts it here. `recomputing`: the event is a checkpointed block's recompute,
        which records a graph in any backward (torch enables grad for it), so whether the backward itself records
        one (create_graph=True, refused) is read at its first other event (an MTP depth recomputed first, before
        any unit's backward hook fired)."""
        task = current_backward()
        if self._backward_task == task:
            if not recomputing and not self._graph_checked:
                self._refuse_a_recorded_graph()
            return
        if not recomputing:
            self._refuse_a_recorded_graph()
        self._graph_checked = not recomputing
        self._backward_task = task
        self.agreement.progress.backwards += 1
        self.backward.reset()
        self._pending = dict(self.params_per_unit)
        queue_end_of_backward(self._end_backward)
        self.ensure(0, Activity.BACKWARD_GATHER)

    def _refuse_a_recorded_graph(self) -> None:
        if torch.is_grad_enabled():  # inside a backward: it records a graph (create_graph=True)
            raise RuntimeError(DOUBLE_BACKWARD_REFUSED)
        self._graph_checked = True

    def _pre_backward(self, unit: int, recomputing: bool = False) -> None:
        self.begin_backward(recomputing)
        if unit in self.backward.visited or unit not in self.backward.position:  # again, or the root
            self.ensure(unit, Activity.BACKWARD_GATHER)
            return
        self._visit(self.backward, unit)

    def param_done(self, zp) -> None:
        """A trainable param got its gradient in this backward (the reducer calls this): its unit is freed once
        all of them did."""
        unit = zp.unit
        if self._backward_task is None or unit == 0 or self._pending.get(unit) is None:
            return
        self._pending[unit] -= 1
        if self._pending[unit] == 0:
            self.free(unit)

    def _end_backward(self) -> None:
        for skipped in self.backward.skipped_before(None):
            self.ensure(skipped, None, self.backward, exposed=False)
            self.free(skipped)
        self.backward.settle_end()
        self.free_all()
        self._backward_task = None

    # ---- outside forward and backward --------------------------------------------------------------
    @property
    def backward_open(self) -> bool:
        return self._backward_task is not None

    def free_all(self) -> None:
        """Every unit freed (inside full_parameters(): let go of when it ends)."""
        for unit in range(len(self.plan.modules)):
            self.free(unit)

    def gather_all(self) -> None:
        """Collective: every unit full (before the optimizer lets go of the model)."""
        self.agreement.check(Activity.FULL_PARAMETERS)
        for unit in [0] + self.plan.forward_order:
            self.start(unit, None)
        for unit in [0] + self.plan.forward_order:
            self.ensure(unit, None, exposed=False)

    @property
    def holding(self) -> bool:
        """Inside opt.full_parameters(): every unit full until the outermost block ends."""
        return self.hold_depth > 0

    def hold(self) -> None:
        """Collective: every unit full and guarded until release() (full_parameters(); blocks nest), whatever
        forwards, backwards and steps run meanwhile. Units the schedule exposed are guarded first, so that what is
        computed inside from a param the schedule holds (the root, after a forward) keeps its regather hooks."""
        if self.hold_depth == 0:
            self._kept_at_hold = {u for u in range(len(self.plan.modules)) if self.state[u] is not UnitState.FREE}
            self._released_in_hold = set()
            for unit in list(self._exposed):
                self._unexpose(unit)
        self.gather_all()
        self.hold_depth += 1

    def release(self) -> None:
        """The end of a full_parameters() block: at the outermost one, every unit the schedule does not hold (the
        root and the last block a pending backward needs stay) is freed."""
        self.hold_depth -= 1
        if self.hold_depth:
            return
        for unit in range(len(self.plan.modules)):
            if unit not in self._kept_at_hold or unit in self._released_in_hold:
                self.free(unit)
        self._kept_at_hold, self._released_in_hold = set(), set()

    def refresh(self) -> None:
        """Collective, after a step inside full_parameters(): the gathered units read the updated shards (their
        full copies are stale; the writes made before the step were taken by then)."""
        gathered = [u for u in range(len(self.plan.modules)) if self.state[u] is UnitState.READY and u in self.parts]
        for unit in gathered:
            self._unexpose(unit, hand_on=False)
            for storage, key in self.parts[unit]:
                storage.free(key)
            self.state[unit] = UnitState.FREE
        for unit in gathered:
            self.start(unit, None)
        for unit in gathered:
            self.ensure(unit, None, exposed=False)

    def full_units(self) -> List[Tuple[Any, int]]:
        """(storage, unit) of every unit gathered now."""
        return [part for unit, parts in self.parts.items() if self.state[unit] is UnitState.READY for part in parts]

    def recover(self, control_group) -> None:
        """Collective, after a backward raised: every rank starts the gathers any rank started (in
        schedule order, so they pair up), then everything is freed."""
        issued = torch.tensor([self.forward.issued, self.backward.issued], dtype=torch.int64)
        comm.all_reduce(issued, control_group, op=torch.distributed.ReduceOp.MAX)
        for schedule, count in zip((self.forward, self.backward), issued.tolist()):
            for unit in schedule.order[schedule.issued : count]:
                self.start(unit, None)
        self.agreement.realign(control_group)  # first: the failed pass's records are dropped, not compared
        self.free_all()
        self.forward.reset(launch_records=False)
        self.backward.reset(launch_records=False)
        self._backward_task = None


def _tensors(output: Any) -> List[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if dataclasses.is_dataclass(output) and not isinstance(output, type):  # MoEStats, say
        return [t for f in dataclasses.fields(output) for t in _tensors(getattr(output, f.name))]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []


def _regather_saved(ref, unit: int) -> None:
    """A saved tensor of `unit` is about to be read by autograd."""
    gatherer = ref()
    if gatherer is None or gatherer.state[unit] is UnitState.READY:
        return
    if not in_backward():
        raise RuntimeError(
            f"a tensor saved from unit '{gatherer.plan.names[unit] or '<root>'}' was read outside "
            "a backward after the unit was freed"
        )
    gatherer._pre_backward(unit)


def _pre_backward_hook(ref, unit: int):
    def hook(grad):
        gatherer = ref()
        if gatherer is not None:
            gatherer._pre_backward(unit)

    return hook
