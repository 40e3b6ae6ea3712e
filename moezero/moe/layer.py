"""MoELayer: router + token dispatcher + grouped local experts (+ optional shared expert).

Implements the top-k gated MoE of GShard/Switch (Lepikhin et al. 2020, Fedus et al. 2021) with
expert parallelism over the `ep` group: each rank routes its own tokens, sends them to the ranks
holding their experts, and combines the returned outputs with the routing weights.
"""

from __future__ import annotations

import functools
import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
from torch import nn

from moezero import phases
from moezero.config import MoEConfig, check_experts_divide
from moezero.keyed_random import SampleKeys, init_keyed_, is_bias
from moezero.moe.dispatch import TokenDispatcher
from moezero.moe.experts import DenseMLP, GroupedExperts
from moezero.moe.router import TopKRouter
from moezero.parallel import ExpertShard, ParallelGroups
from moezero.parallel.agreement import ExchangeRecord


@dataclass(frozen=True)
class MoEStats:
    """Per-forward statistics. The losses are graph tensors the caller adds to its loss."""

    aux_loss: torch.Tensor  # the load-balancing losses, each times its coefficient
    z_loss: torch.Tensor  # router z-loss times its coefficient
    tokens_per_expert: torch.Tensor  # int64 (E,): this rank's assignments per global expert, before dropping
    dropped_fraction: torch.Tensor  # share of this rank's assignments dropped by capacity
    tracked: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # for logging: each router loss
    # without its coefficient, under megatron-core's tracker names (detached)
    token_weighted: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # each of LOSSES times the
    # tokens megatron-core weighs it by under --calculate-per-token-loss (the
    # caller divides by the global batch's loss tokens)

    LOSSES = ("aux_loss", "z_loss")  # the router's losses: the training loop adds, averages and logs each
    # by name (a new one: a field here and its row in moezero.metrics)

    @property
    def losses(self) -> Dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.LOSSES}


class MoELayer(nn.Module):
    """A Mixture-of-Experts MLP.

    Args:
        config: router, expert and capacity settings.
        groups: the process groups; experts are split over `groups.ep`, their ffn dim over `groups.etp` (default:
            a world of one).
        layer_number: keys this layer's init and jitter randomness (unique per layer in a model).

    forward(x, keys=None) takes x shaped (B, S, D) or (T, D) and returns (y shaped like x, MoEStats).
    `keys` makes router jitter depend only on (seed, iteration, global sample index).
    """

    def __init__(self, config: MoEConfig, groups: Optional[ParallelGroups] = None, layer_number: int = 0):
        super().__init__()
        groups = groups or ParallelGroups.single()
        check_experts_divide(config.num_experts, groups.ep_size)
        self.config = config
        self.layer_number = layer_number
        self.router = TopKRouter(config, site=f"layer{layer_number}.router", dp_group=groups.dp, cp_group=groups.cp)
        shard = ExpertShard(config.num_experts // groups.ep_size, groups.ep_rank, groups.ep_size)
        self.experts = GroupedExperts(config, shard, groups.etp)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(
                config.hidden_size,
                config.shared_expert_intermediate_size,
                config.activation,
                bias=bool(config.bias),
                offset=config.glu_linear_offset,
                clamp=config.activation_clamp,
            )
        if config.shared_expert_gate:  # Qwen2-MoE's and Megatron's: sigmoid(x . g) scales the shared output
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.dispatcher = TokenDispatcher(config.num_experts, groups.ep, groups.etp)
        # gives the record its exchanges carry (the token counts, the global aux loss's counts): a ZeroOptimizer
        # sets it, so ranks whose exchanges pair with another layer's or another forward's raise RanksDisagree
        self.exchange_record: Optional[Callable[[], Optional[ExchangeRecord]]] = None
        self.reset_parameters()

    def runs_collectives(self) -> bool:
        """Whether its forward talks to other ranks (tokens to other ep or etp ranks, the global aux loss's
        counts)."""
        return (
            self.dispatcher.ep_size > 1
            or self.dispatcher.etp_size > 1
            or "global_aux_loss" in self.config.balancing_coefficients()
        )

    def reset_parameters(self) -> None:
        """Layout-invariant init: expert e of this layer depends on (seed, layer, e) alone; biases zero."""
        init_keyed_(
            self,
            self.config.init_seed,
            lambda name, p: 0.0 if is_bias(name) else self.config.init_std,
            prefix=f"layer{self.layer_number}.",
        )

    def forward(self, x: torch.Tensor, keys: Optional[SampleKeys] = None):
        return phases.run(self.forward_steps(x, keys))

    def forward_steps(self, x: torch.Tensor, keys: Optional[SampleKeys] = None) -> phases.Steps:
        """forward() in phases (moezero.phases): yields after launching each of the dispatcher's
        exchanges."""
        record = self.exchange_record() if self.exchange_record is not None else None
        num_sequences = x.shape[0] if x.dim() == 3 else 1
        x_TD = x.reshape(-1, x.shape[-1])
        routing = self.router(x_TD, num_sequences=num_sequences, keys=keys, record=record)
        sent = yield from self.dispatcher.dispatch_steps(x_TD, routing.topk_ids_TK, routing.topk_weights_TK, record)
        # made now, its node is reached in backward after the rows' gradient is sent back (--delay-wgrad-compute)
        deferred = self.experts.defer_weight_grads()
        yield
        x_MD, counts, meta = sent.receive()
        experts_out = self.experts(x_MD, counts) if deferred is None else self.experts(x_MD, counts, deferred)
        y_TD = yield from self.dispatcher.combine_steps(experts_out, meta)
        if self.shared_expert is not None:
            shared_TD = self.shared_expert(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            y_TD = y_TD + shared_TD
        stats = MoEStats(
            routing.aux_loss,
            routing.z_loss,
            routing.tokens_per_expert_E,
            routing.dropped_fraction,
            routing.tracked,
            routing.token_weighted,
        )
        return y_TD.view(x.shape), stats


def reset_global_load_balancing(model: nn.Module) -> None:
    """After each optimizer step (with --moe-router-load-balancing-type global_aux_loss): the routers count the
    next step's tokens afresh. The training loop calls it; a loop of one's own must too."""
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.reset_global_balancing()


def expert_parallel(groups: ParallelGroups) -> Callable[..., MoELayer]:
    """The MoE-layer factory a model is built with to split its experts over `groups.ep`."""
    return functools.partial(MoELayer, groups=groups)
