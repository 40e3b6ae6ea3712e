"""GradReducer: a post-accumulate-grad hook on every trainable param, buckets reduced in order.

Every trainable param gets a hook, whatever path its gradient takes (an fp32 cast of the gate
weight, a param used twice, tied embeddings, a skipped branch, an expert without tokens). The
first hook of a backward queues an end-of-backward callback; there, params that got no
gradient are zero-filled (they add nothing) and the remaining buckets are completed, so every
rank issues the same collectives in the same order. A bucket is launched once it and every
bucket before it are ready (strictly in index order, per family), asynchronously, overlapping
the rest of backward; the optimizer waits for them at `step()`.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence

import torch

from moezero.parallel import comm
from moezero.zero.buckets import ParamFamily
from moezero.zero.stages import InFlight, StageStrategy


class GradientHookError(RuntimeError):
    """A gradient arrived in a way the reducer cannot account for."""


@dataclass
class ReducerCounters:
    """What happened to every param, for tests and logging (names as in the model)."""

    backward_passes: int = 0
    reduction_rounds: int = 0
    fires: Dict[str, int] = field(default_factory=dict)
    zero_fills: Dict[str, int] = field(default_factory=dict)


class _FamilyState:
    """Per-family bookkeeping of one backward pass and one optimizer step."""

    def __init__(self, family: ParamFamily, strategy: StageStrategy):
        self.family = family
        self.strategy = strategy
        self.fired = [False] * len(family.params)      # this backward
        self.got_grad = [False] * len(family.params)   # this optimizer step
        self.next_launch = 0
        self.inflight: Deque[InFlight] = collections.deque()
        self.reset_pass()

    def reset_pass(self) -> None:
        self.fired = [False] * len(self.family.params)
        self.next_launch = 0
        for bucket in self.family.buckets:
            bucket.pending = len(bucket.params)
            bucket.staged = False


class GradReducer:
    """Hooks, per-backward bookkeeping and bucket launches for a list of param families.

    Args:
        families / strategies: the flat-buffer families and their stage strategy, index-aligned.
        control_group: carries the small step-time agreement collective.
        overlap_comm: launch buckets as they become ready (else at the end of backward).
        max_inflight: buckets of one family in flight before the oldest is waited for (bounds memory).
    """

    def __init__(self, families: Sequence[ParamFamily], strategies: Sequence[StageStrategy],
                 control_group: Optional[Any], overlap_comm: bool = True, max_inflight: int = 4):
        self.states = [_FamilyState(f, s) for f, s in zip(families, strategies)]
        self.control_group = control_group
        self.overlap_comm = overlap_comm
        self.max_inflight = max_inflight
        self.sync_enabled = True
        self.counters = ReducerCounters()
        self._pass_task: Optional[int] = None
        self._rounds = 0      # reduction rounds launched since the last step
        self._dirty = False   # stage 0/1: local gradients not reduced yet (a no_sync backward)
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(s, i))
                         for s in self.states for i, p in enumerate(s.family.params)]
        # where the dtypes match, autograd accumulates straight into the bucket (no copy afterwards)
        self._handles += [p.register_hook(self._make_pre_hook(s, i))
                          for s in self.states if s.strategy.accumulates_in_place
                          for i, p in enumerate(s.family.params)]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- during backward -------------------------------------------------------------------
    def _make_hook(self, state: _FamilyState, index: int):
        def hook(param: torch.Tensor) -> None:
            self._on_gradient(state, index)
        return hook

    def _make_pre_hook(self, state: _FamilyState, index: int):
        def pre_hook(grad: torch.Tensor) -> None:
            self._point_grads_at_bucket(state, index)
        return pre_hook

    def _point_grads_at_bucket(self, state: _FamilyState, index: int) -> None:
        """Before a param's gradient is accumulated: make .grad a view of its bucket, if it is unset."""
        family = state.family
        if family.params[index].grad is not None:
            return
        bucket = family.buckets[family.slot(index).bucket]
        views = state.strategy.accumulation_views(bucket.layout.index)
        for i, view in zip(bucket.params, views):
            if family.params[i].grad is None:
                family.params[i].grad = view

    def _on_gradient(self, state: _FamilyState, index: int) -> None:
        family = state.family
        name = family.names[index]
        self._enter_pass(name)
        if state.fired[index]:
            raise GradientHookError(
                f"parameter '{name}' received a gradient twice in one backward: its gradient was "
                "accumulated by a nested backward (reentrant activation checkpointing?). Use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False).")
        if not family.storage_intact(index):
            raise GradientHookError(
                f"parameter '{name}' no longer lives in the optimizer's buffer: its storage was replaced "
                "(module.float()/.to() or a .data swap after ZeroOptimizer was built). Cast inside the op "
                "instead (e.g. x.float() @ w.float().t()) or build the optimizer after converting the model.")
        state.fired[index] = state.got_grad[index] = True
        self.counters.fires[name] = self.counters.fires.get(name, 0) + 1
        bucket = family.buckets[family.slot(index).bucket]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._stage(state, bucket.layout.index)
            if self.overlap_comm and self._launching():
                self._launch_ready(state)

    def _enter_pass(self, name: str) -> None:
        task = torch._C._current_graph_task_id()
        if self._pass_task is None:
            self._wait_inflight()  # the previous backward's reductions must not race this one's staging
            self._pass_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        elif task != self._pass_task:
            raise GradientHookError(
                f"parameter '{name}' received its gradient from a nested backward while another was running "
                "(reentrant activation checkpointing?). Use torch.utils.checkpoint.checkpoint(..., "
                "use_reentrant=False).")

    def _launching(self) -> bool:
        return self.sync_enabled or self.states[0].strategy.reduces_every_backward

    def _stage(self, state: _FamilyState, bucket: int) -> None:
        family = state.family
        members = family.buckets[bucket].params
        fired = [i for i in members if state.fired[i]]
        state.strategy.stage(bucket, fired, [family.params[i].grad for i in fired])
        views = state.strategy.accumulation_views(bucket) if state.strategy.keeps_full_grads else None
        for position, i in enumerate(members):
            if views is not None:
                family.params[i].grad = views[position]  # the accumulated gradient stays visible (as DDP)
            elif state.fired[i] or not state.strategy.keeps_full_grads:
                family.params[i].grad = None  # stage 2: no full-size gradient outlives its bucket
        family.buckets[bucket].staged = True

    def _launch_ready(self, state: _FamilyState) -> None:
        buckets = state.family.buckets
        while state.next_launch < len(buckets) and buckets[state.next_launch].staged:
            self._launch(state, state.next_launch)
            state.next_launch += 1

    def _launch(self, state: _FamilyState, bucket: int) -> None:
        while state.inflight and (len(state.inflight) >= self.max_inflight or _completed(state.inflight[0])):
            state.inflight.popleft().wait()
        state.inflight.append(state.strategy.launch(bucket))

    def _finish_backward(self) -> None:
        """End-of-backward callback: zero-fill params without gradient, complete and launch buckets."""
        for state in self.states:
            family = state.family
            for bucket in family.buckets:
                if bucket.staged:
                    continue
                for i in bucket.params:
                    if not state.fired[i]:
                        name = family.names[i]
                        self.counters.zero_fills[name] = self.counters.zero_fills.get(name, 0) + 1
                self._stage(state, bucket.layout.index)
        if self._launching():
            for state in self.states:
                self._launch_ready(state)
            self._rounds += 1
            self._dirty = False
        else:
            self._dirty = True
        for state in self.states:
            state.reset_pass()
        self.counters.backward_passes += 1
        self._pass_task = None

    # ---- at step() -------------------------------------------------------------------------
    def finish_reductions(self) -> None:
        """Make every rank issue the same reductions, then wait for all of them (collective).

        A rank whose backward reached none of its params got no callback and launched nothing;
        ranks agree on the number of rounds (and on a final round for no_sync accumulations).
        """
        agreement = torch.tensor([self._rounds, int(self._dirty)], dtype=torch.int64)
        comm.all_reduce(agreement, self.control_group, op=torch.distributed.ReduceOp.MAX)
        rounds, dirty = agreement.tolist()
        for _ in range(rounds - self._rounds + dirty):
            for state in self.states:
                for bucket in range(len(state.family.buckets)):
                    self._launch(state, bucket)
            self.counters.reduction_rounds += 1
        self.counters.reduction_rounds += self._rounds
        self._wait_inflight()
        self._rounds, self._dirty = 0, False

    def _wait_inflight(self) -> None:
        for state in self.states:
            while state.inflight:
                state.inflight.popleft().wait()

    def took_gradient(self, state_index: int) -> List[bool]:
        return self.states[state_index].got_grad

    def new_step(self) -> None:
        for state in self.states:
            state.got_grad = [False] * len(state.family.params)
            state.strategy.zero()


def _completed(inflight: InFlight) -> bool:
    return inflight.work is None or inflight.work.is_completed()
