"""Collectives over an explicit group. `group=None` means a world of one: no communication.

(This differs from torch.distributed, where None is the default world group: moezero never
relies on the default group implicitly.)

What each collective does is said here; how its bytes travel is the group's transport's business (transport.py,
chosen once per group), so callers never learn which transport serves a group. Every launched collective gives a
`Work` (work.py).
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from moezero.parallel import small_reduce
from moezero.parallel.transport import launched, transport_of
from moezero.parallel.work import Ready, Work, whole_waits_only


def group_size(group: Optional[Any]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[Any]) -> int:
    return 0 if group is None else dist.get_rank(group)


def launch_all_to_all(
    x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: Optional[Any]
) -> Work:
    """all_to_all, launched: a work whose `wait()` gives the rows (a group of one: `x` at once)."""
    if group_size(group) == 1:
        return Ready(x)
    return PendingAllToAll(x, output_splits, input_splits, group)


def all_to_all(
    x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: Optional[Any]
) -> torch.Tensor:
    """Send rows x[sum(input_splits[:j]) : ...] to rank j of `group`; autograd-aware.

    `input_splits[j]` rows go to rank j; `output_splits[j]` rows arrive from rank j.
    """
    return launch_all_to_all(x, output_splits, input_splits, group).wait()


class PendingAllToAll:
    """An autograd-aware all-to-all launched now and waited for later (`wait()` gives the rows).

    Its backward is split the same way: the reverse all-to-all is launched where autograd reaches the wait and
    waited where it reaches the launch, so whatever the forward ran between the two (another micro-batch's
    phase, see moezero.phases) runs, in reverse, while the gradient travels."""

    def __init__(self, x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: Any):
        self.output_splits, self.input_splits, self.group = list(output_splits), list(input_splits), group
        self.work = self.grad_work = None
        self.sent = self.grad_sent = self.grad_received = None  # kept alive while their exchange travels
        self.rows = _LaunchAllToAll.apply(x, self)

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> torch.Tensor:
        whole_waits_only(timeout, "an all-to-all inside autograd")
        rows, self.rows = self.rows, None  # the rows' autograd node holds this object: no cycle through them
        return _WaitAllToAll.apply(rows, self)


@torch.compiler.disable  # as launch_exchange_counts
def _launch(out: torch.Tensor, sent: torch.Tensor, output_splits, input_splits, group) -> Work:
    """The all-to-all's work, as the group's transport carries it."""
    return transport_of(group).all_to_all(out, sent, output_splits, input_splits)


class _LaunchAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending):
        ctx.pending = pending
        pending.sent = x.contiguous()
        out = x.new_empty((sum(pending.output_splits),) + tuple(x.shape[1:]))
        pending.work = _launch(out, pending.sent, pending.output_splits, pending.input_splits, pending.group)
        return out

    @staticmethod
    def backward(ctx, _grad_rows):
        pending = ctx.pending
        pending.grad_work.wait()
        grad_in, pending.grad_received, pending.grad_sent = pending.grad_received, None, None
        pending.grad_work = None
        return grad_in, None


class _WaitAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, pending):
        ctx.pending = pending
        pending.work.wait()
        # a waited work still holds its tensors, the rows among them, whose autograd node holds `pending`: a
        # cycle through C++ that Python's collector cannot see, so every step's exchanges would stay alive
        pending.work = pending.sent = None
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad_rows):
        pending = ctx.pending
        pending.grad_sent = grad_rows.contiguous()
        pending.grad_received = grad_rows.new_empty((sum(pending.input_splits),) + tuple(grad_rows.shape[1:]))
        pending.grad_work = _launch(
            pending.grad_received, pending.grad_sent, pending.input_splits, pending.output_splits, pending.group
        )
        return grad_rows, None  # its shape autograd expects; the launch's backward returns what arrives


def exchange_counts(send_counts: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """All-to-all of an int64 tensor shaped (group size, n): row j goes to rank j, row i comes from rank i."""
    return launch_exchange_counts(send_counts, group).wait()


@torch.compiler.disable  # a transport's messages and bytes, not graph ops: run as they are, compiled model or not
def launch_exchange_counts(
    send_counts: torch.Tensor, group: Optional[Any], wait: Optional[Callable[[Any], None]] = None
) -> Work:
    """exchange_counts, launched: a work whose `wait()` gives the received counts. `wait`: how to wait for
    the underlying work (default: its own wait)."""
    if group_size(group) == 1:
        return Ready(send_counts.clone())
    return transport_of(group).exchange_counts(send_counts, wait)


def all_reduce(x: torch.Tensor, group: Optional[Any], op=dist.ReduceOp.SUM, async_op: bool = False) -> Optional[Work]:
    """In-place all-reduce; returns the work (None when nothing was launched or the call was synchronous).

    A short one (flags, norms, records) travels as every rank's copy, each rank reducing them (small_reduce.py),
    where the group's transport says that is the cheaper way; the rest as the transport's all-reduce.
    """
    if group_size(group) == 1:
        return None
    if small_reduce.reduces_small(x, group, op):
        return launched(small_reduce.GatheredReduce(x, group, op), async_op)
    return transport_of(group).all_reduce(x, op, async_op)


def all_true(ok: bool, group: Optional[Any]) -> bool:
    """Collective: whether `ok` holds on every rank of `group` (a MIN all-reduce of one flag)."""
    flag = torch.tensor([1.0 if ok else 0.0])
    all_reduce(flag, group, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def receives_pieces(group: Optional[Any]) -> bool:
    """Whether reduce_scatter_in_place on `group` receives every peer's piece into an input-sized buffer (its
    transport's answer: gloo's, not NCCL's)."""
    return group_size(group) > 1 and transport_of(group).receives_pieces


def reduce_scatter_in_place(
    input: torch.Tensor,
    group: Optional[Any],
    async_op: bool = False,
    received: Optional[torch.Tensor] = None,
    sum_into: Optional[torch.Tensor] = None,
):
    """Sum `input` (a multiple of the group size long) over the group; returns (work or None, this rank's slice
    of the sum, valid once the work completed). `input` is scratch. The slice is a view of `input` where the
    transport allows, so no output is allocated: a group of one, and gloo's (see _SummedPieces), which receive
    into `received` (shaped and typed as `input`, free once the work completed; allocated when None).

    `sum_into` (see receives_pieces): a tensor of one slice in a wider dtype that the pieces are summed
    into instead, each widened exactly: the pieces travel in `input`'s dtype, the sum is the wider one's."""
    size = group_size(group)
    if size == 1:
        return None, input
    n = input.numel() // size
    transport = transport_of(group)
    if transport.receives_pieces:
        pieces = received if received is not None else torch.empty_like(input)
        work = _SummedPieces(
            transport.scatter_pieces(input, pieces), pieces.view(size, n), input.view(size, n), transport.rank, sum_into
        )
        return launched(work, async_op), work.out
    if sum_into is not None:
        raise ValueError("sum_into needs a group whose reduce-scatter sums the received pieces here (gloo)")
    output = torch.empty(n, dtype=input.dtype, device=input.device)
    return transport.reduce_scatter(output, input, async_op), output


class _SummedPieces:
    """A reduce-scatter as an exchange of pieces (slice j of every rank's input goes to rank j) and a local sum
    of the pieces, in rank order, into this rank's slice of the input (or into `out`). Why on gloo: its own
    reduce-scatter clones its input, and its ring all-reduce moves twice the bytes (docs/benchmarks.md#peer-exchange
    has the figures)."""

    def __init__(
        self, work, pieces_PN: torch.Tensor, input_PN: torch.Tensor, me: int, out: Optional[torch.Tensor] = None
    ):
        self.work, self.pieces, self.me = work, pieces_PN, me
        self.mine = input_PN[me]
        self.out = self.mine if out is None else out

    def is_completed(self) -> bool:
        return self.pieces is None or self.work.is_completed()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if self.pieces is not None:
            self.work.wait(timeout)
            terms = list(self.pieces)
            terms[self.me] = self.mine
            if self.out is not self.mine:
                self.out.copy_(terms[0])  # widened exactly; each add below rounds once in out's dtype
                for term in terms[1:]:
                    add_widened_(self.out, term)
            else:
                if self.me >= 2:  # the sum below overwrites `mine` before reaching its term
                    terms[self.me] = self.pieces[self.me].copy_(self.mine)
                torch.add(terms[0], terms[1], out=self.mine)  # the first add reads `mine` before writing it
                for term in terms[2:]:
                    self.mine.add_(term)
            self.pieces = None  # summed once; frees the receive buffer
        return True


# elements widened per add_widened_ chunk: 1 MB of fp32, reused from the allocator's cache
_WIDEN_CHUNK = 2**18


def add_widened_(out: torch.Tensor, term: torch.Tensor) -> None:
    """out += term for a narrower `term` (bf16 into fp32), each element widened exactly first, as out.add_(term)
    computes. out.add_(term) widens all of `term` into a new tensor first: for a gradient slice of a bf16 run that
    fresh allocation faulted its pages in and took most of the add's time; a chunk reused from the allocator's
    cache does not."""
    if term.dtype == out.dtype or term.numel() <= _WIDEN_CHUNK:
        out.add_(term)
        return
    out, term = out.view(-1), term.reshape(-1)
    scratch = torch.empty(_WIDEN_CHUNK, dtype=out.dtype, device=out.device)
    for start in range(0, out.numel(), _WIDEN_CHUNK):
        part = out[start : start + _WIDEN_CHUNK]
        wide = scratch[: part.numel()]
        wide.copy_(term[start : start + part.numel()])
        part.add_(wide)


def broadcast(tensor: torch.Tensor, source: int, group: Optional[Any]) -> None:
    """Rank `source`'s tensor (a global rank in `group`) on every rank of the group, in place."""
    if group_size(group) > 1:
        transport_of(group).broadcast(tensor, source)


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group: Optional[Any], async_op: bool = False
) -> Optional[Work]:
    """Concatenate every rank's `input` into `output` (input may be a view of output's own slice)."""
    if group_size(group) == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    return transport_of(group).all_gather(output, input, async_op)
