"""Aux-loss-free load balancing (DeepSeek-V3): update each router's expert bias once per step.

The bias only shifts which experts are selected, never the combine weights. It is updated from
the tokens each expert received (after capacity dropping, as Megatron counts), summed over every micro-batch of the
step and every
data-parallel rank, so every rank applies the same update and the (replicated) bias stays
bitwise equal everywhere. Forward passes stay collective-free: the routers' forward hooks only
count; the one all-reduce runs in the optimizer's step post-hook.
"""

from __future__ import annotations

import functools
from typing import Any, List, Optional

import torch
from torch import nn

from moezero.moe.router import TopKRouter
from moezero.parallel import comm


def updated_expert_bias(bias_E: torch.Tensor, tokens_per_expert_E: torch.Tensor, rate: float) -> torch.Tensor:
    """bias + rate * sign(mean load - load): underloaded experts become more attractive."""
    load = tokens_per_expert_E.to(torch.float32)
    return bias_E + rate * torch.sign(load.mean() - load)


class ExpertBiasUpdater:
    """Counts each MoE layer's tokens per expert over a step and updates the biases after the optimizer's step.

    The counting is a forward hook on every router (training forwards only); the update is the optimizer's
    step post-hook (`attach(opt)`, as torchtitan does), so the training loop knows nothing of it. A layer
    recomputed in backward (activation checkpointing) is counted twice, on every micro-batch alike, which
    doubles its counts and their mean and leaves every update (a sign) as it was.
    """

    def __init__(self, model: nn.Module, group: Optional[Any]):
        self.routers: List[TopKRouter] = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.group = group
        self.enabled = any(r.config.enable_expert_bias for r in self.routers)
        self._counts: Optional[torch.Tensor] = None
        self._handles = (
            [r.register_forward_hook(functools.partial(self._count, i)) for i, r in enumerate(self.routers)]
            if self.enabled
            else []
        )

    def attach(self, optimizer: Any) -> "ExpertBiasUpdater":
        """Update the biases after every `optimizer.step()` (a torch optimizer step post-hook)."""
        if self.enabled:
            self._handles.append(optimizer.register_step_post_hook(lambda *_: self.step()))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _count(self, index: int, router: TopKRouter, inputs, routing) -> None:
        if not router.training:
            return
        if self._counts is None:
            self._counts = torch.zeros(len(self.routers), router.config.num_experts, dtype=torch.float64)
        self._counts[index] += routing.kept_per_expert_E.detach().to(self._counts.device, torch.float64)

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
                    router.expert_bias.copy_(
                        updated_expert_bias(router.expert_bias, layer_counts, router.config.bias_update_rate)
                    )
        self._counts = None
