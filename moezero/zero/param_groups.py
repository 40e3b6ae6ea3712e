"""Which params get weight decay, and which optimizers can run on flat shards."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn
from torch.nn.utils import parametrize

# Optimizers whose update of an element depends only on that element's gradient and state:
# they give the same result on any slice of a param, so they can run on this rank's shard.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD,
    torch.optim.Adadelta,
)


def check_elementwise(optimizer_cls: type) -> None:
    if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, ELEMENTWISE_OPTIMIZERS):
        return
    allowed = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    name = getattr(optimizer_cls, "__name__", repr(optimizer_cls))
    raise ValueError(f"ZeroOptimizer cannot run {name}: it updates slices of flat parameter shards, which is "
                     f"only correct for element-wise optimizers ({allowed}). Optimizers that need whole "
                     "parameters or a closure (Adafactor, Muon, Shampoo, LBFGS, SparseAdam) are not supported.")


def is_no_decay(name: str, param: nn.Parameter, embedding_params: set) -> bool:
    """Biases, norm weights (1-D) and embedding tables are not decayed (Megatron's and GPT-2's rule)."""
    return param.ndim < 2 or id(param) in embedding_params or name.endswith(".bias")


def _weight_parameter(module: nn.Module) -> torch.Tensor:
    """module.weight's Parameter, also when a parametrization (e.g. fake quantization) computes .weight."""
    if parametrize.is_parametrized(module, "weight"):
        return module.parametrizations.weight.original
    return module.weight


def default_param_groups(model: nn.Module, weight_decay: float) -> List[Dict]:
    """Two torch-style groups: decayed weights, and biases/norms/embeddings with weight_decay 0."""
    embeddings = {id(_weight_parameter(m)) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if is_no_decay(name, p, embeddings) else decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def group_index_of_params(param_groups: Sequence[Dict], named_params: Sequence[Tuple[str, nn.Parameter]]
                          ) -> Dict[int, int]:
    """id(param) -> index of its group; every trainable param in exactly one group."""
    index: Dict[int, int] = {}
    for g, group in enumerate(param_groups):
        for p in group["params"]:
            if id(p) in index:
                raise ValueError("a parameter appears in more than one param group")
            index[id(p)] = g
    missing = [name for name, p in named_params if id(p) not in index]
    if missing:
        raise ValueError(f"trainable parameters missing from param_groups: {', '.join(missing[:5])}")
    return index
