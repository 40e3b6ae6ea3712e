"""Expert-parallel token dispatcher: permute -> all-to-all -> (experts) -> all-to-all -> combine.

Under expert tensor parallelism (an `etp` group, megatron-core's MoEAlltoAllTokenDispatcher with its tp group) the
rows the all-to-all brought are all-gathered over etp (counts exchanged first: each rank brings its own number),
every etp rank runs all of them through its slice of the experts' ffn, and the partial outputs are reduce-scattered
back over etp (each rank its own rows, summed) before the reverse all-to-all.

Shapes: T local tokens, K top-k, D hidden, N = kept assignments of this rank (sorted by global
expert), M = rows this rank's local experts receive (sorted by local expert, then etp rank, then source rank),
P = ep size, R = etp size, L = local experts per rank (E = P * L).

`dispatch()` returns a frozen `DispatchMeta` that `combine()` consumes: nothing is stored on
`self` between the two, so recompute and several micro-batches in flight are safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from einops import rearrange

from moezero import ops, phases
from moezero.parallel import comm
from moezero.parallel.agreement import ExchangeRecord
from moezero.parallel.groups import SharesProcessGroups


@dataclass(frozen=True)
class DispatchMeta:
    row_map_TK: torch.Tensor  # permuted row of each (t, k) assignment, -1 if dropped
    weights_TK: torch.Tensor  # combine weights (fp32, in the autograd graph)
    send_splits: List[int]  # rows sent to each ep rank
    recv_splits: List[int]  # rows received from each ep rank
    unsort_index_M: Optional[torch.Tensor]  # (local expert, source) order -> (source, local expert) order
    etp_splits: Optional[List[int]] = None  # rows each etp rank brought to the experts (None: no etp)


class TokenDispatcher(SharesProcessGroups):
    """Moves tokens to the ranks holding their experts and back, over the `ep` group."""

    def __init__(self, num_experts: int, ep_group: Optional[Any], etp_group: Optional[Any] = None):
        self.num_experts = num_experts
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep_size, self.etp_size = comm.group_size(ep_group), comm.group_size(etp_group)
        self.num_local_experts = num_experts // self.ep_size

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        record: Optional[ExchangeRecord] = None,
    ) -> Tuple[torch.Tensor, List[int], DispatchMeta]:
        """Returns (rows for the local experts x_MD, rows per local expert, metadata for combine). `record`
        rides on the count exchange: every rank checks what every other sent."""
        return phases.run(self.dispatch_steps(x_TD, topk_ids_TK, weights_TK, record)).receive()

    def combine(self, y_MD: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """Expert outputs back in token order, summed over the top-k with their weights."""
        return phases.run(self.combine_steps(y_MD, meta))

    def dispatch_steps(
        self,
        x_TD: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        record: Optional[ExchangeRecord] = None,
    ) -> phases.Steps:
        """dispatch() in phases (moezero.phases): yields after launching the count exchange; returns, having
        launched the rows' all-to-all, what `receive()`s them (the caller yields in between)."""
        x_ND, counts_E, row_map_TK = ops.permute_tokens(x_TD, topk_ids_TK, self.num_experts)
        if self.ep_size == 1:
            splits = [x_ND.shape[0]]
            if self.etp_size == 1:
                meta = DispatchMeta(row_map_TK, weights_TK, splits, splits, None)
                return _Rows(comm.Ready(x_ND), None, counts_E.tolist(), meta)
            return self._rows_over_etp(
                comm.Ready(x_ND), counts_E.view(1, -1), row_map_TK, weights_TK, splits, splits, record
            )
        P, L = self.ep_size, self.num_local_experts
        send_PL = counts_E.view(P, L)
        if record is None:
            pending = comm.launch_exchange_counts(send_PL, self.ep_group)  # row i: what rank i sends my experts
            yield
            recv_PL = pending.wait()
        else:
            stamped = torch.tensor(record.mine, dtype=send_PL.dtype, device=send_PL.device).expand(P, -1)
            pending = comm.launch_exchange_counts(
                torch.cat([send_PL, stamped], 1), self.ep_group, record.prepare(self.ep_group)
            )
            yield
            received = pending.wait()
            record.check_received(received[:, L:])
            recv_PL = received[:, :L].contiguous()
        send_splits = send_PL.sum(1).tolist()
        recv_splits = recv_PL.sum(1).tolist()
        rows = comm.launch_all_to_all(x_ND, recv_splits, send_splits, self.ep_group)
        if self.etp_size > 1:
            return self._rows_over_etp(rows, recv_PL, row_map_TK, weights_TK, send_splits, recv_splits, record)
        sort_index, unsort_index = _chunk_transpose_indices(recv_PL)
        meta = DispatchMeta(row_map_TK, weights_TK, send_splits, recv_splits, unsort_index)
        return _Rows(rows, sort_index, recv_PL.sum(0).tolist(), meta)

    def _rows_over_etp(
        self, rows: Any, recv_PL: torch.Tensor, row_map_TK, weights_TK, send_splits, recv_splits, record
    ) -> "_Rows":
        """The rows of every etp rank (launched or here: `rows`, laid out (source, local expert) with counts
        `recv_PL`), to be gathered at `receive()`: the counts are gathered now, so their (etp rank, source) chunks
        can be sorted by local expert."""
        R = self.etp_size
        counts_RPL = self._etp_counts(recv_PL, record).view(R * recv_PL.shape[0], recv_PL.shape[1])
        etp_splits = counts_RPL.view(R, -1).sum(1).tolist()
        sort_index, unsort_index = _chunk_transpose_indices(counts_RPL)
        meta = DispatchMeta(row_map_TK, weights_TK, send_splits, recv_splits, unsort_index, etp_splits)
        return _Rows(rows, sort_index, counts_RPL.sum(0).tolist(), meta, self.etp_group)

    def _etp_counts(self, counts_PL: torch.Tensor, record: Optional[ExchangeRecord]) -> torch.Tensor:
        """Every etp rank's `counts_PL`, a row each: an exchange of counts sending each rank the same row, with
        `record` riding on it as on the ep exchange."""
        mine = counts_PL.reshape(1, -1)
        if record is not None:
            stamped = torch.tensor(record.mine, dtype=mine.dtype, device=mine.device).view(1, -1)
            mine = torch.cat([mine, stamped], 1)
        wait = None if record is None else record.prepare(self.etp_group)
        received = comm.launch_exchange_counts(mine.expand(self.etp_size, -1).contiguous(), self.etp_group, wait)
        received = received.wait()
        if record is None:
            return received
        record.check_received(received[:, counts_PL.numel() :])
        return received[:, : counts_PL.numel()].contiguous()  # its rows are viewed as (etp rank x source) rows

    def combine_steps(self, y_MD: torch.Tensor, meta: DispatchMeta) -> phases.Steps:
        """combine() in phases: yields after launching the rows' all-to-all back."""
        if meta.unsort_index_M is not None:
            y_MD = y_MD.index_select(0, meta.unsort_index_M)
        if meta.etp_splits is not None:
            y_MD = _reduce_scatter_rows(y_MD, meta.etp_splits, self.etp_group)
        if self.ep_size > 1:
            rows = comm.launch_all_to_all(y_MD, meta.send_splits, meta.recv_splits, self.ep_group)
            yield
            y_MD = rows.wait()
        out = ops.unpermute_combine(y_MD, meta.row_map_TK, meta.weights_TK)
        if out.requires_grad and not torch.compiler.is_compiling():
            out.register_hook(_refuse_double_backward)
        return out


DOUBLE_BACKWARD_REFUSED = (
    "a backward with create_graph=True (torch.autograd.grad(..., create_graph=True): a gradient penalty, a double "
    "backward) reached an MoE layer, whose token permute/combine kernels are differentiable once: their backward "
    "builds no graph, so a second backward cannot go through them. Differentiate with create_graph=True only with "
    "respect to tensors its backward reaches before any MoE layer (the layers after the last one)"
)


def _refuse_double_backward(grad: torch.Tensor) -> None:
    if torch.is_grad_enabled():  # inside a backward: it records a graph (create_graph=True)
        raise RuntimeError(DOUBLE_BACKWARD_REFUSED)


@dataclass(frozen=True)
class _Rows:
    """The rows' all-to-all to the experts, launched: `receive()` waits and gives (x_MD, rows per local expert,
    metadata for combine)."""

    rows: Any
    sort_index_M: Optional[torch.Tensor]  # (source, local expert) order -> (local expert, source) order
    counts: List[int]
    meta: DispatchMeta
    etp_group: Optional[Any] = None  # the rows are gathered over it first (meta.etp_splits: each rank's)

    def receive(self) -> Tuple[torch.Tensor, List[int], DispatchMeta]:
        x_MD = self.rows.wait()
        if self.meta.etp_splits is not None:
            x_MD = _gather_rows(x_MD, self.meta.etp_splits, self.etp_group)
        if self.sort_index_M is not None:
            x_MD = x_MD.index_select(0, self.sort_index_M)
        return x_MD, self.counts, self.meta


def _chunk_transpose_indices(counts_PL: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row indices that reorder chunks laid out (source p, expert l) into (expert l, source p), and back."""
    P, L = counts_PL.shape
    device = counts_PL.device
    counts = counts_PL.reshape(-1)
    starts = torch.cumsum(counts, 0) - counts  # start of chunk (p, l) in the received buffer
    order = rearrange(torch.arange(P * L, device=device), "(P L) -> (L P)", P=P)  # chunk ids in (l, p) order
    counts_out = counts[order]
    starts_out = torch.cumsum(counts_out, 0) - counts_out  # start of the same chunk after the reorder
    shift = torch.repeat_interleave(starts[order] - starts_out, counts_out)
    sort_index = shift + torch.arange(shift.numel(), device=device)
    unsort_index = torch.empty_like(sort_index)
    unsort_index[sort_index] = torch.arange(sort_index.numel(), device=device)
    return sort_index, unsort_index


def _gather_rows(x_MD: torch.Tensor, splits: List[int], group: Any) -> torch.Tensor:
    """Every rank's rows (splits[r] of them from rank r), in rank order; autograd: the gradient's rows summed over
    the group back to their rank. An all-to-all sending every rank the same rows: gloo has no all-gather of uneven
    sizes, and the all-to-all's autograd and transport are comm's."""
    R = len(splits)
    return comm.all_to_all(x_MD.repeat(R, 1), splits, [x_MD.shape[0]] * R, group)


def _reduce_scatter_rows(y_MD: torch.Tensor, splits: List[int], group: Any) -> torch.Tensor:
    """This rank's rows (its block of splits) of the sum over the group of every rank's partial `y_MD`, summed in
    rank order (in fp32 at least, as megatron-core's reduce-scatter of the experts' output); autograd: the
    gradient gathered to every rank."""
    R, mine = len(splits), splits[comm.group_rank(group)]
    pieces = comm.all_to_all(y_MD, [mine] * R, splits, group).view(R, mine, *y_MD.shape[1:])
    return pieces.to(torch.promote_types(pieces.dtype, torch.float32)).sum(0).to(y_MD.dtype)
