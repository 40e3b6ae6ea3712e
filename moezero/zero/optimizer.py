"""ZeroOptimizer: ZeRO stage 0/1/2 around any element-wise torch optimizer, correct for MoE.

    opt = ZeroOptimizer(model, torch.optim.AdamW, groups=groups, stage=2, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

Semantics are plain PyTorch's on the global batch: gradients are averaged over the data-parallel
world (expert gradients summed over `edp` and divided by the dp size), a param that got a
gradient on some ranks is averaged with zeros from the others, and a param that got none on any
rank in a step is skipped by the inner optimizer, as torch skips `grad is None`.
"""
from __future__ import annotations

import contextlib
import inspect
import math
from typing import Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from moezero import ops
from moezero.parallel import ParallelGroups, comm
from moezero.zero.buckets import ParamFamily, build_families
from moezero.zero.loss_scaler import DynamicLossScaler
from moezero.zero.master import MasterShards
from moezero.zero.param_groups import check_elementwise, default_param_groups, group_index_of_params
from moezero.zero.reducer import GradReducer
from moezero.zero.stages import STAGES
from moezero.zero.state import load_into, shard_state_dict


def _supports_fused(optimizer_cls: type) -> bool:
    return "fused" in inspect.signature(optimizer_cls.__init__).parameters


class ParameterSetChanged(RuntimeError):
    """The model's trainable parameters are not the ones the optimizer was built for."""


class ZeroOptimizer:
    """Sharded data-parallel optimizer for models with (and without) expert parallelism.

    Args:
        model: the model; every param with requires_grad is trained (routed-expert params, tagged
            by the MoE layer, are reduced over `groups.edp`, all others over `groups.dp`).
        optimizer_cls: an element-wise torch.optim class (SGD, Adam, AdamW, ...).
        groups: ParallelGroups (default: a world of one).
        stage: 0 (data parallel), 1 (sharded optimizer state) or 2 (+ sharded gradients).
        bucket_size: elements per gradient bucket.
        overlap_comm: reduce buckets during backward as they become ready.
        clip_grad: clip the global grad norm to this value (None or 0: no clipping).
        grad_reduce_dtype: dtype gradients are accumulated and reduced in (fp64 models use fp64).
        param_groups: torch-style groups of model params; default: no weight decay for biases,
            norms and embeddings.
        loss_scaler: fp16 dynamic loss scaler (created automatically for fp16 models).
        max_skipped_steps: raise after this many non-finite steps in a row.
        **optimizer_kwargs: passed to optimizer_cls (lr, betas, weight_decay, ...).
    """

    def __init__(self, model: nn.Module, optimizer_cls: type, groups: Optional[ParallelGroups] = None, *,
                 stage: int = 2, bucket_size: int = 2_000_000, overlap_comm: bool = True,
                 clip_grad: Optional[float] = None, grad_reduce_dtype: torch.dtype = torch.float32,
                 param_groups: Optional[Sequence[Dict]] = None, loss_scaler: Optional[DynamicLossScaler] = None,
                 max_skipped_steps: int = 20, **optimizer_kwargs):
        if stage not in STAGES:
            raise ValueError(f"stage must be one of 0, 1, 2, got {stage}")
        check_elementwise(optimizer_cls)
        self.model = model
        self.groups = groups or ParallelGroups.single()
        self.stage = stage
        self.clip_grad = clip_grad or None
        self.max_skipped_steps = max_skipped_steps
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self._named:
            raise ValueError("the model has no trainable parameters")
        param_dtype = self._named[0][1].dtype
        self.master_dtype = torch.promote_types(param_dtype, torch.float32)
        reduce_dtype = torch.promote_types(grad_reduce_dtype, param_dtype) if param_dtype == torch.float64 \
            else grad_reduce_dtype
        self.families: List[ParamFamily] = build_families(self._named, self.groups, bucket_size)
        self.strategies = [STAGES[stage](f, reduce_dtype, self.master_dtype, self.groups.dp_size)
                           for f in self.families]
        self.reducer = GradReducer(self.families, self.strategies, self.groups.control, overlap_comm)
        self.master = MasterShards(self.families, self.strategies, self.master_dtype)
        self.inner = self._build_inner(optimizer_cls, param_groups, optimizer_kwargs)
        fp16 = any(p.dtype == torch.float16 for _, p in self._named)
        self.loss_scaler = loss_scaler or (DynamicLossScaler() if fp16 else None)
        self.last_grad_norm: Optional[float] = None
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self._param_ids = {id(p) for _, p in self._named}

    def _build_inner(self, optimizer_cls, param_groups, kwargs) -> torch.optim.Optimizer:
        if param_groups is None:
            param_groups = default_param_groups(self.model, kwargs.get("weight_decay", 0.0))
        group_of = group_index_of_params(param_groups, self._named)
        view_groups = [dict({k: v for k, v in g.items() if k != "params"}, params=[]) for g in param_groups]
        for v in self.master.views:
            param = self.families[v.family].params[v.index]
            view_groups[group_of[id(param)]]["params"].append(v.master)
        # torch optimizers refuse empty groups; a rank may own no piece of some group
        self._group_sources = [i for i, g in enumerate(view_groups) if g["params"]] or [0]
        kept = [view_groups[i] for i in self._group_sources]
        if not kept[0]["params"]:
            kept = [dict(view_groups[0], params=[torch.zeros(0)])]
        self._num_user_groups = len(view_groups)
        if "fused" not in kwargs and "foreach" not in kwargs and _supports_fused(optimizer_cls):
            try:  # torch's fused kernels (CPU and CUDA) are 2-3x faster than the per-tensor loop
                return optimizer_cls(kept, fused=True, **kwargs)
            except (RuntimeError, ValueError, TypeError):
                pass
        return optimizer_cls(kept, **kwargs)

    # ---- the training-loop API ---------------------------------------------------------------
    @property
    def param_groups(self) -> List[Dict]:
        """The inner optimizer's groups (set 'lr' here for schedules)."""
        return self.inner.param_groups

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside are not the last micro-step: stage 0/1 accumulate without reducing."""
        previous = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield
        finally:
            self.reducer.sync_enabled = previous

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), scaled by the fp16 loss scale when there is one."""
        if self.loss_scaler is not None:
            loss = loss * self.loss_scaler.scale
        loss.backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reducer.new_step()
        self.master.clear_grads()

    def reduce_gradients(self) -> None:
        """Finish every bucket reduction (collective; `step()` calls it, tests may call it first)."""
        self.reducer.finish_reductions()

    def step(self) -> bool:
        """Reduce, clip and update; returns False when a non-finite gradient skipped the step."""
        self.check_parameters()
        self.reduce_gradients()
        took_grad = self._took_gradient_anywhere()
        reduced = [[s.reduced_grad(b) for b in range(len(f.buckets))] for f, s in zip(self.families, self.strategies)]
        inv_scale = 1.0 / self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        norm = math.sqrt(self._owned_sum_of_squares(reduced)) * inv_scale
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            return self._skip()
        coefficient = inv_scale
        if self.clip_grad is not None:
            coefficient *= min(1.0, self.clip_grad / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
        if coefficient != 1.0:
            torch._foreach_mul_([g for buckets in reduced for g in buckets], coefficient)
        self.master.assign_grads(reduced, took_grad)
        self.inner.step()
        self.master.clear_grads()
        self.master.publish()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        self.consecutive_skips = 0
        return True

    # ---- internals ---------------------------------------------------------------------------
    def _took_gradient_anywhere(self) -> List[List[bool]]:
        """Per family, per param: did any rank of the family's group get a gradient this step."""
        out = []
        for i, family in enumerate(self.families):
            flags = torch.tensor(self.reducer.took_gradient(i), dtype=torch.int32)
            comm.all_reduce(flags, family.group, op=torch.distributed.ReduceOp.MAX)
            out.append([bool(f) for f in flags.tolist()])
        return out

    def _owned_sum_of_squares(self, reduced) -> float:
        """Sum of squared gradients over the elements this rank owns, summed over all ranks.

        Each element of a dense bucket is owned by one dp rank and each element of an expert
        bucket by one rank of its edp group (and the ep ranks hold different experts), so every
        element of the model is counted exactly once.
        """
        owned = []
        for f, (family, strategy) in enumerate(zip(self.families, self.strategies)):
            for b in range(len(family.buckets)):
                lo, hi = family.own_range(b)
                base = strategy.optimizer_range(b)[0]
                owned.append(reduced[f][b][lo - base:hi - base])
        total = ops.sum_of_squares(owned).to(torch.float64).reshape(1)
        comm.all_reduce(total, self.groups.control)
        return float(total.item())

    def _skip(self) -> bool:
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=True)
        if self.consecutive_skips >= self.max_skipped_steps:
            raise FloatingPointError(f"the global gradient norm was not finite in {self.consecutive_skips} "
                                     "consecutive steps; stopping (lower --lr, check the data, or raise "
                                     "--max-consecutive-skipped-steps)")
        return False

    def check_parameters(self) -> None:
        """Every trainable param is one the optimizer owns, still trainable, in its buffer."""
        current = dict(self.model.named_parameters())
        for name, p in current.items():
            if p.requires_grad and id(p) not in self._param_ids:
                raise ParameterSetChanged(f"parameter '{name}' is trainable but was not when ZeroOptimizer was "
                                          "built (a new or swapped-in module?); rebuild the optimizer")
        for family in self.families:
            for index, (name, p) in enumerate(zip(family.names, family.params)):
                if current.get(name) is not p:
                    raise ParameterSetChanged(f"parameter '{name}' was replaced or removed after ZeroOptimizer "
                                              "was built; rebuild the optimizer")
                if not p.requires_grad:
                    raise ParameterSetChanged(f"parameter '{name}' was frozen after ZeroOptimizer was built; "
                                              "rebuild the optimizer to exclude it")
                if not family.storage_intact(index):
                    raise ParameterSetChanged(f"parameter '{name}' no longer lives in the optimizer's buffer "
                                              "(its storage was replaced, e.g. by module.float() or a .data swap)")

    def state_dict(self) -> Dict:
        """This rank's shard of master weights and optimizer state (see `moezero.zero.state`)."""
        return shard_state_dict(self)

    def load_state_dict(self, state: Dict) -> None:
        """Load a shard saved with the same layout, or a consolidated state (any dp/ep layout)."""
        load_into(self, state)

    def user_group_hyperparams(self) -> List[Optional[Dict]]:
        """Hyperparameters per user-level param group (None for a group this rank holds no piece of)."""
        out: List[Optional[Dict]] = [None] * self._num_user_groups
        for source, group in zip(self._group_sources, self.inner.param_groups):
            out[source] = {k: v for k, v in group.items() if k != "params"}
        return out

    def set_user_group_hyperparams(self, saved: Sequence[Optional[Dict]]) -> None:
        for source, group in zip(self._group_sources, self.inner.param_groups):
            if source < len(saved) and saved[source] is not None:
                group.update(saved[source])

    @property
    def counters(self):
        return self.reducer.counters
