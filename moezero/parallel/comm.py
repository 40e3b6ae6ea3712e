"""Collectives over an explicit group. `group=None` means a world of one: no communication.

(This differs from torch.distributed, where None is the default world group: moezero never
relies on the default group implicitly.)
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from moezero.parallel import local_channel, local_exchange, peer_exchange, small_reduce
from moezero.torch_internals import all_gather_single, reduce_scatter_single


def group_size(group: Optional[Any]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[Any]) -> int:
    return 0 if group is None else dist.get_rank(group)


def launch_all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
                      group: Optional[Any]):
    """all_to_all, launched: an object whose `wait()` gives the rows (a group of one: `x` at once)."""
    if group_size(group) == 1:
        return Ready(x)
    return PendingAllToAll(x, output_splits, input_splits, group)


class Ready:
    """What a launched exchange gives when there was nothing to exchange: `wait()` returns `value` at once."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


def all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
               group: Optional[Any]) -> torch.Tensor:
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
        self.sent = self.grad_sent = self.grad_received = None   # kept alive while their exchange travels
        self.rows = _LaunchAllToAll.apply(x, self)

    def wait(self) -> torch.Tensor:
        rows, self.rows = self.rows, None   # the rows' autograd node holds this object: no cycle through them
        return _WaitAllToAll.apply(rows, self)


@torch.compiler.disable   # as launch_exchange_counts
def _launch(out: torch.Tensor, sent: torch.Tensor, output_splits, input_splits, group):
    """The all-to-all's work: through the group's shared memory when its ranks share this host
    (local_exchange.py), else gloo's (or NCCL's)."""
    exchange = local_exchange.of(group)
    if exchange is not None and sent.device.type == "cpu":
        return exchange.launch(out, sent, output_splits, input_splits, group)
    return dist.all_to_all_single(out, sent, output_split_sizes=output_splits, input_split_sizes=input_splits,
                                  group=group, async_op=True)


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
        pending.grad_work = _launch(pending.grad_received, pending.grad_sent, pending.input_splits,
                                    pending.output_splits, pending.group)
        return grad_rows, None   # its shape autograd expects; the launch's backward returns what arrives


def exchange_counts(send_counts: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """All-to-all of an int64 tensor shaped (group size, n): row j goes to rank j, row i comes from rank i."""
    return launch_exchange_counts(send_counts, group).wait()


@torch.compiler.disable   # a transport's messages and bytes, not graph ops: run as they are, compiled model or not
def launch_exchange_counts(send_counts: torch.Tensor, group: Optional[Any],
                           wait: Optional[Callable[[Any], None]] = None):
    """exchange_counts, launched: an object whose `wait()` gives the received counts. `wait`: how to wait for
    the work (default: its own wait)."""
    if group_size(group) == 1:
        return Ready(send_counts.clone())
    if local_channel.of(group) is not None and send_counts.device.type == "cpu":
        # every rank on this host: each posts its whole table to the group's pipes and keeps its row of each
        # (~0.05 ms, where gloo's all-to-all takes ~0.3 ms and its threads' CPU)
        return _RowsOfCopies(small_reduce.gather_copies(send_counts, group), send_counts, group_rank(group), wait)
    recv = torch.empty_like(send_counts)
    work = dist.all_to_all_single(recv, send_counts.contiguous(), group=group, async_op=True)
    return _Waited(work, recv, wait)


class _Waited:
    def __init__(self, work, value, wait: Optional[Callable[[Any], None]]):
        self.work, self.value, self.how = work, value, wait

    def wait(self):
        if self.how is None:
            self.work.wait()
        else:
            self.how(self.work)
        return self.value


class _RowsOfCopies(_Waited):
    """An all-to-all of one row per rank, as every rank's copy of the whole table: row `me` of each copy."""

    def __init__(self, work, sent: torch.Tensor, me: int, wait: Optional[Callable[[Any], None]]):
        super().__init__(work, None, wait)
        self.shape, self.me = sent.shape, me

    @torch.compiler.disable
    def wait(self):
        super().wait()
        return self.work.copies.view(-1, *self.shape)[:, self.me].clone()


def all_reduce(x: torch.Tensor, group: Optional[Any], op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce; returns the work handle (None when nothing was launched).

    On gloo a short one (flags, norms, records) travels as an all-gather each rank reduces (small_reduce.py).
    NCCL reduces only device tensors: a small CPU tensor (a flag, a metric) is reduced through the
    current CUDA device and copied back (synchronous calls only).
    """
    if group_size(group) == 1:
        return None
    if small_reduce.reduces_small(x, group, op):
        work = small_reduce.GatheredReduce(x, group, op)
        if async_op:
            return work
        work.wait()
        return None
    if x.device.type == "cpu" and not async_op and dist.get_backend(group) == "nccl":
        staged = x.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(staged, op=op, group=group)
        x.copy_(staged)
        return None
    return dist.all_reduce(x, op=op, group=group, async_op=async_op)


def all_true(ok: bool, group: Optional[Any]) -> bool:
    """Collective: whether `ok` holds on every rank of `group` (a MIN all-reduce of one flag)."""
    flag = torch.tensor([1.0 if ok else 0.0])
    all_reduce(flag, group, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def _pieces_transport(group: Any, tensor: torch.Tensor):
    """What moves a gloo group's reduce-scatter pieces and all-gather slices: its shared-memory rings when its
    ranks share this host (local_exchange.py: copies on the ranks' own threads, where gloo's TCP path held the
    caller for milliseconds a bucket), else point-to-point sends (peer_exchange.py). Both give a work handle."""
    exchange = local_exchange.of(group)
    return exchange if exchange is not None and tensor.device.type == "cpu" else peer_exchange


def receives_pieces(group: Optional[Any]) -> bool:
    """Whether reduce_scatter_in_place on `group` receives every peer's piece into an input-sized buffer."""
    return peer_exchange.uses_peer_exchange(group)


def reduce_scatter_in_place(input: torch.Tensor, group: Optional[Any], async_op: bool = False,
                            received: Optional[torch.Tensor] = None, sum_into: Optional[torch.Tensor] = None):
    """Sum `input` (a multiple of the group size long) over the group; returns (work or None, this rank's slice
    of the sum, valid once the work completed). `input` is scratch. The slice is a view of `input` where the
    backend allows, so no output is allocated: a group of one, and gloo (see _SummedPieces), which receives
    into `received` (shaped and typed as `input`, free once the work completed; allocated when None).

    `sum_into` (gloo only, see receives_pieces): a tensor of one slice in a wider dtype that the pieces are summed
    into instead, each widened exactly: the pieces travel in `input`'s dtype, the sum is the wider one's."""
    size = group_size(group)
    if size == 1:
        return None, input
    n = input.numel() // size
    if receives_pieces(group):
        pieces = received if received is not None else torch.empty_like(input)
        work = _SummedPieces(_pieces_transport(group, input).scatter_pieces(input, pieces, group), pieces.view(size, n),
                             input.view(size, n), dist.get_rank(group), sum_into)
        if async_op:
            return work, work.out
        work.wait()
        return None, work.out
    if sum_into is not None:
        raise ValueError("sum_into needs a group whose reduce-scatter sums the received pieces here (gloo)")
    output = torch.empty(n, dtype=input.dtype, device=input.device)
    return reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op), output


class _SummedPieces:
    """gloo's reduce-scatter, as a peer exchange (slice j of every rank's input goes to rank j) and a local sum
    of the pieces, in rank order, into this rank's slice of the input (or into `out`). gloo's own reduce-scatter
    clones its input and its ring all-reduce moves twice the bytes (2 ranks, 1.3M fp32: reduce-scatter 6.9-8.2
    ms, all-reduce 6.3-7.6; peer_exchange.py has the exchange's own figures)."""

    def __init__(self, work, pieces_PN: torch.Tensor, input_PN: torch.Tensor, me: int,
                 out: Optional[torch.Tensor] = None):
        self.work, self.pieces, self.me = work, pieces_PN, me
        self.mine = input_PN[me]
        self.out = self.mine if out is None else out

    def is_completed(self) -> bool:
        return self.pieces is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.pieces is not None:
            self.work.wait()
            terms = list(self.pieces)
            terms[self.me] = self.mine
            if self.out is not self.mine:
                self.out.copy_(terms[0])   # widened exactly; each add below rounds once in out's dtype
                for term in terms[1:]:
                    add_widened_(self.out, term)
            else:
                if self.me >= 2:   # the sum below overwrites `mine` before reaching its term
                    terms[self.me] = self.pieces[self.me].copy_(self.mine)
                torch.add(terms[0], terms[1], out=self.mine)   # the first add reads `mine` before writing it
                for term in terms[2:]:
                    self.mine.add_(term)
            self.pieces = None   # summed once; frees the receive buffer
        return True


# elements widened per add_widened_ chunk: 1 MB of fp32, reused from the allocator's cache
_WIDEN_CHUNK = 2 ** 18


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
        part = out[start:start + _WIDEN_CHUNK]
        wide = scratch[:part.numel()]
        wide.copy_(term[start:start + part.numel()])
        part.add_(wide)


def broadcast(tensor: torch.Tensor, source: int, group: Optional[Any]) -> None:
    """Rank `source`'s tensor (a global rank in `group`) on every rank of the group, in place."""
    if group_size(group) > 1:
        dist.broadcast(tensor, src=source, group=group)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Optional[Any], async_op: bool = False):
    """Concatenate every rank's `input` into `output` (input may be a view of output's own slice)."""
    if group_size(group) == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    if peer_exchange.uses_peer_exchange(group) and output.is_contiguous():
        work = _pieces_transport(group, output).all_gather(output, input, group)
        if async_op:
            return work
        work.wait()
        return None
    return all_gather_single(output, input, group=group, async_op=async_op)
