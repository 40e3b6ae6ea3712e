"""ZeroOptimizer: ZeRO stage 0/1/2/3 around any element-wise torch optimizer, correct for MoE.

    opt = ZeroOptimizer(model, torch.optim.AdamW, groups=groups, stage=2, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

Semantics are plain PyTorch's on the global batch: gradients are averaged over the data-parallel
world (expert gradients summed over `edp` and divided by the dp size), a param that got a
gradient on some ranks is averaged with zeros from the others, and a param that got none on any
rank in a step is skipped by the inner optimizer, as torch skips `grad is None`.

It is a `torch.optim.Optimizer`: `param_groups` are the user's groups (same count and order on
every rank; set "lr" there, or hand the optimizer to a torch lr scheduler), `zero_grad()` and
`model.zero_grad()` both clear, and the inner optimizer's defaults are torch's.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from moezero.config import ZeroConfig
from moezero.parallel import ParallelGroups
from moezero.zero.engine import GradientPieces, ZeroEngine, ZeroSettings
from moezero.zero.loss_scaler import DynamicLossScaler
from moezero.zero.muon import WholeParams
from moezero.zero.modify import AdoptionFailed, ModifiedDifferently, modify_model
from moezero.zero.hooks import OwnerMark
from moezero.zero.param_groups import check_elementwise, normalize_param_groups, steps_per_family_by_default
from moezero.zero.state import load_state, shard_state
from moezero.zero.zero_param import Range

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
_OWNER = "_moezero_optimizer"  # the model's current ZeroOptimizer (hooks.OwnerMark), so a new one can retire it


def resolve_groups(groups: Optional[ParallelGroups]) -> ParallelGroups:
    if groups is not None:
        return groups
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"ZeroOptimizer needs groups= in a world of {dist.get_world_size()} processes (without it "
            "nothing would be averaged): pass the ParallelGroups the model's MoE layers were built "
            "with, e.g. groups=ParallelGroups.build(expert_parallel_size=...)"
        )
    return ParallelGroups.single()


class ZeroOptimizer(torch.optim.Optimizer):
    """Sharded data-parallel optimizer for models with (and without) expert parallelism.

    Args:
        model: the model; routed-expert params (tagged by the MoE layer) are reduced over `groups.edp`,
            all others over `groups.dp`.
        optimizer_cls: an element-wise torch.optim class (SGD, Adam, AdamW, ...).
        groups: ParallelGroups (required when torch.distributed runs more than one process).
        stage: 0 (data parallel), 1 (sharded optimizer state), 2 (+ sharded gradients) or
            3 (+ sharded parameters, gathered per unit around its forward and backward).
        bucket_size: elements per gradient bucket.
        overlap_comm: reduce buckets during backward as they become ready.
        clip_grad: clip the global grad norm to this value (None or 0: no clipping).
        grad_reduce_dtype: dtype gradients are accumulated and reduced in (fp64 params use fp64).
        main_grads_dtype: dtype the inner optimizer gets the gradients in (default: the master dtype); another
            (bf16) only for an optimizer that keeps its own master weights (PrecisionAwareAdam).
        param_groups: torch-style params or groups (default: `model.parameters()` in one group, frozen
            ones included: they keep their place and state, are skipped while frozen, and train again
            once unfrozen inside `modify_model()`);
            `weight_decay_groups(model, wd)` gives Megatron's no-decay rule for biases/norms/embeddings.
        loss_scaler: fp16 dynamic loss scaler (created automatically for fp16 models).
        max_skipped_steps: raise after this many non-finite steps in a row (fp16: at the minimum loss scale).
        min_unit_params: stage 3: consecutive blocks (modules of an nn.ModuleList/Sequential) share a gather
            unit until their params, expert stacks aside, reach this (a short last run joins the one before);
            blocks that all together fall short of it are gathered with their parent's unit (the root's: from the
            forward's start to the backward's end). Default 0: every block is a unit.
        step_per_family: step the inner optimizer once per family (the params of one reduce group and dtype: dense,
            experts), the families that gather over other ranks first, each family's all-gather running while the
            next one steps; right only for an optimizer whose step() skips params without a gradient and keeps all
            its state per param. False: one step over all families, then the all-gathers. None (default):
            `steps_per_family_by_default(optimizer_cls)`: True for torch's element-wise classes themselves and
            PrecisionAwareAdam (not their subclasses), False for any other class.
        check_exchanges_with_gathers: stage 3, where a forward gathers units: an MoE layer's agreement record is
            also stated in the sequence of the gathers' records (one small message per MoE layer and forward)
            and its exchange waits watching that sequence, so that a rank in the exchange while a peer waits in a
            unit gather raises RanksDisagree on both instead of hanging. False saves that message where every
            rank is known to run the same forwards in the same layer order: the record riding on the exchange itself
            still catches ranks that reach different exchanges, but the case above waits for the group's timeout.
            Default True.
        **optimizer_kwargs: passed to optimizer_cls (lr, betas, weight_decay, ...); torch's defaults apply.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_cls: type,
        groups: Optional[ParallelGroups] = None,
        *,
        stage: int = 2,
        bucket_size: int = 2_000_000,
        overlap_comm: bool = True,
        clip_grad: Optional[float] = None,
        grad_reduce_dtype: torch.dtype = torch.float32,
        main_grads_dtype: Optional[torch.dtype] = None,
        param_groups: Any = None,
        loss_scaler: Optional[DynamicLossScaler] = None,
        max_skipped_steps: int = 20,
        min_unit_params: int = 0,
        step_per_family: Optional[bool] = None,
        check_exchanges_with_gathers: bool = True,
        **optimizer_kwargs,
    ):
        check_elementwise(optimizer_cls)
        self.model = model
        self.groups = resolve_groups(groups)
        in_optimizer = bool(getattr(optimizer_cls, "holds_master_weights", False))
        if main_grads_dtype is not None and not in_optimizer:
            raise ValueError(
                f"main_grads_dtype={main_grads_dtype} needs an optimizer that keeps its own master "
                f"weights (PrecisionAwareAdam); {optimizer_cls.__name__} steps master copies"
            )
        self.settings = ZeroSettings(
            stage,
            bucket_size,
            overlap_comm,
            grad_reduce_dtype,
            main_grads_dtype,
            in_optimizer,
            min_unit_params,
            check_exchanges_with_gathers,
        )
        self.clip_grad = clip_grad or None
        self.max_skipped_steps = max_skipped_steps
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, optimizer_kwargs
        self._building = True
        self._retired = ""  # why this optimizer no longer manages the model (see _stop())
        user_groups = normalize_param_groups(model.parameters() if param_groups is None else param_groups)
        _retire_previous_owner(model)
        self.engine, self.inner = self._build_engine(user_groups)
        self.step_per_family = (
            steps_per_family_by_default(optimizer_cls) if step_per_family is None else bool(step_per_family)
        )
        super().__init__(user_groups, self.inner.defaults)
        self._building = False
        fp16 = any(p.dtype == torch.float16 for p in self.engine.params())
        self.loss_scaler = loss_scaler if loss_scaler is not None else (DynamicLossScaler() if fp16 else None)
        self.last_grad_norm: Optional[float] = None
        self.count_zeros_in_grad = False  # True: every step counts them into last_num_zeros_in_grad
        self.last_num_zeros_in_grad: Optional[int] = None
        self.skipped_steps = 0
        self.consecutive_skips = 0
        object.__setattr__(model, _OWNER, OwnerMark(self))

    @classmethod
    def from_config(
        cls,
        model: nn.Module,
        optimizer_cls: type,
        groups: Optional[ParallelGroups],
        config: ZeroConfig,
        param_groups: Any = None,
        fp16: bool = False,
        **optimizer_kwargs,
    ) -> "ZeroOptimizer":
        """Built from the command line's ZeroConfig (the loss scaler only for an fp16 model)."""
        scaler = (
            DynamicLossScaler(
                config.initial_loss_scale, config.loss_scale_window, config.hysteresis, config.min_loss_scale
            )
            if fp16
            else None
        )
        return cls(
            model,
            optimizer_cls,
            groups,
            stage=config.stage,
            bucket_size=config.bucket_size,
            overlap_comm=config.overlap_comm,
            clip_grad=config.clip_grad or None,
            grad_reduce_dtype=REDUCE_DTYPES[config.grad_reduce_dtype],
            loss_scaler=scaler,
            main_grads_dtype=(REDUCE_DTYPES[config.main_grads_dtype] if config.use_precision_aware_optimizer else None),
            max_skipped_steps=config.max_skipped_steps,
            param_groups=param_groups,
            min_unit_params=config.min_unit_params,
            **optimizer_kwargs,
        )

    # ---- construction --------------------------------------------------------------------------
    def _build_engine(self, user_groups: List[Dict]):
        group_of = {id(p): g for g, group in enumerate(user_groups) for p in group["params"]}
        named = [(n, p) for n, p in self.model.named_parameters() if id(p) in group_of]
        if len(named) != len(group_of):
            raise ValueError("param_groups hold a tensor that is not a parameter of the model")
        engine = ZeroEngine(self.model, named, self.groups, self.settings)
        piece_groups = [dict({k: v for k, v in g.items() if k != "params"}, params=[]) for g in user_groups]
        for piece in engine.master_pieces():
            piece_groups[group_of[id(piece.param.param)]]["params"].append(piece.master)
        kwargs = self.optimizer_kwargs
        if getattr(self.optimizer_cls, "needs_whole_params", False):  # Muon: assembles whole matrices (muon.py)
            families = [p.family for p in engine.parts if p.family.trainable]
            sharded = "optimizer_state" in engine.stage.shards
            whole = WholeParams(families, engine.master_pieces(), group_of, sharded, self.groups.tp, self.groups.etp)
            kwargs = dict(kwargs, whole_params=whole)
        return engine, _inner_optimizer(self.optimizer_cls, piece_groups, kwargs)

    def rebuild(self, user_groups: List[Dict]) -> None:
        """A new engine for these groups (modify_model's adoption); state is loaded afterwards."""
        self.engine, self.inner = self._build_engine(user_groups)
        self.param_groups = user_groups

    def param_name(self, param: torch.Tensor) -> str:
        return self.engine.param_name(param)

    def add_param_group(self, param_group: Dict) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError(
                "ZeroOptimizer shards a fixed set of params: add or swap params inside "
                "`with opt.modify_model():` (new params get a group of their own there)"
            )
        super().add_param_group(param_group)

    # ---- the training-loop API ---------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside are not the last micro-step: stages 0/1 accumulate without reducing."""
        with self.engine.no_sync():
            yield

    @contextlib.contextmanager
    def scaled_backwards(self) -> Iterator[None]:
        """Backwards inside are of losses the caller multiplied by the fp16 loss scale itself (a pipeline schedule's
        loss function, where `backward` would multiply): the step unscales their gradients as `backward`'s."""
        self._check_live()
        with self.engine.scaled_backward():
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), scaled by the fp16 loss scale when there is one."""
        self._check_live()
        with self.engine.scaled_backward():
            (loss * self.loss_scaler.scale if self.loss_scaler is not None else loss).backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the step's gradients (`model.zero_grad()` and `p.grad = None` clear them too)."""
        self._check_live()
        self.engine.clear_step(set_to_none)

    def reduce_gradients(self) -> None:
        """Collective: finish every bucket reduction (`step()` calls it; tests may call it first)."""
        self._check_live()
        scaler = self.loss_scaler
        self.engine.finish_reductions(loss_scaled=scaler is not None, loss_scale=scaler.scale if scaler else 1.0)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Collective: torch.nn.utils.clip_grad_norm_ for sharded gradients; returns the global norm."""
        if norm_type != 2.0:
            raise ValueError(f"norm_type={norm_type}: only the 2-norm is supported")
        self.reduce_gradients()
        reduced = self.engine.reduced_grads()
        norm = self._global_norm(reduced)
        if math.isfinite(norm):
            self.engine.scale_reduced(reduced, min(1.0, max_norm / (norm + 1e-6)))
        return norm

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Reduce, clip and update; returns False when a non-finite gradient skipped the step."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure (no element-wise optimizer needs one)")
        self.reduce_gradients()
        engine = self.engine
        reduced = engine.begin_step()
        norm = self.last_grad_norm = self._global_norm(reduced)
        if not math.isfinite(norm):  # the norm is global: every rank skips alike
            self.last_num_zeros_in_grad = None
            return self._skip()
        if self.count_zeros_in_grad:  # Megatron's --log-num-zeros-in-grad (a collective, as the norm)
            self.last_num_zeros_in_grad = engine.owned_zero_count(reduced)
        coefficient = 1.0 / self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        if self.clip_grad is not None:
            coefficient *= min(1.0, self.clip_grad / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
        engine.scale_reduced(reduced, coefficient)
        for group, inner_group in zip(self.param_groups, self.inner.param_groups):
            inner_group.update({k: v for k, v in group.items() if k != "params"})
        engine.update(reduced, self.inner.step, per_family=self.step_per_family)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        self.consecutive_skips = 0
        return True

    def _global_norm(self, reduced) -> float:
        inv_scale = 1.0 / self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        return math.sqrt(self.sum_over_model_parts(self.engine.owned_sum_of_squares(reduced))) * inv_scale

    def sum_over_model_parts(self, total: float) -> float:
        """A seam meant to be overridden by a layout that splits the model beyond this optimizer's groups (pipeline
        stages: moezero.pipeline's optimizer): `total`, a sum over the params this optimizer holds (every rank of its
        groups has it), summed over the model's other parts. Collective where overridden; here the optimizer holds
        the whole model. The gradient norm (so clipping, the non-finite skip and the loss scaler) and the params norm
        go through it."""
        return total

    def _skip(self) -> bool:
        self.skipped_steps += 1
        scaler = self.loss_scaler
        # fp16: overflows while the loss scale can still back off are its search for a scale (Megatron's never
        # stop a run); only those at --min-loss-scale count towards the limit
        if scaler is None or scaler.scale <= scaler.min_scale:
            self.consecutive_skips += 1
        if scaler is not None:
            scaler.update(overflow=True)
        if self.consecutive_skips >= self.max_skipped_steps:
            at_minimum = " at the minimum loss scale (--min-loss-scale)" if scaler is not None else ""
            raise FloatingPointError(
                f"the global gradient norm was not finite in {self.consecutive_skips} "
                f"consecutive steps{at_minimum}; stopping (lower --lr, check the data, or "
                "raise --max-consecutive-skipped-steps)"
            )
        return False

    # ---- reading state -------------------------------------------------------------------------
    def params_norm(self) -> float:
        """Collective: the L2 norm of the trainable weights (their fp32 masters; Megatron's params norm)."""
        return math.sqrt(
            self.sum_over_model_parts(self.engine.params_sum_of_squares(getattr(self.inner, "master_values", None)))
        )

    def owned_gradients(self) -> GradientPieces:
        """{name: [(global element range, averaged gradient)]} of the elements this rank owns.

        Valid after `reduce_gradients()` and before `step()` (which unscales and clips in place).
        """
        return self.engine.owned_gradients()

    @contextlib.contextmanager
    def full_parameters(self, modifier_rank: Optional[int] = None) -> Iterator[None]:
        """Collective at stage 3: every param full inside (stages 0-2 always are), to read and to write in place
        (`load_state_dict`, `torch.nn.init.*`, `p.copy_()`): on the way out the written values become the params'
        and their master weights' (elements left untouched keep their wider masters). Every rank must write
        the same, or pass `modifier_rank`: that rank's values are every rank's on the way out (collective at
        every stage; DeepSpeed's GatheredParameters(modifier_rank=...)). To change the model's structure, use
        modify_model()."""
        with self.engine.full_parameters(modifier_rank):
            yield

    def params_unit_by_unit(self) -> Iterator[List[torch.Tensor]]:
        """Collective at stage 3 (every rank iterates to the end): the params this optimizer holds, one stage-3
        unit at a time, full (readable) until the next is asked for; at stages 0-2 all at once. To read the whole
        model (an export) holding no more than one unit beyond what the rank keeps; writes there are not kept."""
        self._check_live()
        yield from self.engine.params_unit_by_unit()

    @contextlib.contextmanager
    def modify_model(self) -> Iterator[None]:
        """Collective context: every param full and plain inside; on exit the optimizer adopts the
        model's trainable params (see `moezero.zero.modify`)."""
        self._check_live()
        self.engine.recover_aborted_backward()
        try:
            with modify_model(self):
                yield
        except (ModifiedDifferently, AdoptionFailed) as error:  # the engine stays detached: stop loudly
            self._stop(f"this ZeroOptimizer let go of the model when opt.modify_model() failed: {error.problem}")
            raise

    def held_ranges(self) -> Dict[str, List[Range]]:
        """{name: global element ranges} this rank's optimizer holds (what a checkpoint load must supply)."""
        return self.engine.held_ranges()

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds for training, by kind: params, grads, master, optimizer_state."""
        return self.engine.memory_bytes(self.inner.state)

    @property
    def counters(self):
        return self.engine.counters

    def state_dict(self) -> Dict:
        """This rank's shard of master weights and optimizer state (see `moezero.zero.state`)."""
        return shard_state(self)

    def load_state_dict(self, state: Dict) -> None:
        """Collective: load this rank's shard saved on the same layout, or a consolidated state (any layout)."""
        load_state(self, state)

    def scalar_state(self) -> Dict[str, Any]:
        """What a checkpoint keeps besides the pieces: hyperparams per group, loss scale, skip counts."""
        return {
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
        }

    def load_scalar_state(self, state: Dict[str, Any]) -> None:
        saved = state.get("param_groups") or []
        if len(saved) != len(self.param_groups):
            raise ValueError(f"the state has {len(saved)} param groups, this optimizer has {len(self.param_groups)}")
        for group, hyper in zip(self.param_groups, saved):
            group.update({k: v for k, v in hyper.items() if k != "params"})
        if self.loss_scaler is not None and state.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)

    # ---- lifetime ------------------------------------------------------------------------------
    def _retire(self) -> None:
        """A newer ZeroOptimizer takes over the model: let go of its params and hooks."""
        self.engine.detach()
        self._stop("this ZeroOptimizer was replaced by a newer one built for the same model; use the new one")

    def _stop(self, reason: str) -> None:
        """This optimizer no longer manages the model (its engine is detached); any use raises `reason`."""
        self._retired = reason

    def _check_live(self) -> None:
        if self._retired:
            raise RuntimeError(self._retired)


def _retire_previous_owner(model: nn.Module) -> None:
    previous = getattr(model, _OWNER, None)
    opt = previous() if previous is not None else None
    if opt is not None and not opt._retired:
        opt._retire()


# torch's fused kernels (CPU and CUDA): one kernel over all params instead of a loop of small ops per tensor, much
# faster. Only where each param's state starts on its own first gradient: fused SGD fails once some params have
# momentum buffers and a param that got its first gradient later (a data-dependent branch) does not.
FUSED_BY_DEFAULT = (torch.optim.Adam, torch.optim.AdamW)


def _inner_optimizer(optimizer_cls: type, view_groups: List[Dict], kwargs: Dict) -> torch.optim.Optimizer:
    """The torch optimizer stepping this rank's master views (fused Adam/AdamW unless told otherwise)."""
    if getattr(optimizer_cls, "holds_master_weights", False):  # its gradients come as decoupled_grad
        return optimizer_cls(view_groups, use_decoupled_grad=True, **kwargs)
    if "fused" not in kwargs and "foreach" not in kwargs and issubclass(optimizer_cls, FUSED_BY_DEFAULT):
        try:
            return optimizer_cls(view_groups, fused=True, **kwargs)
        except (RuntimeError, ValueError, TypeError):
            pass
    return optimizer_cls(view_groups, **kwargs)
