"""Stage 3 gather units: which params are gathered together, and when.

A unit is a module whose params are full only around its own forward and backward:
  - every routed-expert stack (a module that directly owns expert-tagged params),
  - every block: a module held in an nn.ModuleList or nn.Sequential,
  - the root: every other param (embeddings, final norm, an output head, small branches). The
    root is gathered from the start of the forward to the end of the following backward, so a
    param used outside its own module's forward (a tied output head using the embedding weight
    in the root's forward) is always full when it is used.
A param registered under two units belongs to the root. Units nest (an expert stack inside a
block): a unit's params are those of its subtree outside nested units.

Collectives pair up by order, so every rank gathers every unit once per forward and once per
backward, in one schedule: module (pre-)order in forward, reverse post-order in backward. A unit
a rank skips (a branch some ranks do not take) is gathered and freed at once when that rank
reaches the next unit of the schedule, or at the end; a unit run out of schedule order is
gathered on demand (every rank must then run the same order). The next unit of the schedule is
prefetched (async) when a unit starts. In backward a unit is freed once all its params got their
gradient, or at the end of backward.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from moezero.parallel import comm, is_expert_parallel

UnitPolicy = Callable[[nn.Module, Optional[nn.Module]], bool]


def default_unit_policy(module: nn.Module, parent: Optional[nn.Module]) -> bool:
    if any(is_expert_parallel(p) for p in module.parameters(recurse=False)):
        return True
    return isinstance(parent, (nn.ModuleList, nn.Sequential))


@dataclass
class UnitPlan:
    modules: List[nn.Module]                    # [0] is the root
    names: List[str]
    unit_of: Dict[int, int]                     # id(param) -> unit
    forward_order: List[int] = field(default_factory=list)    # units but the root, module pre-order
    backward_order: List[int] = field(default_factory=list)   # reverse post-order


def plan_units(model: nn.Module, params: Sequence[torch.Tensor], policy: UnitPolicy = default_unit_policy
               ) -> UnitPlan:
    managed = {id(p) for p in params}
    modules, names, pre, post = [model], [""], [], []
    owner: Dict[int, int] = {}   # id(param) -> unit, 0 when registered under two units
    seen: Set[int] = set()

    def walk(module: nn.Module, name: str, unit: int) -> None:
        for p in module.parameters(recurse=False):
            if id(p) in managed:
                owner[id(p)] = unit if owner.get(id(p), unit) == unit else 0
        for child_name, child in module.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            full = f"{name}.{child_name}" if name else child_name
            child_unit = unit
            if policy(child, module) and any(id(p) in managed for p in child.parameters()):
                child_unit = len(modules)
                modules.append(child)
                names.append(full)
                pre.append(child_unit)
            walk(child, full, child_unit)
            if child_unit != unit:
                post.append(child_unit)

    walk(model, "", 0)
    used = set(owner.values())  # units left without params of their own (pure containers) are not gathered
    return UnitPlan(modules, names, owner, [u for u in pre if u in used], [u for u in reversed(post) if u in used])


class _Schedule:
    """One pass (forward or backward) over the units in schedule order, with catch-up."""

    def __init__(self, order: List[int]):
        self.order = order
        self.position = {u: i for i, u in enumerate(order)}
        self.reset()

    def reset(self) -> None:
        self.visited: Set[int] = set()
        self.cursor = 0
        self.issued = 0  # schedule positions whose gather was started (visited or prefetched), in order

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


class UnitGatherer:
    """Gathers and frees stage-3 units around forward and backward (see the module docstring).

    Args:
        plan: the units.
        parts: per unit, the (ShardedParams, unit) pairs that hold its params (one per family).
        params_per_unit: how many optimizer params each unit has (frees a unit after its backward).
    """

    def __init__(self, plan: UnitPlan, parts: Dict[int, List[Tuple[Any, int]]], params_per_unit: Dict[int, int]):
        self.plan = plan
        self.parts = parts
        self.params_per_unit = params_per_unit
        n = len(plan.modules)
        self.state = ["free"] * n                  # free / inflight / ready
        self.works: List[List[Any]] = [[] for _ in range(n)]
        self.forward = _Schedule(plan.forward_order)
        self.backward = _Schedule(plan.backward_order)
        self._backward_task: Optional[int] = None
        self._pending: Dict[int, int] = {}
        ref = weakref.ref(self)
        self._handles = []
        for unit in plan.forward_order:
            module = plan.modules[unit]
            self._handles.append(module.register_forward_pre_hook(_pre_forward_hook(ref, unit)))
            self._handles.append(module.register_forward_hook(_post_forward_hook(ref, unit)))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- gather and free -----------------------------------------------------------------------
    def start(self, unit: int) -> None:
        if self.state[unit] == "free" and unit in self.parts:
            self.works[unit] = [w for storage, key in self.parts[unit] for w in storage.gather(key)]
            self.state[unit] = "inflight"

    def ensure(self, unit: int) -> None:
        self.start(unit)
        if self.state[unit] == "inflight":
            for work in self.works[unit]:
                work.wait()
            self.works[unit] = []
            self.state[unit] = "ready"

    def free(self, unit: int) -> None:
        if self.state[unit] == "free":
            return
        self.ensure(unit)  # an in-flight gather must finish before its buffer goes
        for storage, key in self.parts.get(unit, []):
            storage.free(key)
        self.state[unit] = "free"

    def _visit(self, schedule: _Schedule, unit: int) -> None:
        for skipped in schedule.skipped_before(unit):  # keep the collectives paired with ranks that ran it
            self.ensure(skipped)
            self.free(skipped)
            schedule.visited.add(skipped)
        self.ensure(unit)
        schedule.visited.add(unit)
        schedule.issued = max(schedule.issued, schedule.position[unit] + 1)
        upcoming = schedule.next_after(unit)
        if upcoming is not None:
            self.start(upcoming)
            schedule.issued = max(schedule.issued, schedule.position[upcoming] + 1)

    # ---- forward -------------------------------------------------------------------------------
    def root_pre_forward(self) -> None:
        if _in_backward():
            return
        self.forward.reset()
        self.ensure(0)

    def _pre_forward(self, unit: int) -> None:
        if _in_backward():  # recompute of a checkpointed block inside backward
            self._pre_backward(unit)
            return
        if unit in self.forward.visited:
            self.ensure(unit)  # a unit run twice, or out of schedule order
            return
        self._visit(self.forward, unit)

    def _post_forward(self, unit: int, output: Any) -> None:
        if _in_backward():
            return
        if torch.is_grad_enabled():
            ref = weakref.ref(self)
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(_pre_backward_hook(ref, unit))
        self.free(unit)

    def root_post_forward(self, output: Any) -> None:
        if _in_backward():
            return
        for skipped in self.forward.skipped_before(None):
            self.ensure(skipped)
            self.free(skipped)
        if not any(t.requires_grad for t in _tensors(output)):
            self.free(0)  # no backward follows; otherwise the root stays for it

    # ---- backward ------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if self._backward_task == task:
            return
        self._backward_task = task
        self.backward.reset()
        self._pending = dict(self.params_per_unit)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.ensure(0)

    def _pre_backward(self, unit: int) -> None:
        self.begin_backward()
        if unit in self.backward.visited:
            self.ensure(unit)
            return
        self._visit(self.backward, unit)

    def param_done(self, unit: int) -> None:
        """A param of `unit` got its gradient in this backward (the reducer calls this)."""
        if self._backward_task is None or unit == 0:
            return
        self._pending[unit] -= 1
        if self._pending[unit] == 0:
            self.free(unit)

    def _end_backward(self) -> None:
        for skipped in self.backward.skipped_before(None):
            self.ensure(skipped)
            self.free(skipped)
        self.free_all()
        self._backward_task = None

    # ---- outside forward and backward --------------------------------------------------------------
    @property
    def backward_open(self) -> bool:
        return self._backward_task is not None

    def free_all(self) -> None:
        for unit in range(len(self.plan.modules)):
            self.free(unit)

    def gather_all(self) -> None:
        for unit in [0] + self.plan.forward_order:
            self.start(unit)
        for unit in [0] + self.plan.forward_order:
            self.ensure(unit)

    def recover(self, control_group) -> None:
        """Collective, after a backward raised: every rank starts the gathers any rank started (in
        schedule order, so they pair up), then everything is freed."""
        issued = torch.tensor([self.forward.issued, self.backward.issued], dtype=torch.int64)
        comm.all_reduce(issued, control_group, op=torch.distributed.ReduceOp.MAX)
        for schedule, count in zip((self.forward, self.backward), issued.tolist()):
            for unit in schedule.order[schedule.issued:count]:
                self.start(unit)
        self.free_all()
        self.forward.reset()
        self.backward.reset()
        self._backward_task = None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(output: Any) -> List[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []


def _pre_forward_hook(ref, unit: int):
    def hook(module, args):
        gatherer = ref()
        if gatherer is not None:
            gatherer._pre_forward(unit)
    return hook


def _post_forward_hook(ref, unit: int):
    def hook(module, args, output):
        gatherer = ref()
        if gatherer is not None:
            gatherer._post_forward(unit, output)
    return hook


def _pre_backward_hook(ref, unit: int):
    def hook(grad):
        gatherer = ref()
        if gatherer is not None:
            gatherer._pre_backward(unit)
    return hook
