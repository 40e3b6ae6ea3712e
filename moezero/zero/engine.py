"""ZeroEngine: the sharding machinery for one set of params, behind one interface.

    records (zero_param.py)         one per param: where it sits, its master piece, its per-step state
    families (param_families.py)    the params reduced over one group in one dtype, in one flat layout
      x param side (param_storage)  where param values live: replicated (0-2) or sharded (3)
      x grad side (grad_strategies) how gradients are accumulated and reduced (per stage, stages.py), each
                                    bucket's state in one Bucket record (bucket.py)
    reducer (reducer.py)            hooks, per-backward bookkeeping, launch order
    master (master.py)              this rank's master weights, the pieces the inner optimizer steps
    gatherer (units.py)             stage 3: gathers and frees the units (unit_plan.py) around forward and
                                    backward; the reducer's listener, passed to it at construction
    model guard (model_guard.py)    what must hold around every forward

docs/zero-internals.md follows one gradient, and one stage-3 unit, through these parts in order.

`ZeroOptimizer` owns one engine, talks to it through the methods below only, and builds a new one when
the model changes (`modify_model`); the old one is detached (hooks removed, params given back).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from moezero import ops
from moezero.parallel import ParallelGroups, comm
from moezero.zero.rank_agreement import Activity, RankAgreement, SiteRecords, unit_plan_fingerprint
from moezero.zero.assigned_grads import reduce_assigned
from moezero.zero.param_families import build_families
from moezero.zero.grad_strategies import GradStrategy, NoGradients
from moezero.zero.master import MasterShards, ReducedGrads, master_dtype_of
from moezero.zero.model_guard import (
    ModelGuard,
    ParameterSetChanged,
    storage_replaced_error,
    unfrozen_by_hand_error,
    unknown_param_error,
)
from moezero.zero.param_guard import ShardInfo, shard_param_type, unshard_param_type
from moezero.zero.reducer import GradReducer, ReducerCounters
from moezero.zero.stages import FamilyParts, stage_of
from moezero.zero.step_totals import StepTotals
from moezero.zero.tp_partial_sums import TpPartialSums
from moezero.torch_internals import in_backward, no_subclass_dispatch
from moezero.zero.unit_plan import UnitPlan, plan_units
from moezero.zero.units import UnitGatherer
from moezero.zero.zero_param import MasterPiece, ParamFamily, Range, ZeroParam, optimizer_slice

GradientPieces = Dict[str, List[Tuple[Range, torch.Tensor]]]


@dataclass(frozen=True)
class ZeroSettings:
    """How params are sharded and gradients reduced (plain data; see ZeroOptimizer for each field)."""

    stage: int = 2
    bucket_size: int = 2_000_000
    overlap_comm: bool = True
    grad_reduce_dtype: torch.dtype = torch.float32
    main_grads_dtype: Optional[torch.dtype] = None  # the optimizer's gradients (None: the master dtype)
    masters_in_optimizer: bool = False  # the inner optimizer keeps the master weights itself
    min_unit_params: int = 0  # stage 3: a smaller block is gathered with its parent's unit
    check_exchanges_with_gathers: bool = True  # stage 3: MoE layers' records also in the gathers' sequence

    def __post_init__(self):
        stage_of(self.stage)  # a known stage, or one clear error
        if self.bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {self.bucket_size}")

    def reduce_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """fp64 params reduce in fp64; everything else in grad_reduce_dtype."""
        return torch.float64 if param_dtype == torch.float64 else self.grad_reduce_dtype

    def grads_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype the optimizer gets the reduced gradients in (fp64 params: fp64)."""
        if self.main_grads_dtype is None or param_dtype == torch.float64:
            return master_dtype_of(param_dtype)
        return self.main_grads_dtype


class ZeroEngine:
    """Args: the model, the params to manage (the model's params in some param group), the groups, settings."""

    def __init__(
        self,
        model: nn.Module,
        named_params: Sequence[Tuple[str, nn.Parameter]],
        groups: ParallelGroups,
        settings: ZeroSettings,
    ):
        self.model, self.groups, self.settings = model, groups, settings
        self.stage = stage_of(settings.stage)
        plan = (
            plan_units(model, [p for _, p in named_params], settings.min_unit_params)
            if self.stage.shards_params
            else None
        )
        families = build_families(named_params, groups, settings.bucket_size, plan.unit_of if plan else None)
        self.parts = [FamilyParts(f, self.stage.param_storage(f, groups), self._grad_strategy(f)) for f in families]
        self.records: List[ZeroParam] = [zp for f in families for zp in f.members]
        self._record_of = {id(zp.param): zp for zp in self.records}
        managed = {id(p) for _, p in named_params}
        self._outside = {id(p) for p in model.parameters() if id(p) not in managed}  # in no param group
        self.agreement = RankAgreement(groups.agreement_group(), plan.names if plan else [])
        if plan is not None:  # units pair their gathers by position: every rank must plan the same ones
            self.agreement.check(Activity.UNIT_PLAN, unit_plan_fingerprint(plan.names))
        self.master = MasterShards(self.parts, settings.masters_in_optimizer)
        self.gatherer = self._unit_gatherer(plan) if plan else None
        self.reducer = GradReducer(
            self.reducer_strategies(),
            groups.control,
            settings.overlap_comm,
            self.agreement,
            listener=self.gatherer,
        )
        self._collective_sites = self._watch_model_collectives(model)
        self._guard = ModelGuard(model, self)  # after the gatherer: its root hook runs first
        self.step_totals = StepTotals(families, groups)
        self._flags_unread = False  # see begin_step
        self.tp_sums = TpPartialSums([b for s in self.reducer_strategies() for b in s.buckets], groups.tp)

    def reducer_strategies(self) -> List[GradStrategy]:
        """The grad strategies of the trainable families (those the reducer reduces)."""
        return [p.strategy for p in self.parts if p.family.trainable]

    def _grad_strategy(self, family: ParamFamily) -> GradStrategy:
        settings = self.settings
        dtypes = (settings.reduce_dtype(family.dtype), settings.grads_dtype(family.dtype), self.groups.dp_size)
        if not family.trainable:
            return NoGradients(family, *dtypes, whole_buckets=self.stage.keeps_whole_buckets)
        return self.stage.grad_strategy(family, *dtypes)

    def _unit_gatherer(self, plan: UnitPlan) -> UnitGatherer:
        parts: Dict[int, list] = {}
        per_unit: Dict[int, Optional[int]] = {}
        for p in self.parts:
            for unit in p.storage.unit_buckets:
                parts.setdefault(unit, []).append((p.storage, unit))
            for zp in p.family.members:
                count = per_unit.get(zp.unit, 0)
                per_unit[zp.unit] = None if count is None or not p.family.trainable else count + 1
        gatherer = UnitGatherer(plan, parts, per_unit, self.agreement, take_written=self.master.take_written_values)
        for zp in self.records:  # reads outside the unit's forward and backward are guarded
            shard_param_type(zp.param, ShardInfo(zp.name, zp.unit, weakref.ref(gatherer)))
        return gatherer

    def _watch_model_collectives(self, model: nn.Module) -> List[nn.Module]:
        """Modules whose forward talks to other ranks (MoE layers: `runs_collectives()`) get a record to carry on
        their exchanges, so ranks in different forwards or layer orders raise RanksDisagree instead of pairing
        one layer's exchange with another's. Where a forward also gathers units, the record is checked in the
        gathers' sequence too (see SiteRecords), unless the settings say not to."""
        if self.agreement.group is None:
            return []
        sites = [
            (name, m) for name, m in model.named_modules() if hasattr(m, "exchange_record") and m.runs_collectives()
        ]
        on_channel = (
            self.settings.check_exchanges_with_gathers
            and self.gatherer is not None
            and self.gatherer.gathers_in_forward()
        )
        for index, (_, module) in enumerate(sites):
            module.exchange_record = SiteRecords(self.agreement, index, on_channel)
        self.agreement.site_names = [name for name, _ in sites]
        return [module for _, module in sites]

    # ---- what it manages -------------------------------------------------------------------------
    def params(self) -> List[nn.Parameter]:
        return [zp.param for zp in self.records]

    def param_name(self, param: torch.Tensor) -> str:
        return self._record_of[id(param)].name

    def left_out(self, param: torch.Tensor) -> bool:
        """A param of the model that no param group holds (the user built the optimizer without it)."""
        return id(param) in self._outside

    def master_pieces(self) -> List[MasterPiece]:
        """The leaf tensors the inner optimizer steps, one per param piece this rank holds."""
        return self.master.pieces

    def global_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {zp.name: zp.global_shape for zp in self.records}

    @property
    def counters(self) -> ReducerCounters:
        return self.reducer.counters

    def check_agreement(self, activity: Activity) -> None:
        """Collective: every rank states that it is doing `activity` now (RanksDisagree otherwise)."""
        self.agreement.check(activity)

    def detach(self) -> None:
        """Collective at stage 3. Remove the hooks and give the params full values in storage of their
        own (the engine is discarded)."""
        self._guard.remove()
        for module in self._collective_sites:
            module.exchange_record = None
        self.reducer.remove_hooks()
        if self.gatherer is not None:
            self.gatherer.remove_hooks()
            self.gatherer.gather_all()
            for p in self.params():
                unshard_param_type(p)
        for p in self.parts:
            p.storage.release()

    # ---- around forward (the model guard's hooks) ------------------------------------------------
    def before_forward(self) -> None:
        self.recover_aborted_backward()
        self._check_model(during_forward=False)
        if self.gatherer is not None:
            self.gatherer.root_pre_forward()

    def after_forward(self, output) -> None:
        self._check_model(during_forward=True)
        if self.gatherer is not None:
            self.gatherer.root_post_forward(output)

    def _check_model(self, during_forward: bool) -> None:
        with no_subclass_dispatch():  # a stage-3 param's attribute reads skip its guard (one switch, not per read)
            self._check_params(during_forward)

    def _check_params(self, during_forward: bool) -> None:
        """Every param of the model is managed and where the optimizer put it, or outside every group and frozen.
        This runs around every forward: a plain walk of the modules' param tables (named_parameters' names and
        its dedup cost ~4x more); the names are looked up only to raise."""
        record_of, outside = self._record_of, self._outside
        for p in _module_params(self.model):
            zp = record_of.get(id(p))
            if zp is None:
                if p.requires_grad and id(p) not in outside:
                    break
            elif not zp.storage_intact() or (p.requires_grad and not zp.family.trainable):
                break
        else:
            return
        self._raise_for_params(during_forward)

    def _raise_for_params(self, during_forward: bool) -> None:
        for name, p in self.model.named_parameters():
            zp = self._record_of.get(id(p))
            if zp is None:
                if p.requires_grad and id(p) not in self._outside:
                    raise unknown_param_error(name, during_forward)
            elif not zp.storage_intact():
                raise storage_replaced_error(name)
            elif p.requires_grad and not zp.family.trainable:
                raise unfrozen_by_hand_error(name)

    @contextlib.contextmanager
    def full_parameters(self, modifier_rank: Optional[int] = None) -> Iterator[None]:
        """Collective at stage 3: every param full inside (stages 0-2 always are). Writes made inside persist
        (masters and shards); `modifier_rank`: that rank's values are everyone's on the way out (collective at
        every stage)."""
        if modifier_rank is not None and not 0 <= modifier_rank < self.groups.world_size:
            raise ValueError(f"modifier_rank={modifier_rank} is not a rank of this world of {self.groups.world_size}")
        if self.gatherer is not None:
            self.gatherer.hold()
        try:
            yield
            if modifier_rank is not None:
                replaced = next((zp.name for zp in self.records if not zp.storage_intact()), None)
                if self.agreement.check(Activity.LEAVE_FULL_PARAMETERS, modifier_rank, flag=int(replaced is not None)):
                    raise (
                        storage_replaced_error(replaced)
                        if replaced
                        else ParameterSetChanged(
                            "another rank replaced a param's storage (a .data swap, a cast) inside "
                            f"opt.full_parameters(modifier_rank={modifier_rank}); that rank names it. Make such a "
                            "change "
                            "inside `with opt.modify_model():`"
                        )
                    )
                self._broadcast_values(modifier_rank)
            self.master.take_written_values(self.records)
        finally:
            if self.gatherer is not None:
                self.gatherer.release()

    def params_unit_by_unit(self) -> Iterator[List[torch.Tensor]]:
        """Collective at stage 3: the managed params one unit at a time, full while it is current (only this
        unit held: a whole-model read in a rank's own memory); stages 0-2: all of them at once."""
        if self.gatherer is None:
            yield [zp.param for zp in self.records]
            return
        self.agreement.check(Activity.FULL_PARAMETERS)
        gatherer = self.gatherer
        for unit in [0] + gatherer.plan.forward_order:
            if unit not in gatherer.parts:
                continue
            gatherer.ensure(unit, None, exposed=False)
            try:
                yield [zp.param for storage, key in gatherer.parts[unit] for zp in storage.members(key)]
            finally:
                gatherer.free(unit)

    def _broadcast_values(self, modifier_rank: int) -> None:
        """Every replica of every param takes the values of its replica on `modifier_rank` (expert params: the
        member of each expert-data-parallel group at modifier_rank's position in its own)."""
        edp_source = self.groups.layout.edp_group_of(self.groups.rank)[
            self.groups.layout.edp_group_of(modifier_rank).index(modifier_rank)
        ]
        with torch.no_grad():
            for p in self.parts:
                source = edp_source if p.family.kind == "expert" else modifier_rank
                for values in p.storage.full_buffers():
                    comm.broadcast(values, source, p.family.group)

    # ---- around backward -------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield
        finally:
            self.reducer.sync_enabled = previous

    @contextlib.contextmanager
    def scaled_backward(self) -> Iterator[None]:
        """The backward inside runs on a loss multiplied by the loss scale."""
        self.reducer.scaled_backward = True
        try:
            yield
        finally:
            self.reducer.scaled_backward = False

    def recover_aborted_backward(self) -> None:
        """A backward raised (and the loop caught it): clean up collectively, drop the step's gradients. Stage 3:
        also a forward that raised (its owed gathers, see UnitGatherer.finish_aborted_forward)."""
        if self.gatherer is not None and not self.gatherer.forward_active:
            self.gatherer.finish_aborted_forward()
        gatherer_open = self.gatherer is not None and self.gatherer.backward_open
        if (self.reducer.pass_open or gatherer_open) and not in_backward():
            self.reducer.recover_aborted_pass()
            if self.gatherer is not None:
                self.gatherer.recover(self.groups.control)
            self.master.clear_grads()

    def clear_step(self, set_to_none: bool) -> None:
        """Forget the step's gradients (those assigned by hand too)."""
        self.recover_aborted_backward()
        self.reducer.clear_step(set_to_none, assigned_too=True)
        self.master.clear_grads()
        self.tp_sums.clear()

    def finish_reductions(self, loss_scaled: bool, loss_scale: float = 1.0) -> None:
        """Collective: every bucket reduction finished (`loss_scaled`: an fp16 run, whose backwards must
        have gone through the optimizer's scaled backward), and gradients assigned by hand since a param's last
        backward are its step's (assigned_grads.py; the step divides by `loss_scale`)."""
        self.recover_aborted_backward()
        self.reducer.apply_user_clears()
        if loss_scaled and self.reducer.unscaled_passes:
            raise RuntimeError(
                "this fp16 model was trained with a plain loss.backward(): its gradients are not "
                "scaled, so the unscaled step would underflow. Call opt.backward(loss) instead."
            )
        assigned = self.reducer.assigned_grads()
        if self.reducer.finish_reductions(assigned=bool(assigned)):  # some rank assigned a gradient by hand
            reduce_assigned(assigned, self.reducer.buckets, self.step_totals, loss_scale)
            self.reducer.consume_assigned(assigned)

    # ---- at step() -------------------------------------------------------------------------------
    def begin_step(self) -> ReducedGrads:
        """Collective, after finish_reductions: the step's averaged gradients, per family and bucket over
        the optimizer range. Which params got a gradient on some rank is read with the norm (one all-reduce,
        StepTotals), or by update(); gathered units are freed (they would be stale after the update; inside
        full_parameters() they stay, and update() gathers them anew); the next backward starts from zero."""
        if self.gatherer is not None:
            if self.gatherer.holding:  # a step inside full_parameters(): the writes made so far are the step's start
                self.master.take_written_values(self.records)
            else:
                self.gatherer.free_all()  # they would be stale after the update
        self._flags_unread = True  # they ride on the norm's all-reduce (StepTotals), or update() reads them
        reduced = self.reduced_grads()
        self.reducer.mark_consumed()
        return reduced

    def reduced_grads(self) -> ReducedGrads:
        """Per family, per bucket: the averaged gradient over the optimizer range (None: a frozen family); those of
        "tp_partial" families summed over tp (collective over tp when they were reduced since: tp_partial_sums.py)."""
        return self.tp_sums.apply(
            {
                p.family: [
                    p.strategy.reduced_grad(bucket) if p.family.trainable else None for bucket in p.strategy.buckets
                ]
                for p in self.parts
            }
        )

    def _settle_gradient_flags(self) -> None:
        """Which params got a gradient on some rank of their group, unless the norm brought it already."""
        if self._flags_unread:
            self.step_totals.sum(None, with_flags=True)
            self._flags_unread = False

    def owned_sum_of_squares(self, reduced: ReducedGrads) -> float:
        """Sum of squared gradients over the elements this rank owns, summed over all ranks.

        Each element of a dense bucket is owned by one dp rank and each element of an expert bucket
        by one rank of its edp group (and the ep ranks hold different experts), so every element of
        the model is counted exactly once; at tp > 1 tp ranks hold different shards, and the params
        replicated over tp count on tp rank 0 only (summed over tp after the ranks' sum).
        """
        owned = [
            reduced[p.family][b][optimizer_slice(p.family.owned[b], p.strategy.optimizer_range(b))]
            for p in self.parts
            if p.family.trainable and self._counts_here(p.family)
            for b in range(p.family.num_buckets)
        ]
        total = self.step_totals.sum(ops.sum_of_squares(owned).to(torch.float64), with_flags=self._flags_unread)
        self._flags_unread = False
        return float(self._sum_over_tp(torch.tensor([total], dtype=torch.float64)).item())

    def _counts_here(self, family: ParamFamily) -> bool:
        """This rank adds the family's elements to sums over the model: a replica over tp counts on one tp rank."""
        return not family.replicated_over_tp or self.groups.tp_rank == 0

    def _sum_over_tp(self, total: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(total, self.groups.tp)
        return total

    def owned_zero_count(self, reduced: ReducedGrads) -> int:
        """Gradient elements that are exactly zero, over the model's params (each counted once; a bucket's
        alignment padding is not a param's)."""
        count = torch.zeros(1, dtype=torch.int64)
        for piece, part, _ in self.owned_pieces(trainable_only=True, counted=True):
            count += int((piece.of(reduced[piece.param.family][piece.param.bucket])[part] == 0).sum())
        return int(self._sum_over_ranks(count).item())

    def scale_reduced(self, reduced: ReducedGrads, coefficient: float) -> None:
        if coefficient != 1.0:
            torch._foreach_mul_([g for buckets in reduced.values() for g in buckets if g is not None], coefficient)

    def update(self, reduced: ReducedGrads, step_masters: Callable[[], None], per_family: bool = False) -> None:
        """Hand each master piece its gradient, run the inner optimizer's step, publish the new values.

        `per_family` (an optimizer whose step touches only the params that have a gradient, as torch's do): one
        step per family, the families that gather over other ranks first, each family's all-gather running while
        the next one steps (the dense params' all-gather hides behind the experts' update)."""
        self._settle_gradient_flags()
        if not per_family:
            self.master.assign_grads(reduced)
            step_masters()
            self.master.clear_grads()
            self.master.publish(trainable_only=True)
        else:
            works = []
            for family in self.master.update_order():
                self.master.assign_grads(reduced, family)
                step_masters()
                self.master.clear_grads(family)
                works += self.master.start_publish(family)
            for work in works:
                work.wait()
        self._refresh_held_units()

    def publish(self) -> None:
        """After the masters were written (a state load): every param replica sees them."""
        self.master.publish()
        self._refresh_held_units()

    def _refresh_held_units(self) -> None:
        """Stage 3 inside full_parameters(): the units it holds read the new values (collective)."""
        if self.gatherer is not None and self.gatherer.holding:
            self.gatherer.refresh()

    # ---- reading state ---------------------------------------------------------------------------
    def owned_pieces(
        self, trainable_only: bool = False, counted: bool = False
    ) -> Iterator[Tuple[MasterPiece, slice, str]]:
        """(piece, the slice of it this rank owns, name) for each master piece (`counted`: only where sums over
        the model count it, see _counts_here)."""
        for piece in self.master.pieces:
            family = piece.param.family
            if piece.owned.stop > piece.owned.start and (family.trainable or not trainable_only):
                if not counted or self._counts_here(family):
                    yield piece, piece.owned, piece.param.name

    def owned_gradients(self) -> GradientPieces:
        """Averaged gradients of the elements this rank owns, in global coordinates (after reduction)."""
        out: GradientPieces = {}
        reduced = self.reduced_grads()
        for piece, part, name in self.owned_pieces(trainable_only=True):
            zp = piece.param
            grad = piece.of(reduced[zp.family][zp.bucket])[part]
            start = piece.param_range[0] + part.start
            for lo, hi in zp.global_ranges((start, start + part.stop - part.start)):
                out.setdefault(name, []).append(((lo, hi), grad[: hi - lo].clone()))
                grad = grad[hi - lo :]
        return out

    def params_sum_of_squares(self, master_values: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> float:
        """Sum of squared trainable weights (the fp32 masters, read through `master_values` where the inner
        optimizer keeps them), over the model, each element once."""
        values = master_values or (lambda leaf: leaf)
        owned = [values(piece.master)[part] for piece, part, _ in self.owned_pieces(trainable_only=True, counted=True)]
        return float(self._sum_over_ranks(ops.sum_of_squares(owned).to(torch.float64).reshape(1)).item())

    def held_ranges(self) -> Dict[str, List[Tuple[int, ...]]]:
        """{name: global element ranges} of the master pieces this rank holds: (lo, hi), or a tensor-parallel
        shard's strided (lo, hi, count, stride) (strided_ranges.Span)."""
        out: Dict[str, List[Tuple[int, ...]]] = {}
        for piece in self.master.pieces:
            spans = piece.param.global_spans(piece.param_range)
            out.setdefault(piece.param.name, []).extend(glob.as_range() for _, glob in spans)
        return out

    def memory_bytes(self, inner_state: Dict) -> Dict[str, int]:
        """Bytes this rank's optimizer holds, by kind (params: the storage it manages for the model)."""

        def size(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)

        state = [
            v for piece in self.master.pieces for v in inner_state.get(piece.master, {}).values() if torch.is_tensor(v)
        ]
        return {
            "params": sum(p.storage.nbytes() for p in self.parts),
            "grads": sum(p.strategy.nbytes() for p in self.parts),
            "master": size(self.master.unaliased()),
            "optimizer_state": size(state),
        }

    def _sum_over_ranks(self, total: torch.Tensor) -> torch.Tensor:
        """Collective: over every rank of this optimizer's groups, then over tp (the other shards of the model)."""
        comm.all_reduce(total, self.groups.control)
        return self._sum_over_tp(total)


def _module_params(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every param in the model's modules' tables (a param shared by several modules comes once per module)."""
    modules = [model]
    while modules:
        module = modules.pop()
        for p in module._parameters.values():
            if p is not None:
                yield p
        modules.extend(child for child in module._modules.values() if child is not None)
