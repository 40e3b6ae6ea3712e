"""Top-k router with gate `wg`, capacity dropping and load-balancing losses.

Shapes: T tokens, E experts, K top-k, D hidden, B sequences, S tokens per sequence.

The gate weight `wg.weight` stays a parameter of the model's dtype; the logits are computed in
fp32 by casting *inside the matmul*. Casting the module (`self.wg = self.wg.float()` or `.data`
swaps) would detach the parameter from its gradient hook and the optimizer's buffer - the bug
that left DeepSpeed-MoE routers untrained under ZeRO-2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from moezero.config import MoEConfig
from moezero.keyed_random import SampleKeys
from moezero.parallel.agreement import ExchangeRecord
from moezero.moe.load_balancing import (
    SequenceShares,
    TRACKER_NAMES,
    GlobalBalancing,
    balancing_scores,
    sequence_aux_loss,
    sinkhorn,
    switch_aux_loss,
)


ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}  # --moe-router-dtype


@dataclass(frozen=True)
class Routing:
    """What the router decided for T tokens."""

    topk_ids_TK: torch.Tensor  # int64 expert ids; -1 where capacity dropped the assignment
    topk_weights_TK: torch.Tensor  # fp32 (fp64 for fp64 models) combine weights; 0 where dropped
    tokens_per_expert_E: torch.Tensor  # int64 assignments per expert before dropping
    kept_per_expert_E: torch.Tensor  # int64 assignments per expert after dropping (what the expert bias counts)
    aux_loss: torch.Tensor  # fp32 scalar: the load-balancing losses, each times its coefficient
    z_loss: torch.Tensor  # fp32 scalar, already multiplied by its coefficient
    dropped_fraction: torch.Tensor  # fp32 scalar: dropped assignments / (T * K)
    tracked: Dict[str, torch.Tensor] = field(default_factory=dict)  # each loss without its coefficient, under
    # megatron-core's tracker names (detached: for logging)
    token_weighted: Dict[str, torch.Tensor] = field(default_factory=dict)  # "aux_loss", "z_loss": as above, each
    # loss times the tokens megatron-core weighs it by under --calculate-per-token-
    # loss (per_token_loss_weight); in the graph


def per_token_loss_weight(kind: str, num_tokens: int, num_sequences: int) -> int:
    """--calculate-per-token-loss: what megatron-core's router multiplies a loss of `kind` by before attaching it
    (the rows of the routing map it was computed from, its valid_token_count: pretraining has no padding mask);
    the step then divides every gradient by the global batch's loss tokens. The sequence aux loss reshapes the map
    to [S, B * E] first, so it counts the sequence length S, not the micro-batch's tokens."""
    return num_tokens // max(num_sequences, 1) if kind == "seq_aux_loss" else num_tokens


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss: mean over tokens of logsumexp(logits)^2."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Assignments each expert accepts from one rank's micro-batch (Megatron's formula)."""
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def capacity_keep_mask(
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    num_experts: int,
    capacity: int,
    policy: str,
    num_sequences: int = 1,
) -> torch.Tensor:
    """Which (t, k) assignments an over-capacity expert keeps, decided from this rank's tokens as megatron-core's
    apply_router_token_dropping decides: each expert keeps the `capacity` rows that torch.topk picks along the
    tokens of its column of the routing probabilities ("probs") or of the 0/1 routing map ("position"), with
    the tokens in Megatron's order, sequence-major ([S, B]: token s of every sequence before token s + 1), and
    no dropping when the capacity exceeds the tokens. Picks among equal values (the map's ones, always) are
    torch.topk's: the same as Megatron's on the same kind of device, not necessarily another's.
    Tokens come batch-major (B sequences of S tokens each, one after the other)."""
    T, K = topk_ids_TK.shape
    if capacity > T:
        return torch.ones_like(topk_ids_TK, dtype=torch.bool)
    B = num_sequences
    S = T // B

    def sequence_major(x_TE: torch.Tensor) -> torch.Tensor:  # contiguous, as Megatron's [S * B, E]
        return x_TE.view(B, S, num_experts).transpose(0, 1).reshape(T, num_experts)

    if policy == "position":
        values_TE = torch.zeros(T, num_experts, dtype=torch.int32, device=topk_ids_TK.device)
        values_TE.scatter_(1, topk_ids_TK, 1)
    else:
        values_TE = torch.zeros(T, num_experts, dtype=topk_weights_TK.dtype, device=topk_weights_TK.device)
        values_TE.scatter_(1, topk_ids_TK, topk_weights_TK)
    picked = torch.topk(sequence_major(values_TE), k=capacity, dim=0, sorted=False).indices
    kept_TE = torch.zeros(T, num_experts, dtype=torch.bool, device=topk_ids_TK.device).scatter_(0, picked, True)
    kept_TE = kept_TE.view(S, B, num_experts).transpose(0, 1).reshape(T, num_experts)  # back to batch-major
    return kept_TE.gather(1, topk_ids_TK)


def limit_to_groups(
    selection_TE: torch.Tensor, num_groups: int, group_topk: int, group_score: str, top_k: int
) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V2/V3): experts form `num_groups` consecutive groups, each token keeps
    the `group_topk` best groups and its other experts get -inf. A group's score is the sum of its top
    top_k / group_topk selection scores ("top_sum"), of its top two ("top2_sum") or its best one ("max")."""
    T, E = selection_TE.shape
    grouped_TGe = selection_TE.view(T, num_groups, E // num_groups)
    if group_score == "max":
        group_TG = grouped_TGe.amax(-1)
    else:
        best = 2 if group_score == "top2_sum" else top_k // group_topk
        group_TG = grouped_TGe.topk(best, dim=-1).values.sum(-1)
    kept_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, group_TG.topk(group_topk, dim=-1).indices, True)
    return grouped_TGe.masked_fill(~kept_TG.unsqueeze(-1), float("-inf")).view(T, E)


class TopKRouter(nn.Module):
    """Scores tokens, picks top-k experts, applies capacity, and computes the router losses.

    Args:
        config: the layer's MoEConfig.
        site: a name unique to this layer, used to key the jitter randomness.
        dp_group: the data-parallel ranks the global-batch aux loss counts tokens over (None: this process).
        cp_group: the context-parallel ranks holding the other parts of this rank's sequences (None: none). The
            micro-batch and sequence aux losses count tokens over it and each loss is this rank's share: the
            group's terms add up to the whole micro-batch's (megatron-core's tp-cp counting at tp 1).
    """

    def __init__(
        self, config: MoEConfig, site: str = "router", dp_group: Optional[Any] = None, cp_group: Optional[Any] = None
    ):
        super().__init__()
        self.config = config
        self.site = site
        self.cp = SequenceShares(cp_group)
        self.global_balancing = GlobalBalancing(dp_group, self.cp.size)
        self.wg = nn.Linear(config.hidden_size, config.num_experts, bias=bool(config.bias))
        # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias that only affects selection.
        # Replicated on every rank and updated once per optimizer step (see expert_bias.py).
        self.register_buffer(
            "expert_bias", torch.zeros(config.num_experts, dtype=torch.float32), persistent=config.enable_expert_bias
        )

    def _apply(self, fn, recurse=True):
        """Casting the model to bf16/fp16 keeps the expert bias fp32: its per-step updates (1e-3) are below
        bf16's resolution at the values it reaches (0.0039 at 0.5), where they would be lost or skewed."""
        super()._apply(fn, recurse)
        if self.expert_bias.dtype in (torch.bfloat16, torch.float16):
            self.expert_bias = self.expert_bias.float()
        return self

    def forward(
        self,
        x_TD: torch.Tensor,
        num_sequences: int = 1,
        keys: Optional[SampleKeys] = None,
        record: Optional[ExchangeRecord] = None,
    ) -> Routing:
        cfg = self.config
        x_TD = self._jitter(x_TD, num_sequences, keys)
        # fp32 (fp64 for fp64 models) logits with the weight cast inside the op: wg.weight keeps
        # its identity, its gradient hook and its place in the optimizer's buffer
        dtype = ROUTER_DTYPES.get(cfg.router_dtype) or torch.promote_types(x_TD.dtype, torch.float32)
        logits_TE = torch.matmul(x_TD.to(dtype), self.wg.weight.to(dtype).t())
        if self.wg.bias is not None:
            logits_TE = logits_TE + self.wg.bias.to(dtype)
        if cfg.force_load_balancing:
            logits_TE = self._random_logits(logits_TE, num_sequences, keys)
        if cfg.load_balancing_type == "sinkhorn":
            topk_ids_TK, topk_weights_TK = self._select_sinkhorn(logits_TE)
        else:
            topk_ids_TK, topk_weights_TK = self._select(logits_TE)
        counts_E = torch.bincount(topk_ids_TK.reshape(-1), minlength=cfg.num_experts)
        aux_loss, weighted_aux, tracked = self._balancing_losses(logits_TE, num_sequences, record)
        z_loss = logits_TE.new_zeros(())
        if cfg.z_loss_coeff:
            raw = router_z_loss(logits_TE)
            raw = raw if self.cp.size == 1 else raw / self.cp.size  # this rank's equal part of the tokens: a share
            z_loss, tracked["z_loss"] = raw * cfg.z_loss_coeff, raw.detach()
        token_weighted = {
            "aux_loss": weighted_aux,
            "z_loss": z_loss * per_token_loss_weight("z_loss", logits_TE.shape[0], num_sequences),
        }
        topk_ids_TK, topk_weights_TK, dropped = self._drop_over_capacity(topk_ids_TK, topk_weights_TK, num_sequences)
        kept_E = (
            counts_E
            if cfg.capacity_factor is None
            else torch.bincount(topk_ids_TK[topk_ids_TK >= 0], minlength=cfg.num_experts)
        )
        return Routing(
            topk_ids_TK, topk_weights_TK, counts_E, kept_E, aux_loss, z_loss, dropped, tracked, token_weighted
        )

    def reset_global_balancing(self) -> None:
        """After each optimizer step: the global-batch aux loss counts the next step's tokens afresh."""
        self.global_balancing.reset()

    def _random_logits(self, logits_TE, num_sequences, keys):
        """--moe-router-force-load-balancing: N(0, 1) logits (keyed by sample, like the jitter) in forward, the
        real logits' gradient in backward (Megatron's straight-through RandomSTE)."""
        T, E = logits_TE.shape
        if keys is None or T == 0:
            random_TE = torch.randn(T, E, dtype=logits_TE.dtype, device=logits_TE.device)
        else:
            random_TE = keys.normal(self.site + ".force_balance", (T // num_sequences, E), logits_TE.device)
            random_TE = random_TE.reshape(T, E).to(dtype=logits_TE.dtype)
        return random_TE + (logits_TE - logits_TE.detach())

    def _select_sinkhorn(self, logits_TE):
        """Sinkhorn routing (Megatron's): in training the top-k of the balanced assignment, else of the
        probabilities; the weights are the probabilities (sigmoid for top-1, softmax otherwise), not renormalised."""
        k = self.config.top_k
        probs_TE = torch.sigmoid(logits_TE) if k == 1 else torch.softmax(logits_TE, -1)
        if self.training and logits_TE.shape[0]:
            with torch.no_grad():
                topk_ids_TK = torch.topk(sinkhorn(logits_TE.float()), k, dim=1).indices
        else:
            topk_ids_TK = torch.topk(probs_TE, k, dim=1).indices
        return topk_ids_TK, probs_TE.gather(1, topk_ids_TK)

    def _jitter(self, x_TD, num_sequences, keys):
        """--moe-input-jitter-eps: the input times uniform noise in [1 - eps, 1 + eps), in training and in the
        training loop's evaluations (which pass `keys`), as megatron-core's router; keyed by sample (`keys`), else
        from torch's generator. A bare eval-mode call (generation, the tools, a comparison of two models) has no
        keys and no jitter: its outputs are the same at every call."""
        eps = self.config.input_jitter_eps
        if not eps or x_TD.shape[0] == 0 or (keys is None and not self.training):
            return x_TD
        T, D = x_TD.shape
        if keys is None:
            noise = torch.empty_like(x_TD, dtype=torch.float32).uniform_(1.0 - eps, 1.0 + eps)
        else:
            noise = keys.uniform(self.site + ".jitter", (T // num_sequences, D), 1.0 - eps, 1.0 + eps, x_TD.device)
        return x_TD * noise.reshape(T, D).to(dtype=x_TD.dtype)

    def _select(self, logits_TE):
        cfg = self.config
        k = cfg.top_k
        post_softmax = cfg.score_function == "softmax" and not cfg.pre_softmax
        # softmax after the top-k selects on the logits (Megatron's): groups are scored by their logits, and two
        # logits a softmax would round to one probability stay apart
        scores_TE = (
            None
            if post_softmax and not cfg.enable_expert_bias
            else (torch.softmax(logits_TE, -1) if cfg.score_function == "softmax" else torch.sigmoid(logits_TE))
        )
        selection_TE = logits_TE if scores_TE is None else scores_TE
        if cfg.enable_expert_bias:
            selection_TE = selection_TE + self.expert_bias
        if cfg.num_groups is not None:
            selection_TE = limit_to_groups(selection_TE, cfg.num_groups, cfg.group_topk, cfg.group_score, k)
        topk_ids_TK = torch.topk(selection_TE, k, dim=-1).indices
        if post_softmax:
            # softmax over the selected logits == top-k of the full softmax, renormalised
            weights_TK = torch.softmax(logits_TE.gather(1, topk_ids_TK), -1)
        else:
            weights_TK = scores_TE.gather(1, topk_ids_TK)
            if cfg.score_function == "sigmoid" and k > 1:
                weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        if cfg.topk_scaling_factor is not None:
            weights_TK = weights_TK * cfg.topk_scaling_factor
        return topk_ids_TK, weights_TK

    def _balancing_losses(
        self, logits_TE, num_sequences, record=None
    ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
        """(the load-balancing losses that are on, each times its coefficient, summed; the same sum with each also
        times its per_token_loss_weight; {tracker name: each without its coefficient}). The global one in training
        forwards only (it counts the step's tokens, collectively)."""
        cfg, total = self.config, logits_TE.new_zeros(())
        weighted = total
        coefficients = cfg.balancing_coefficients()
        if not coefficients:
            return total, weighted, {}
        probs_TE, map_TE = balancing_scores(logits_TE, cfg.score_function, cfg.top_k)
        tracked = {}
        for kind, coefficient in coefficients.items():
            if kind == "global_aux_loss":
                if not (self.training and torch.is_grad_enabled()):
                    continue
                loss, ranks = self.global_balancing.loss(probs_TE, map_TE, cfg.top_k, record)
                tracked[TRACKER_NAMES[kind]] = loss.detach() * ranks  # Megatron's tracker sums it over ranks
            elif kind == "seq_aux_loss" and logits_TE.shape[0]:
                S = logits_TE.shape[0] // num_sequences
                probs_BSE, map_BSE = probs_TE.view(num_sequences, S, -1), map_TE.view(num_sequences, S, -1)
                if self.cp.size == 1:
                    loss = sequence_aux_loss(probs_BSE, map_BSE, cfg.top_k)
                else:
                    counts_BE = self.cp.sum(map_BSE.detach().sum(1))
                    loss = sequence_aux_loss(probs_BSE, map_BSE, cfg.top_k, counts_BE, S * self.cp.size)
                tracked[TRACKER_NAMES[kind]] = loss.detach()
            else:  # an empty micro-batch has nothing to balance (and no sequence to average)
                if self.cp.size == 1:
                    loss = switch_aux_loss(probs_TE, map_TE.sum(0), cfg.top_k)
                else:
                    counts_E = self.cp.sum(map_TE.detach().sum(0))
                    loss = switch_aux_loss(probs_TE, counts_E, cfg.top_k, logits_TE.shape[0] * self.cp.size)
                tracked[TRACKER_NAMES[kind]] = loss.detach()
            total = total + loss * coefficient
            weighted = weighted + loss * coefficient * per_token_loss_weight(kind, logits_TE.shape[0], num_sequences)
        return total, weighted, tracked

    def _drop_over_capacity(self, topk_ids_TK, topk_weights_TK, num_sequences):
        cfg = self.config
        T, K = topk_ids_TK.shape
        if cfg.capacity_factor is None or T == 0:
            return topk_ids_TK, topk_weights_TK, topk_weights_TK.new_zeros(())
        capacity = expert_capacity(T, cfg.num_experts, K, cfg.capacity_factor)
        keep_TK = capacity_keep_mask(
            topk_ids_TK, topk_weights_TK.detach(), cfg.num_experts, capacity, cfg.token_drop_policy, num_sequences
        )
        ids = torch.where(keep_TK, topk_ids_TK, -1)
        weights = torch.where(keep_TK, topk_weights_TK, 0.0)
        dropped = (~keep_TK).sum().to(torch.float32) / (T * K)
        return ids, weights, dropped
