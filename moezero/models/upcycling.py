"""--moe-use-upcycling (Megatron's; Komatsuzaki et al. 2022, "Sparse Upcycling"): an MoE model starts from a
dense model's weights. Every expert of layer i is a copy of layer i's dense MLP, the routers keep their fresh
init, everything else is the dense model's. When a token's top-k weights sum to 1 (a renormalised softmax,
or sigmoid scores over k > 1) and nothing is dropped, its MoE output is the dense MLP's output, so the
upcycled model's logits start as the dense model's. Model surgery only: which checkpoint a run upcycles and
where it starts is the training layer's (`moezero.training.resume.upcycling_point`).

At tensor or expert-tensor parallelism each rank's params are slices of the global ones (their TensorShard, which
for an etp-split expert stack describes one expert's slice of the dense MLP too): each rank copies in the slice
of the dense tensor that a one-process upcycle puts there, as megatron-core's upcycling_utils copies local shards.
The caller passes how to read a param's shard (`shard_of`: the model knows no parallel layout).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Optional

import torch

from moezero.config import ConfigError, GPTConfig, MoEConfig
from moezero.models.gpt import GPTModel

_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(w1|w2|b1|b2)$")  # the layers' and the MTP depths' (Megatron matches
# by suffix)
_DENSE = {"w1": ("fc1.weight", True), "w2": ("fc2.weight", True), "b1": ("fc1.bias", False), "b2": ("fc2.bias", False)}


def check_upcyclable(model: GPTConfig, moe: MoEConfig) -> None:
    """The MoE settings under which the upcycled logits equal the dense ones."""
    problems = [
        (moe.num_experts is None, "needs --num-experts"),
        (
            moe.ffn_hidden_size not in (None, model.ffn_hidden_size),
            f"--moe-ffn-hidden-size must be the dense width ({model.ffn_hidden_size})",
        ),
        (moe.shared_expert_intermediate_size is not None, "no shared expert (the dense MLP has no counterpart)"),
        (moe.capacity_factor is not None, "dropless routing (a dropped token loses its MLP)"),
        (moe.topk_scaling_factor not in (None, 1.0), "no --moe-router-topk-scaling-factor"),
        (
            moe.score_function == "softmax" and moe.pre_softmax,
            "top-k weights that sum to 1: not --moe-router-pre-softmax",
        ),
        (moe.score_function == "sigmoid" and moe.top_k == 1, "top-k weights that sum to 1: sigmoid needs top-k > 1"),
        (
            moe.load_balancing_type == "sinkhorn",
            "top-k weights that sum to 1: not --moe-router-load-balancing-type "
            "sinkhorn (its weights are not renormalised)",
        ),
    ]
    for failed, what in problems:
        if failed:
            raise ConfigError(f"--moe-use-upcycling: {what}")


# a param's tensor-parallel shard (parallel/tensor_marker.py's TensorShard: global_shape, local_of, item_shard), None
# for a whole param
ShardOf = Callable[[torch.Tensor], Optional[Any]]


def upcycle(model: GPTModel, dense: Dict[str, torch.Tensor], shard_of: ShardOf = lambda param: None) -> None:
    """Fill `model` (this rank's experts and slices) from the dense model's global tensors `dense` (consolidated
    names); `shard_of` tells which slice of its global tensor a param holds."""
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            source = _dense_tensor(name, dense)
            if source is not None:
                tensor.copy_(_local_values(name, tensor, source, shard_of(tensor)).to(tensor.dtype))


def _dense_tensor(name: str, dense: Dict[str, torch.Tensor]):
    """The global dense tensor `name` starts from (of an expert stack: one expert's), None for a router."""
    expert = _EXPERT.match(name)
    if expert:  # every local expert: the dense MLP (its weights transposed into the (in, out) stack layout)
        key, transpose = _DENSE[expert.group(2)]
        weight = dense[f"{expert.group(1)}.{key}"]
        return weight.t() if transpose else weight
    if ".mlp.router." in name:
        return None  # a new router
    if name not in dense:
        raise ConfigError(f"--moe-use-upcycling: the dense checkpoint has no {name}")
    return dense[name]


def _local_values(name: str, tensor: torch.Tensor, source: torch.Tensor, shard: Optional[Any]) -> torch.Tensor:
    """This rank's part of the global `source`: its tp / etp slice (`shard`), each local expert a copy."""
    expert = _EXPERT.match(name) is not None
    if shard is not None:
        shard = shard.item_shard() if expert else shard  # an expert stack's shard: one expert's slice
    wanted = shard.global_shape if shard is not None else tuple(tensor.shape[1:] if expert else tensor.shape)
    if tuple(source.shape) != wanted:
        raise ConfigError(
            f"--moe-use-upcycling: the dense checkpoint's tensor for {name} is shaped {tuple(source.shape)}, "
            f"the model needs {wanted}"
        )
    local = shard.local_of(source) if shard is not None else source
    return local.unsqueeze(0) if expert else local
