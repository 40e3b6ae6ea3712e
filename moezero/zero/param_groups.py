"""Param groups in the forms torch accepts, the opt-in no-decay rule, and which optimizers shard."""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn

from moezero.parallel.expert_marker import is_expert_parallel
from moezero.zero.precision_aware_adam import PrecisionAwareAdam

# Optimizers whose update of an element depends only on that element's gradient and state:
# they give the same result on any slice of a param, so they can run on this rank's shard.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
    torch.optim.Adadelta,
    PrecisionAwareAdam,  # element-wise but for the per-tensor scale of fp16/fp8 states (per shard, as Megatron's)
)


def steps_per_family_by_default(optimizer_cls: type) -> bool:
    """ZeroOptimizer's `step_per_family=None`: True for exactly the classes above and for an optimizer that keeps
    its own master weights. Their step() skips a param without a gradient and keeps every count per param, so
    stepping one family at a time gives the numbers of one step over all; a subclass may keep state across
    params (a global step count), so it is stepped once unless it says otherwise."""
    return optimizer_cls in ELEMENTWISE_OPTIMIZERS or bool(getattr(optimizer_cls, "holds_master_weights", False))


def check_elementwise(optimizer_cls: type) -> None:
    if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, ELEMENTWISE_OPTIMIZERS):
        return
    allowed = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    name = getattr(optimizer_cls, "__name__", repr(optimizer_cls))
    raise ValueError(
        f"ZeroOptimizer cannot run {name}: it updates slices of flat parameter shards, which is "
        f"only correct for element-wise optimizers ({allowed}). Optimizers that need whole "
        "parameters or a closure (Adafactor, Shampoo, LBFGS, SparseAdam) are not supported; for Muon use "
        "moezero.zero.Muon."
    )


def normalize_param_groups(param_groups: Any) -> List[Dict]:
    """torch's accepted forms (tensors, a generator, dicts whose "params" is a tensor or an iterable)
    as a list of dicts with a list of params each."""
    if isinstance(param_groups, torch.Tensor):
        raise TypeError("param_groups should be an iterable of Tensors or dicts, but got a Tensor (wrap it in a list)")
    groups = list(param_groups)
    if not groups:
        raise ValueError("param_groups is empty: the optimizer got no parameters")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for group in groups:
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        out.append(dict(group, params=params))
    seen = set()
    for group in out:
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError("a parameter appears more than once in param_groups")
            seen.add(id(p))
    return out


def is_no_decay(name: str, param: nn.Parameter) -> bool:
    """Biases and 1-D params (norm weights) are not decayed: megatron-core's rule (its
    get_standard_config_overrides: `*.bias` or one dimension). Embedding tables are decayed, as there. A routed-
    expert stack is judged by one expert's tensor, as megatron-core's experts are separate tensors (their biases
    1-D): the stacked biases (experts, width) are not decayed."""
    per_expert_ndim = param.ndim - (1 if is_expert_parallel(param) else 0)
    return per_expert_ndim < 2 or name.endswith(".bias")


def weight_decay_groups(model: nn.Module, weight_decay: float) -> List[Dict]:
    """Opt-in (Megatron's rule): decayed weights, and biases and norms with weight_decay 0 (wd_mult, Megatron's
    key: what a schedule's weight decay is multiplied by for the group).

    Every param is placed, frozen ones too (they train again once unfrozen inside modify_model).
    ZeroOptimizer's default is torch's (one group, the optimizer's own weight decay for all).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if is_no_decay(name, p) else decay).append(p)
    return [
        g
        for g in (
            {"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
        )
        if g["params"]
    ]
