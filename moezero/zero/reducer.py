"""GradReducer: a hook on every param of the optimizer, buckets reduced in one order on every rank.

Every param gets a post-accumulate-grad hook, whatever path its gradient takes (an fp32 cast of
the gate weight, a param used twice, tied embeddings, a skipped branch, an expert without
tokens), and a pre-accumulation hook that points its `.grad` at its slice of the bucket, so
autograd adds straight into the bucket. The first hook of a backward (or the model's output
hook, see `model_guard.py`) queues an end-of-backward callback; there, params that got no
gradient are zero-filled, every remaining bucket is launched, and the backward's reductions are
waited for, as DDP does.

NOTE [no accumulation into a reducing bucket]: when `backward()` returns, no reduction is in flight,
so no gradient is ever added into a bucket whose reduction is running. Every gradient strategy
(grad_strategies.py) relies on this and on nothing else for its buffers' reuse.

Inside backward nothing blocks on a peer: buckets are launched in their queue's order (the same
on every rank, `launch.py`) and completed reductions are only polled. Before the end-of-backward
wait, and before step() reduces, every rank states an agreement record (`agreement.py`), so a
rank whose backward reached no param (its peers would wait for it forever) makes every rank raise.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from moezero.parallel import comm
from moezero.zero.agreement import Activity, RankAgreement
from moezero.zero.families import ParamFamily
from moezero.zero.grad_strategies import GradStrategy
from moezero.zero.launch import build_queues
from moezero.zero.model_guard import storage_replaced_message
from moezero.zero.param_storage import ParamStorage
from moezero.zero.torch_internals import current_backward, queue_end_of_backward


class GradientHookError(RuntimeError):
    """A gradient arrived in a way the reducer cannot account for."""


@dataclass
class ReducerCounters:
    """What happened to every param, for tests and logging (names as in the model)."""

    backward_passes: int = 0
    reduction_rounds: int = 0
    fires: Dict[str, int] = field(default_factory=dict)
    zero_fills: Dict[str, int] = field(default_factory=dict)


class FamilyPass:
    """Per-family bookkeeping of one backward pass (and of one optimizer step: `got_grad`)."""

    def __init__(self, family: ParamFamily, storage: ParamStorage, strategy: GradStrategy):
        self.family, self.storage, self.strategy = family, storage, strategy
        n = len(family.params)
        self.position = [0] * n     # a param's position in its bucket's param list
        for b in range(family.num_buckets):
            for pos, index in enumerate(family.bucket_params[b]):
                self.position[index] = pos
        self.got_grad = [False] * n  # this optimizer step
        self.exposed = [False] * n   # .grad was set to one of our views (None now: the user cleared it)
        self.reset_pass()

    def reset_pass(self) -> None:
        self.fired = [False] * len(self.family.params)
        self.pending = [len(p) for p in self.family.bucket_params]
        self.staged = [False] * self.family.num_buckets
        self.touched = [False] * self.family.num_buckets


class GradReducer:
    """Hooks, per-backward bookkeeping and bucket launches for a list of param families.

    Args:
        states: one FamilyPass per trainable family (family, param storage, grad strategy).
        control_group: carries the small step-time collectives.
        overlap_comm: launch buckets as they become ready (else at the end of backward).
        agreement: the records every rank states before it waits for a backward's reductions and
            before step() reduces (a rank whose backward reached no param would leave its peers waiting).
    """

    def __init__(self, states: Sequence[FamilyPass], control_group: Optional[Any], overlap_comm: bool = True,
                 agreement: Optional[RankAgreement] = None):
        self.states = list(states)
        self.agreement = agreement if agreement is not None else RankAgreement(None)
        self.queues = build_queues(self.states)
        self._queue_of = {id(s): q for q in self.queues for s, _ in q.entries}
        self.control_group = control_group
        self.overlap_comm = overlap_comm
        self.sync_enabled = True
        self.scaled_backward = False   # set by ZeroOptimizer.backward around loss.backward()
        self.unscaled_passes = 0
        self.counters = ReducerCounters()
        self._always_reduce = bool(self.states) and self.states[0].strategy.reduces_under_no_sync
        self._pass_task: Optional[int] = None
        self._pass_synced = False
        self._end_record = None   # the agreement record of this backward's end (launched when it begins)
        self._dirty = False      # stage 0/1: a no_sync backward left local gradients unreduced
        self._consumed = False   # step() used the gradients: the next backward starts from zero
        self.on_pass_begin: Optional[Callable[[], None]] = None                 # stage 3: the unit gatherer
        self.on_param_done: Optional[Callable[[FamilyPass, int], None]] = None
        # the hooks hold the reducer weakly and its state by position: a hook that held the state would close
        # a cycle through the param's C++ hook table, which Python's GC cannot see, and a discarded optimizer
        # would stay alive with its buffers and process groups
        ref = weakref.ref(self)
        self._handles = []
        for f, state in enumerate(self.states):
            for index, p in enumerate(state.family.params):
                self._handles.append(p.register_hook(_pre_hook(ref, f, index)))
                self._handles.append(p.register_post_accumulate_grad_hook(_post_hook(ref, f, index)))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- during backward -------------------------------------------------------------------
    def begin_pass(self, name: Optional[str] = None) -> None:
        """Called by every hook; the first of a backward sets the pass up."""
        task = current_backward()
        if self._pass_task is not None:
            if task == self._pass_task:
                return
            who = f"parameter '{name}' received its gradient" if name else "a gradient arrived"
            raise GradientHookError(
                f"{who} from a nested backward while another was running (reentrant activation "
                "checkpointing?). Use torch.utils.checkpoint.checkpoint(..., use_reentrant=False).")
        if self._consumed:
            self.clear_step()
        self._pass_task = task
        self._pass_synced = self.sync_enabled or self._always_reduce
        if self._pass_synced:   # launched now, settled before the end-of-backward wait: no waiting then
            self._end_record = self.agreement.launch(Activity.END_OF_BACKWARD)
        if not self.scaled_backward:
            self.unscaled_passes += 1
        queue_end_of_backward(self._end_pass)
        if self.on_pass_begin is not None:
            self.on_pass_begin()

    def _before_accumulate(self, state: FamilyPass, index: int) -> None:
        """Before autograd adds a param's gradient: make .grad its view of the bucket."""
        self.begin_pass(state.family.names[index])
        bucket = state.family.bucket_of(index)
        self._touch(state, bucket)
        views = state.strategy.accumulation_views(bucket)
        if views is None:
            return
        param, view = state.family.params[index], views[state.position[index]]
        if param.grad is None:
            if state.exposed[index]:
                view.zero_()  # the user cleared this gradient (model.zero_grad(), p.grad = None)
        elif param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)  # a gradient the user assigned: accumulate on top of it, as torch does
        param.grad = view
        state.exposed[index] = True

    def _on_gradient(self, state: FamilyPass, index: int) -> None:
        family = state.family
        name = family.names[index]
        self.begin_pass(name)
        if state.fired[index]:
            raise GradientHookError(
                f"parameter '{name}' received a gradient twice in one backward: its gradient was "
                "accumulated by a nested backward (reentrant activation checkpointing?). Use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False).")
        if not state.storage.storage_intact(index):
            raise GradientHookError(storage_replaced_message(name))
        state.fired[index] = state.got_grad[index] = True
        self.counters.fires[name] = self.counters.fires.get(name, 0) + 1
        if self.on_param_done is not None:
            self.on_param_done(state, index)
        bucket = family.bucket_of(index)
        state.pending[bucket] -= 1
        if state.pending[bucket] == 0:
            self._stage(state, bucket)
            if self.overlap_comm and self._pass_synced:
                self._queue_of[id(state)].launch_ready()
        for queue in self.queues:  # release what finished (staging buffers back to the pool); never blocks
            queue.poll()

    def _touch(self, state: FamilyPass, bucket: int) -> None:
        if not state.touched[bucket]:
            state.strategy.before_accumulate(bucket)
            state.touched[bucket] = True

    def _stage(self, state: FamilyPass, bucket: int) -> None:
        family, strategy = state.family, state.strategy
        self._touch(state, bucket)
        members = family.bucket_params[bucket]
        views = strategy.accumulation_views(bucket)
        for pos, i in enumerate(members):
            if views is not None and not state.fired[i] and state.exposed[i] and family.params[i].grad is None:
                views[pos].zero_()  # cleared by the user and not reached by this backward
        fired = [i for i in members if state.fired[i]]
        strategy.stage(bucket, fired, [family.params[i].grad for i in fired])
        visible = strategy.visible_grads(bucket, self._pass_synced)
        for pos, i in enumerate(members):
            param = family.params[i]
            if visible is not None:
                param.grad = visible[pos]
                state.exposed[i] = True
            elif state.fired[i] or state.exposed[i]:
                param.grad = None  # no full-size gradient outlives its bucket (stages 1-3)
                state.exposed[i] = False
        state.staged[bucket] = True

    def _end_pass(self) -> None:
        """End-of-backward callback: zero-fill, launch every bucket, wait for this backward's reductions."""
        for state in self.states:
            for bucket in range(state.family.num_buckets):
                if state.staged[bucket]:
                    continue
                for i in state.family.bucket_params[bucket]:
                    if not state.fired[i]:
                        name = state.family.names[i]
                        self.counters.zero_fills[name] = self.counters.zero_fills.get(name, 0) + 1
                self._stage(state, bucket)
        if self._pass_synced:
            for queue in self.queues:
                queue.launch_ready()
            # before waiting for the reductions: a peer whose backward reached no param never joins them
            self.agreement.settle(self._end_record)
            self.agreement.progress.reducing_backwards += 1
            self._finish_round()
            self._dirty = False
        else:
            self._dirty = True
        for state in self.states:
            state.reset_pass()
        self.counters.backward_passes += 1
        self._pass_task = None

    def _finish_round(self) -> None:
        for queue in self.queues:
            queue.wait_all()
        for queue in self.queues:
            queue.rewind()
        self.counters.reduction_rounds += 1

    # ---- between backwards -------------------------------------------------------------------
    @property
    def pass_open(self) -> bool:
        return self._pass_task is not None

    def finish_reductions(self) -> None:
        """Collective: reduce what no_sync backwards left local (on every rank if on any)."""
        self.agreement.check(Activity.REDUCE)
        flag = torch.tensor([int(self._dirty)], dtype=torch.int64)
        comm.all_reduce(flag, self.control_group, op=torch.distributed.ReduceOp.MAX)
        if flag.item():
            for state in self.states:
                for bucket in range(state.family.num_buckets):
                    state.strategy.before_accumulate(bucket)
            for queue in self.queues:
                queue.launch_up_to(len(queue.entries))
            self._finish_round()
        self._dirty = False

    def recover_aborted_pass(self) -> bool:
        """Collective: a backward raised before its end. Launch on every rank what any rank launched
        (so the collectives pair up), finish it, and forget the step's gradients."""
        if self._pass_task is None:
            return False
        launched = torch.tensor([q.next for q in self.queues], dtype=torch.int64)
        comm.all_reduce(launched, self.control_group, op=torch.distributed.ReduceOp.MAX)
        for queue, count in zip(self.queues, launched.tolist()):
            queue.launch_up_to(count)
        for queue in self.queues:
            queue.rewind()
        self.agreement.realign(self.control_group)
        for state in self.states:
            state.strategy.discard_pass()
            state.reset_pass()
        self._pass_task = None
        self.clear_step()
        return True

    def clear_step(self, set_to_none: bool = False) -> None:
        """Forget every gradient of the step (zero_grad, or a new step after step() consumed them)."""
        for state in self.states:
            state.strategy.zero()
            state.got_grad = [False] * len(state.family.params)
            if set_to_none:
                for i, p in enumerate(state.family.params):
                    if state.exposed[i]:
                        p.grad = None
                        state.exposed[i] = False
        self._dirty = False
        self._consumed = False
        self.unscaled_passes = 0

    def mark_consumed(self) -> None:
        self._consumed = True


def _pre_hook(ref, family: int, index: int):
    def hook(grad):
        reducer = ref()
        if reducer is not None:
            reducer._before_accumulate(reducer.states[family], index)
    return hook


def _post_hook(ref, family: int, index: int):
    def hook(param):
        reducer = ref()
        if reducer is not None:
            reducer._on_gradient(reducer.states[family], index)
    return hook
