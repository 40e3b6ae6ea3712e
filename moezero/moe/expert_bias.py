"""Aux-loss-free load balancing (DeepSeek-V3): update each router's expert bias once per step.

The bias only shifts which experts are selected, never the combine weights. It is updated from
the tokens each expert received, summed over every micro-batch of the step and every
data-parallel rank, so every rank applies the same update and the (replicated) bias stays
bitwise equal everywhere. Forward passes stay collective-free: the caller hands the per-layer
counts from the `MoEStats` it already has to `accumulate`, and calls `step` after the optimizer.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import nn

from moezero.moe.layer import MoEStats
from moezero.moe.router import TopKRouter
from moezero.parallel import comm


def updated_expert_bias(bias_E: torch.Tensor, tokens_per_expert_E: torch.Tensor, rate: float) -> torch.Tensor:
    """bias + rate * sign(mean load - load): underloaded experts become more attractive."""
    load = tokens_per_expert_E.to(torch.float32)
    return bias_E + rate * torch.sign(load.mean() - load)


class ExpertBiasUpdater:
    """Accumulates tokens per expert of every MoE layer over a step and updates the biases."""

    def __init__(self, model: nn.Module, group: Optional[Any]):
        self.routers: List[TopKRouter] = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.group = group
        self.enabled = any(r.config.enable_expert_bias for r in self.routers)
        self._counts: Optional[torch.Tensor] = None

    def accumulate(self, layer_stats: Sequence[MoEStats]) -> None:
        """Add one micro-batch's counts; `layer_stats` in the model's MoE-layer order."""
        if not self.enabled:
            return
        if len(layer_stats) != len(self.routers):
            raise ValueError(f"got stats of {len(layer_stats)} MoE layers, the model has {len(self.routers)}")
        counts = torch.stack([s.tokens_per_expert.detach().to(torch.float64) for s in layer_stats])
        self._counts = counts if self._counts is None else self._counts + counts

    def step(self) -> None:
        """All-reduce the step's counts over data-parallel ranks and update every bias (collective)."""
        if not self.enabled:
            return
        counts = self._counts
        if counts is None:
            counts = torch.zeros(len(self.routers), self.routers[0].config.num_experts, dtype=torch.float64)
        comm.all_reduce(counts, self.group)
        with torch.no_grad():
            for router, layer_counts in zip(self.routers, counts):
                if router.config.enable_expert_bias:
                    router.expert_bias.copy_(updated_expert_bias(router.expert_bias, layer_counts,
                                                                 router.config.bias_update_rate))
        self._counts = None
