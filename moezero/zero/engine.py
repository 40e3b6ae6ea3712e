"""ZeroEngine: the sharding machinery for one set of params, wired together.

    families (families.py)          which param sits where, which slice this rank owns (frozen ones apart)
      x param side (param_storage)  where param values live: replicated (0-2) or sharded (3)
      x grad side (grad_strategies) how gradients are accumulated and reduced (per stage)
    reducer (reducer.py)            hooks, per-backward bookkeeping, launch order
    master (master.py)              this rank's master weights and the views the inner optimizer steps

`ZeroOptimizer` owns one engine and builds a new one when the model changes (`modify_model`).
"""
from __future__ import annotations

from dataclasses import dataclass
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from moezero import ops
from moezero.parallel import ParallelGroups, comm
from moezero.zero.families import ParamFamily, Range, build_families
from moezero.zero.agreement import RankAgreement
from moezero.zero.grad_strategies import GradStrategy, NoGradients
from moezero.zero.master import MasterShards, master_dtype_of
from moezero.zero.param_guard import ShardInfo, shard_param_type, unshard_param_type
from moezero.zero.param_storage import ReplicatedParams
from moezero.zero.reducer import FamilyPass, GradReducer
from moezero.zero.sharded_params import ShardedParams
from moezero.zero.units import UnitGatherer, UnitPlan, plan_units
from moezero.zero.stages import stage_of

GradientPieces = Dict[str, List[Tuple[Range, torch.Tensor]]]


@dataclass(frozen=True)
class ZeroSettings:
    """How params are sharded and gradients reduced (plain data; see ZeroOptimizer for each field)."""

    stage: int = 2
    bucket_size: int = 2_000_000
    overlap_comm: bool = True
    grad_reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        stage_of(self.stage)   # a known stage, or one clear error
        if self.bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {self.bucket_size}")

    def reduce_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """fp64 params reduce in fp64; everything else in grad_reduce_dtype."""
        return torch.float64 if param_dtype == torch.float64 else self.grad_reduce_dtype


class ZeroEngine:
    def __init__(self, model: nn.Module, named_params: Sequence[Tuple[str, nn.Parameter]], groups: ParallelGroups,
                 settings: ZeroSettings):
        self.groups, self.settings = groups, settings
        self.stage = stage_of(settings.stage)
        plan = plan_units(model, [p for _, p in named_params]) if self.stage.shards_params else None
        self.families: List[ParamFamily] = build_families(named_params, groups, settings.bucket_size,
                                                          plan.unit_of if plan else None)
        self.storages = [self._param_storage(f) for f in self.families]
        self.strategies = [self._grad_strategy(f) for f in self.families]
        self.agreement = RankAgreement(groups.agreement_group(), plan.names if plan else [])
        trainable = [f for f, family in enumerate(self.families) if family.trainable]
        self.reducer = GradReducer([FamilyPass(self.families[f], self.storages[f], self.strategies[f])
                                    for f in trainable], groups.control, settings.overlap_comm, self.agreement)
        self._pass_of = dict(zip(trainable, self.reducer.states))   # family index -> its reducer state
        self.master = MasterShards(self.families, self.storages, self.strategies)
        self.inner_state = None  # the inner optimizer's state dict, set by ZeroOptimizer (for memory_bytes)
        self.gatherer = self._unit_gatherer(plan) if plan else None

    def _param_storage(self, family: ParamFamily):
        if not self.stage.shards_params:
            return ReplicatedParams(family)
        dp, edp = self.groups.gather_groups()
        return ShardedParams(family, edp if family.kind == "expert" else dp)

    def _grad_strategy(self, family: ParamFamily) -> GradStrategy:
        dtypes = (self.settings.reduce_dtype(family.dtype), master_dtype_of(family.dtype), self.groups.dp_size)
        if not family.trainable:
            return NoGradients(family, *dtypes, whole_buckets=self.stage.keeps_whole_buckets)
        return self.stage.grad_strategy(family, *dtypes)

    def _unit_gatherer(self, plan: UnitPlan) -> UnitGatherer:
        parts: Dict[int, list] = {}
        per_unit: Dict[int, Optional[int]] = {}
        for family, storage in zip(self.families, self.storages):
            for unit in storage.unit_buckets:
                parts.setdefault(unit, []).append((storage, unit))
            for unit in family.units:
                count = per_unit.get(unit, 0)
                per_unit[unit] = None if count is None or not family.trainable else count + 1
        gatherer = UnitGatherer(plan, parts, per_unit, self.agreement)
        self.reducer.on_pass_begin = gatherer.begin_backward
        self.reducer.on_param_done = lambda state, index: gatherer.param_done(state.family.units[index])
        for family in self.families:   # reads outside the unit's forward and backward are guarded
            for name, p, unit in zip(family.names, family.params, family.units):
                shard_param_type(p, ShardInfo(name, unit, weakref.ref(gatherer)))
        return gatherer

    def params(self) -> List[nn.Parameter]:
        return [p for f in self.families for p in f.params]

    def detach(self) -> None:
        """Collective at stage 3. Remove the hooks and give the params full values in storage of their
        own (the engine is discarded)."""
        self.reducer.remove_hooks()
        if self.gatherer is not None:
            self.gatherer.remove_hooks()
            self.gatherer.gather_all()
            for p in self.params():
                unshard_param_type(p)
        for storage in self.storages:
            storage.release()

    # ---- at step() -------------------------------------------------------------------------------
    def took_gradient_anywhere(self) -> List[List[bool]]:
        """Per family, per param: did any rank of the family's group get a gradient this step."""
        out = []
        for f, family in enumerate(self.families):
            state = self._pass_of.get(f)
            if state is None:   # a frozen family
                out.append([False] * len(family.params))
                continue
            flags = torch.tensor(state.got_grad, dtype=torch.int32)
            comm.all_reduce(flags, family.group, op=torch.distributed.ReduceOp.MAX)
            out.append([bool(flag) for flag in flags.tolist()])
        return out

    def reduced_grads(self) -> List[List[Optional[torch.Tensor]]]:
        """Per family, per bucket: the averaged gradient over the optimizer range (None: a frozen family)."""
        return [[s.reduced_grad(b) if f.trainable else None for b in range(f.num_buckets)]
                for f, s in zip(self.families, self.strategies)]

    def owned_sum_of_squares(self, reduced: List[List[torch.Tensor]]) -> float:
        """Sum of squared gradients over the elements this rank owns, summed over all ranks.

        Each element of a dense bucket is owned by one dp rank and each element of an expert bucket
        by one rank of its edp group (and the ep ranks hold different experts), so every element of
        the model is counted exactly once.
        """
        total = ops.sum_of_squares(self._owned_reduced(reduced)).to(torch.float64).reshape(1)
        comm.all_reduce(total, self.groups.control)
        return float(total.item())

    def owned_zero_count(self) -> int:
        """Gradient elements that are exactly zero, over the model's params (each counted once; a bucket's
        alignment padding is not a param's)."""
        count = torch.zeros(1, dtype=torch.int64)
        for view, part, _, _ in self.owned_pieces():
            if self.families[view.family].trainable:
                reduced = self.strategies[view.family].reduced_grad(view.bucket)
                count += int((reduced[view.offset:view.offset + view.numel][part] == 0).sum())
        comm.all_reduce(count, self.groups.control)
        return int(count.item())

    def params_sum_of_squares(self) -> float:
        """Sum of squared trainable weights (the fp32 masters), over the model, each element once."""
        owned = [view.master[part] for view, part, _, _ in self.owned_pieces() if self.families[view.family].trainable]
        total = ops.sum_of_squares(owned).to(torch.float64).reshape(1)
        comm.all_reduce(total, self.groups.control)
        return float(total.item())

    def _owned_reduced(self, reduced: List[List[torch.Tensor]]) -> List[torch.Tensor]:
        owned = []
        for f, (family, strategy) in enumerate(zip(self.families, self.strategies)):
            for b in range(family.num_buckets if family.trainable else 0):
                lo, hi = family.owned[b]
                base = strategy.optimizer_range(b)[0]
                owned.append(reduced[f][b][lo - base:hi - base])
        return owned

    def owned_pieces(self):
        """(view, slice of the view, global range, name) for the part of each master view this rank owns."""
        for view in self.master.views:
            family = self.families[view.family]
            base = self.strategies[view.family].optimizer_range(view.bucket)[0] + view.offset
            own_lo, own_hi = family.owned[view.bucket]
            lo, hi = max(base, own_lo), min(base + view.numel, own_hi)
            if lo < hi:
                start = view.param_range[0] + lo - base
                yield view, slice(lo - base, hi - base), family.global_range(view.index, (start, start + hi - lo)), \
                    family.names[view.index]

    def owned_gradients(self) -> GradientPieces:
        """Averaged gradients of the elements this rank owns, in global coordinates (after reduction)."""
        out: GradientPieces = {}
        for view, part, global_range, name in self.owned_pieces():
            if not self.families[view.family].trainable:
                continue
            reduced = self.strategies[view.family].reduced_grad(view.bucket)
            grad = reduced[view.offset:view.offset + view.numel][part].clone()
            out.setdefault(name, []).append((global_range, grad))
        return out

    def global_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {name: f.placements[i][0] for f in self.families for i, name in enumerate(f.names)}

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank's optimizer holds, by kind (params: the storage it manages for the model)."""
        def size(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)
        state = [v for s in self._inner_states() for v in s.values() if torch.is_tensor(v)]
        masters = [m for f, ms in enumerate(self.master.masters) if not self.master.aliased[f] for m in ms]
        return {"params": sum(s.nbytes() for s in self.storages),
                "grads": sum(g.nbytes() for g in self.strategies),
                "master": size(masters), "optimizer_state": size(state)}

    def _inner_states(self):
        return [self.inner_state.get(v.master, {}) for v in self.master.views] if self.inner_state is not None else []

    def scale_reduced(self, reduced: List[List[torch.Tensor]], coefficient: float) -> None:
        if coefficient != 1.0:
            torch._foreach_mul_([g for buckets in reduced for g in buckets if g is not None], coefficient)
