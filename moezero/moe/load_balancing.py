"""Megatron's load balancing: the aux losses over a micro-batch, each sequence or the global batch, and sinkhorn.

Each loss is computed as megatron-core computes it (its router's _apply_aux_loss, _apply_seq_aux_loss,
_apply_global_aux_loss): from the router's probabilities over all experts and the top-k of those probabilities
(compute_routing_scores_for_aux_loss), not the selection a group limit or an expert bias makes. Several may be on
at once, each with its coefficient; each is also reported without it, under the name megatron-core's MoE metrics
tracker logs it.

Shapes: T tokens, E experts, B sequences, S tokens per sequence.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from moezero.parallel import comm
from moezero.parallel.agreement import ExchangeRecord
from moezero.parallel.groups import SharesProcessGroups
from moezero.torch_internals import in_backward

TRACKER_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def balancing_scores(logits_TE: torch.Tensor, score_function: str, top_k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(probabilities over all experts, the top-k of them as a 0/1 map): what every aux loss is computed from
    (a sigmoid router's scores normalised to sum to 1)."""
    if score_function == "softmax":
        probs_TE = torch.softmax(logits_TE, -1)
    else:
        scores_TE = torch.sigmoid(logits_TE)
        probs_TE = scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)
    map_TE = torch.zeros_like(probs_TE).scatter_(1, probs_TE.topk(top_k, dim=-1).indices, 1.0)
    return probs_TE, map_TE


def switch_aux_loss(
    probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int, total_tokens: Optional[float] = None
) -> torch.Tensor:
    """Switch/GShard load-balancing loss E * sum_e f_e * P_e (1.0 when perfectly balanced).

    f_e: fraction of the assignments routed to e (counts over `total_tokens` * top_k, default this batch's T);
    P_e: mean router probability of e over the same tokens, of which this batch holds T."""
    T, E = probs_TE.shape
    total = T if total_tokens is None else total_tokens
    if total == 0:
        return probs_TE.sum() * 0.0
    f_E = counts_E.to(probs_TE.dtype) / (total * top_k)
    return E * torch.sum(f_E * probs_TE.sum(0) / total)


def sequence_aux_loss(
    probs_BSE: torch.Tensor,
    map_BSE: torch.Tensor,
    top_k: int,
    counts_BE: Optional[torch.Tensor] = None,
    sequence_length: Optional[int] = None,
) -> torch.Tensor:
    """Switch loss computed per sequence and averaged over the B sequences. Context parallelism: this rank holds
    S of each sequence's `sequence_length` tokens, `counts_BE` are each whole sequence's assignments per expert,
    and the loss is this rank's share (the group's add up to the whole sequences')."""
    B, S, E = probs_BSE.shape
    if counts_BE is None:
        f_BE = map_BSE.to(probs_BSE.dtype).sum(1) / (S * top_k)
        return E * torch.sum(f_BE * probs_BSE.mean(1), dim=-1).mean()
    f_BE = counts_BE.to(probs_BSE.dtype) / (sequence_length * top_k)
    return E * torch.sum(f_BE * probs_BSE.sum(1) / sequence_length, dim=-1).mean()


class SequenceShares(SharesProcessGroups):
    """The context-parallel group a router's counts are summed over (None: this rank holds whole sequences)."""

    def __init__(self, group: Optional[Any]):
        self.group = group
        self.size = comm.group_size(group)

    def sum(self, counts: torch.Tensor) -> torch.Tensor:
        """`counts` summed over the group (collective; a copy)."""
        if self.size == 1:
            return counts
        total = counts.to(torch.float64)  # exact for counts
        total = total.clone() if total is counts else total
        comm.all_reduce(total, self.group)
        return total.to(counts.dtype)


class GlobalBalancing(SharesProcessGroups):
    """The global-batch aux loss's counts: each micro-batch's tokens per expert summed over the data-parallel
    ranks (one all-reduce, in forward; under tensor parallelism first over the tp ranks' sequence shards) and
    averaged over the step's micro-batches so far; `reset()` after each optimizer step (the training loop's). Every
    rank must run the same forwards: the all-reduce is collective.
    A recompute in backward uses what its forward counted (counting again would count its tokens twice)."""

    def __init__(self, group: Optional[Any], cp_size: int = 1):
        self.group = group
        self.cp_size = cp_size  # ranks of the group that share each micro-batch (context parallelism)
        # the sequence shards outside `group` (tensor parallelism under SP: the tp group, training/tensor_parallel.py);
        # their counts are summed first, megatron-core's tp-dp-cp counting
        self.shards = SequenceShares(None)
        self.reset()

    def reset(self) -> None:
        self.counts_E: Optional[torch.Tensor] = None
        self.micro_batches = 0
        self._counted: List[Tuple[torch.Tensor, float]] = []  # each forward's (average counts, global tokens)

    def loss(
        self, probs_TE: torch.Tensor, map_TE: torch.Tensor, top_k: int, record: Optional[ExchangeRecord] = None
    ) -> Tuple[torch.Tensor, int]:
        """(the loss of this micro-batch, the data-parallel ranks' count): Megatron's switch loss of this rank's
        probabilities against the averaged global counts, over the global batch's tokens. `record` rides on the
        all-reduce (summed with its square: every rank finds out whether all stated the same)."""
        if in_backward():  # a recompute (activation checkpointing) of a forward that counted already: the
            # backward takes forwards latest first (one micro-batch's, or an interleaved pair's, see phases.py)
            average_E, total_tokens = self._counted.pop()
            return switch_aux_loss(probs_TE, average_E.to(probs_TE.dtype), top_k, total_tokens), self._ranks()
        E = map_TE.shape[1]
        local = torch.cat([map_TE.detach().sum(0), map_TE.new_full((1,), map_TE.shape[0])]).to(torch.float64)
        local = self.shards.sum(local)
        wait = None
        if record is not None:
            stamp = torch.tensor(record.mine, dtype=torch.float64, device=local.device)
            local = torch.cat([local, stamp, stamp * stamp])
            wait = record.prepare(self.group)
        # counts and tokens of every rank (uneven token counts too)
        work = comm.all_reduce(local, self.group, async_op=wait is not None)
        if wait is not None:
            wait(work)
        if record is not None:
            n = len(record.mine)
            record.check_summed(local[E + 1 : E + 1 + n], local[E + 1 + n :], comm.group_size(self.group))
        counts_E, total_tokens = local[:E], float(local[E])
        self.counts_E = counts_E if self.counts_E is None else self.counts_E + counts_E
        self.micro_batches += 1
        average_E = (self.counts_E / self.micro_batches).to(probs_TE.dtype)
        self._counted.append((average_E, total_tokens))
        return switch_aux_loss(probs_TE, average_E, top_k, total_tokens), self._ranks()

    def _ranks(self) -> int:
        """The ranks reading distinct micro-batches (those of a cp group each hold a share of one)."""
        return comm.group_size(self.group) // self.cp_size


def sinkhorn(cost_TE: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of exp(cost) (Megatron's sinkhorn routing): rows and columns scaled until the
    column scales move less than `tol` on average; tokens then pick the top-k of the balanced matrix."""
    kernel = torch.exp(cost_TE)
    row = torch.ones(kernel.shape[0], dtype=kernel.dtype, device=kernel.device)
    col = torch.ones(kernel.shape[1], dtype=kernel.dtype, device=kernel.device)
    change = float("inf")
    while change > tol:
        row = (1 / row.shape[0]) * 1 / (torch.sum(col * kernel, 1) + 1e-8)
        new_col = (1 / col.shape[0]) * 1 / (torch.sum(row.unsqueeze(1) * kernel, 0) + 1e-8)
        change = float(torch.mean(torch.abs(col - new_col)))
        col = new_col
    return col * kernel * row.unsqueeze(1)
