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

A bucket's state (how many of its params are still awaited, staged, its buffers, its launched reduction)
is its `Bucket` record (`bucket.py`). Inside backward nothing blocks on a peer: buckets are launched in their
queue's order (the same on every rank, `bucket.LaunchQueue`) and completed reductions are only polled.
Before the end-of-backward wait, and before step() reduces, every rank states an agreement record
(`rank_agreement.py`), so a rank whose backward reached no param (its peers would wait for it forever) makes
every rank raise.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from moezero.parallel import comm
from moezero.zero.rank_agreement import Activity, RankAgreement
from moezero.zero.bucket import Bucket, build_queues
from moezero.zero.grad_strategies import GradStrategy
from moezero.zero.model_guard import storage_replaced_message
from moezero.zero.sharded_gradient import ShardedGradient
from moezero.zero.zero_param import ZeroParam
from moezero.torch_internals import backward_accumulates, current_backward, no_subclass_dispatch, queue_end_of_backward


class GradientHookError(RuntimeError):
    """A gradient arrived in a way the reducer cannot account for."""


@dataclass
class ReducerCounters:
    """What happened to every param, for tests and logging (names as in the model)."""

    backward_passes: int = 0
    reduction_rounds: int = 0
    fires: Dict[str, int] = field(default_factory=dict)
    zero_fills: Dict[str, int] = field(default_factory=dict)


class BackwardListener:
    """What the param side hears of a backward, from the reducer's hooks: stage 3's UnitGatherer (units.py), which
    gathers and frees units around it. Passed to GradReducer at construction; this base, which does nothing,
    is the listener of stages 0-2."""

    # the listener states agreement records mid-backward (stage 3: a freed unit gathered again, which its peers
    # do not), and only a record launched after them meets them: the end-of-backward record is then launched at
    # the end, not when the backward begins
    records_mid_backward = False

    def begin_backward(self) -> None:
        """The first hook of a backward ran (before the reducer states its own record)."""

    def param_done(self, zp: ZeroParam) -> None:
        """A trainable param got its gradient in this backward."""


class GradReducer:
    """Hooks, per-backward bookkeeping and bucket launches for a list of param families.

    Args:
        strategies: the grad strategies of the trainable families (each holds its family's buckets).
        control_group: carries the small step-time collectives.
        overlap_comm: launch buckets as they become ready (else at the end of backward).
        agreement: the records every rank states before it waits for a backward's reductions and
            before step() reduces (a rank whose backward reached no param would leave its peers waiting).
        listener: told when a backward begins and when each param got its gradient (stage 3's unit gatherer).
    """

    def __init__(
        self,
        strategies: Sequence[GradStrategy],
        control_group: Optional[Any],
        overlap_comm: bool = True,
        agreement: Optional[RankAgreement] = None,
        listener: Optional[BackwardListener] = None,
    ):
        self.strategies = list(strategies)
        self.buckets = [bucket for strategy in self.strategies for bucket in strategy.buckets]
        for bucket in self.buckets:
            bucket.begin_pass()
        self.agreement = agreement if agreement is not None else RankAgreement(None)
        self.queues = build_queues(self.buckets)
        self._queue_of = {id(bucket): queue for queue in self.queues for bucket in queue.buckets}
        self.control_group = control_group
        self.overlap_comm = overlap_comm
        self.sync_enabled = True
        self.scaled_backward = False  # set by ZeroOptimizer.backward around loss.backward()
        self.unscaled_passes = 0
        self.counters = ReducerCounters()
        self._always_reduce = bool(self.strategies) and self.strategies[0].reduces_under_no_sync
        self._pass_task: Optional[int] = None
        self._grad_only_task: Optional[int] = None  # a torch.autograd.grad(): it accumulates nothing, not a pass
        self._consumed_assigned: Dict[int, Any] = {}  # id(record) -> the assigned gradient a step consumed
        self._pass_synced = False
        self._end_record = None  # the agreement record of this backward's end (stages 0-2: launched when it begins)
        self._dirty = False  # stage 0/1: a no_sync backward left local gradients unreduced
        self._consumed = False  # step() used the gradients: the next backward starts from zero
        self.listener = listener if listener is not None else BackwardListener()
        # the hooks hold the reducer weakly and their param's record by position: a hook that held the record
        # would close a cycle through the param's C++ hook table, which Python's GC cannot see, and a discarded
        # optimizer would stay alive with its buffers and process groups
        ref = weakref.ref(self)
        self.records = [zp for strategy in self.strategies for zp in strategy.family.members]
        self._bucket_of = [
            strategy.buckets[zp.bucket] for strategy in self.strategies for zp in strategy.family.members
        ]  # the Bucket of records[k]
        self._handles = []
        for k, zp in enumerate(self.records):
            self._handles.append(zp.param.register_hook(_pre_hook(ref, k)))
            self._handles.append(zp.param.register_post_accumulate_grad_hook(_post_hook(ref, k)))

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
                "checkpointing?). Use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."
            )
        if self._consumed:
            self.clear_step()
        self._pass_task = task
        self.listener.begin_backward()  # stage 3: the backward's gather records come first, on every rank
        self._pass_synced = self.sync_enabled or self._always_reduce
        if self._pass_synced and not self.listener.records_mid_backward:  # settled before the end-of-backward wait
            self._end_record = self.agreement.launch(Activity.END_OF_BACKWARD)
        if not self.scaled_backward:
            self.unscaled_passes += 1
        queue_end_of_backward(self._end_pass)

    def _accumulates(self, zp: ZeroParam) -> bool:
        """Whether the running backward adds into .grad (torch.autograd.grad calls the params' hooks too, and
        leaves their .grad alone: no pass, nothing to reduce)."""
        task = current_backward()
        if task == self._pass_task:
            return True
        if task == self._grad_only_task:
            return False
        if backward_accumulates(zp.param):
            return True
        self._grad_only_task = task
        return False

    def _before_accumulate(self, k: int) -> None:
        """Before autograd adds record k's gradient: make .grad its view of the bucket."""
        zp, bucket = self.records[k], self._bucket_of[k]
        if not self._accumulates(zp):
            return
        self.begin_pass(zp.name)
        strategy = bucket.strategy
        self._touch(bucket)
        views = strategy.accumulation_views(bucket)
        if views is None:
            if strategy.holds_local and zp.got_grad and zp.placeholder_cleared():
                strategy.forget_local(zp)  # cleared by the user since the last backward
            if zp.shows_sharded_gradient():
                zp.param.grad = None  # autograd makes a fresh gradient, which the bucket copies in
            return
        param, view = zp.param, views[zp.position]
        if param.grad is None or isinstance(param.grad, ShardedGradient):
            if zp.exposed:
                view.zero_()  # the user cleared this gradient (model.zero_grad(), p.grad = None)
        elif param.grad.data_ptr() != view.data_ptr():
            strategy.adopt_assigned(bucket, view, param.grad)  # accumulate on top of it, as torch does
        param.grad = view
        zp.exposed = True

    def _on_gradient(self, k: int) -> None:
        """Record k's gradient arrived: once its bucket has all of them, stage the bucket and launch what is
        ready."""
        zp, bucket = self.records[k], self._bucket_of[k]
        name = zp.name
        self.begin_pass(name)
        if zp.fired:
            raise GradientHookError(
                f"parameter '{name}' received a gradient twice in one backward: its gradient was "
                "accumulated by a nested backward (reentrant activation checkpointing?). Use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."
            )
        if not zp.storage_intact():
            raise GradientHookError(storage_replaced_message(name))
        zp.fired = zp.got_grad = True
        self.counters.fires[name] = self.counters.fires.get(name, 0) + 1
        self.listener.param_done(zp)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._stage(bucket)
            if self.overlap_comm and self._pass_synced:
                self._queue_of[id(bucket)].launch_ready()
        for queue in self.queues:  # release what finished (staging buffers back to the pool); never blocks
            queue.poll()

    def _touch(self, bucket: Bucket) -> None:
        if not bucket.touched:
            bucket.strategy.before_accumulate(bucket)
            bucket.touched = True

    def _stage(self, bucket: Bucket) -> None:
        strategy = bucket.strategy
        self._touch(bucket)
        members = bucket.members
        views = strategy.accumulation_views(bucket)
        for zp in members:
            if zp.fired:
                continue
            assigned = self.assigned_grad(bucket, zp)
            if assigned is not None:  # assigned since the last backward, which did not reach it: it is its gradient
                if views is not None:
                    strategy.adopt_assigned(bucket, views[zp.position], assigned)
                    zp.param.grad = views[zp.position]
                zp.fired = zp.got_grad = True
            elif views is not None and zp.exposed and zp.param.grad is None:
                views[zp.position].zero_()  # cleared by the user and not reached by this backward
        strategy.stage(bucket, [zp for zp in members if zp.fired])
        visible = strategy.visible_grads(bucket, self._pass_synced)
        for zp in members:
            if visible is not None:
                zp.param.grad = visible[zp.position]
                zp.exposed = True
            else:  # no full-size gradient outlives its bucket (stages 1-3): .grad says so when read
                zp.param.grad = zp.sharded_gradient()
                zp.exposed = False
        bucket.staged = True

    def _end_pass(self) -> None:
        """End-of-backward callback: zero-fill, launch every bucket, wait for this backward's reductions."""
        for bucket in self.buckets:
            if bucket.staged:
                continue
            for zp in bucket.members:
                if not zp.fired:
                    self.counters.zero_fills[zp.name] = self.counters.zero_fills.get(zp.name, 0) + 1
            self._stage(bucket)
        if self._pass_synced:
            for queue in self.queues:
                queue.launch_ready()
            # before waiting for the reductions: a peer whose backward reached no param never joins them
            self.agreement.settle(self._end_record or self.agreement.launch(Activity.END_OF_BACKWARD))
            self._end_record = None
            self.agreement.progress.reducing_backwards += 1
            self._finish_round()
            self._dirty = False
        else:
            self._dirty = True
        for bucket in self.buckets:
            bucket.begin_pass()
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

    def finish_reductions(self, assigned: bool = False) -> bool:
        """Collective: reduce what no_sync backwards left local (on every rank if on any). `assigned`: this rank has
        gradients assigned by hand since its last backward; returns whether some rank has."""
        flags = self.agreement.check(Activity.REDUCE, flag=int(self._dirty) | (2 if assigned else 0))
        if flags & 1:  # left unreduced on some rank
            for bucket in self.buckets:
                bucket.strategy.before_accumulate(bucket)
            for queue in self.queues:
                queue.launch_up_to(len(queue.buckets))
            self._finish_round()
        self._dirty = False
        return bool(flags & 2)

    # ---- gradients assigned by hand (`p.grad = g`) ----------------------------------------------------
    def assigned_grad(self, bucket: Bucket, zp: ZeroParam) -> Optional[torch.Tensor]:
        """The tensor the user assigned to the param's .grad, if its .grad is one (not None, not the placeholder,
        not the view this reducer showed, not one a step consumed)."""
        with no_subclass_dispatch():
            grad = zp.param.grad
        if grad is None or isinstance(grad, ShardedGradient):
            return None
        consumed = self._consumed_assigned.get(id(zp))
        if consumed is not None and consumed is grad:
            return None
        if zp.exposed:
            views = bucket.strategy.accumulation_views(bucket) if bucket.strategy.holds_local else None
            if views is None or grad.data_ptr() == views[zp.position].data_ptr():
                return None
        return grad

    def assigned_grads(self) -> Dict[int, Tuple[Bucket, ZeroParam, torch.Tensor]]:
        """id(record) -> (its bucket, record, gradient) of every param whose .grad was assigned by hand since its
        last backward (`torch.autograd.grad` results, gradient surgery)."""
        out = {}
        for bucket in self.buckets:
            for zp in bucket.members:
                grad = self.assigned_grad(bucket, zp)
                if grad is not None:
                    out[id(zp)] = (bucket, zp, grad)
        return out

    def consume_assigned(self, assigned: Dict[int, Tuple[Bucket, ZeroParam, torch.Tensor]]) -> None:
        """A step used these: .grad keeps showing them (as torch's), and the next backward starts from zero."""
        self._consumed_assigned = {key: grad for key, (_, _, grad) in assigned.items()}

    def apply_user_clears(self) -> None:
        """Before the step's reductions finish: a gradient the user cleared after its last backward drops what
        of it is still local (stage 0 shows the whole of it: `p.grad = None` then leaves the param out of the
        step, as torch's optimizers skip it, `zero_()` makes it zero); what stages 1-3 reduced into shards stays."""
        for strategy in self.strategies:
            if not strategy.holds_local:  # stages 2/3: no per-step walk over the params
                continue
            for zp in strategy.family.members:
                if zp.got_grad and zp.cleared_after_backward() and strategy.forget_local(zp) and zp.param.grad is None:
                    zp.got_grad = False

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
        for strategy in self.strategies:
            strategy.discard_pass()
        for bucket in self.buckets:
            bucket.begin_pass()
        self._pass_task = None
        # .grad may be a view of a staging buffer just returned to the pool, which another bucket takes next:
        # no param may keep pointing into it
        self.clear_step(set_to_none=True)
        return True

    def clear_step(self, set_to_none: bool = False, assigned_too: bool = False) -> None:
        """Forget every gradient of the step (zero_grad, or a new step after step() consumed them); assigned
        gradients a step consumed are dropped (`assigned_too`, zero_grad: every assigned one, as torch clears)."""
        for strategy in self.strategies:
            strategy.zero()
            for zp in strategy.family.members:
                zp.got_grad = False
                if set_to_none and (zp.exposed or zp.shows_sharded_gradient()):
                    zp.param.grad = None
                    zp.exposed = False
        with no_subclass_dispatch():
            for bucket in self.buckets if assigned_too else []:
                for zp in bucket.members:
                    grad = self.assigned_grad(bucket, zp)
                    if grad is not None:
                        zp.param.grad = None if set_to_none else grad.zero_()
            for zp in self.records if self._consumed_assigned else []:
                consumed = self._consumed_assigned.get(id(zp))
                if consumed is not None and zp.param.grad is consumed:
                    zp.param.grad = None
        self._consumed_assigned = {}
        self._dirty = False
        self._consumed = False
        self.unscaled_passes = 0

    def mark_consumed(self) -> None:
        self._consumed = True


def _pre_hook(ref, k: int):
    def hook(grad):
        reducer = ref()
        if reducer is not None:
            reducer._before_accumulate(k)

    return hook


def _post_hook(ref, k: int):
    def hook(param):
        reducer = ref()
        if reducer is not None:
            reducer._on_gradient(k)

    return hook
