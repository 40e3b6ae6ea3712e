"""How a group's collectives travel: one transport per process group, chosen once.

comm.py's functions say what a collective does (an all-to-all inside autograd, a reduce-scatter summed in rank
order, a short all-reduce reduced here: small_reduce.py); the group's transport moves the bytes. Callers (zero/,
moe/, training) call comm.py and never learn which transport serves a group. Every launched collective gives a
`Work` (work.py), whatever carries it.

The transports:
- `Transport`: torch.distributed's own collectives, as the group's backend runs them (the base of the others, and
  the default for a backend without one of its own). Serving every group of a gloo run in place of the
  transports below, ZeRO still reproduces single-process training (tests/distributed/test_zero_exactness.py):
  they exist for their speed, not their results.
- `NcclTransport`: NCCL's, where a small CPU tensor (a flag, a metric) is reduced through the current device.
- `GlooTransport`: a gloo group's default. The reduce-scatter's pieces and the all-gather's slices travel as
  point-to-point exchanges (peer_exchange.py), summed here in rank order (comm.py); a short all-reduce of at
  least 2 elements per rank as an all-gather of every rank's copy, reduced here (small_reduce.py).
- `LocalTransport` (local_transport.py): a gloo group whose ranks all run on this host, as groups.py builds it:
  short messages through pipes (local_channel.py), exchanges through shared-memory rings (local_exchange.py).

Which transport serves a group is decided once: groups.py serves the groups it builds (`serve`) as it makes them;
a group that no ParallelGroups built (a test's own, a tool's) gets its backend's default on first use, kept for
the group's life (`transport_of`). Nothing consults anything else per call. A new kind of exchange (pipeline
sends, tensor-parallel reductions) is a method here, overridden where a transport carries it its own way.
"""

from __future__ import annotations

import datetime
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from moezero.parallel import peer_exchange
from moezero.parallel.work import Work, wait_for
from moezero.torch_internals import all_gather_single, reduce_scatter_single

# group -> the transport serving it (weak: a destroyed group's transport goes with it, and a new group, even at a
# freed one's address, starts afresh on every rank)
_served: "weakref.WeakKeyDictionary[Any, Transport]" = weakref.WeakKeyDictionary()


class Transport:
    """torch.distributed's own collectives on `group` (a group of more than one rank: comm.py handles a group of
    one). Each method launches one collective and gives its `Work` (or, where the caller asks for a synchronous
    one, None once done)."""

    # whether a reduce-scatter receives every peer's piece (scatter_pieces) for comm.py to sum, rather than
    # running the backend's own (reduce_scatter)
    receives_pieces = False

    def __init__(self, group: Any):
        # weak: `_served` keys on the group, and a value that held it would keep every group (and its connections)
        # alive until released by hand
        self._group = weakref.ref(group)
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    @property
    def group(self) -> Any:
        return self._group()

    def close(self) -> None:
        """Release what the transport holds beside the group (pipes, shared memory); torch's collectives hold
        nothing."""

    def all_to_all(
        self, out: torch.Tensor, sent: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int]
    ) -> Work:
        """Rows sent[sum(input_splits[:j]) ...] to rank j, rows from rank i into `out` (contiguous), launched."""
        return dist.all_to_all_single(
            out,
            sent,
            output_split_sizes=list(output_splits),
            input_split_sizes=list(input_splits),
            group=self.group,
            async_op=True,
        )

    def exchange_counts(self, send_counts: torch.Tensor, wait: Optional[Callable[[Any], None]] = None) -> Work:
        """Row j of the int64 table `send_counts` to rank j, launched: a work whose wait gives the rows received
        (row i from rank i). `wait`: how to wait for the underlying work (default: its own wait)."""
        received = torch.empty_like(send_counts)
        work = dist.all_to_all_single(received, send_counts.contiguous(), group=self.group, async_op=True)
        return Waited(work, received, wait)

    def gather_copies(self, x: torch.Tensor) -> Work:
        """Every rank's copy of the short CPU tensor `x`, launched: a work whose `copies`, once waited for, holds
        them flat in rank order."""
        return AllGatheredCopies(x, self.group)

    def reduces_by_copies(self, numel: int) -> bool:
        """Whether a short all-reduce of `numel` elements travels as every rank's copy, reduced here
        (small_reduce.py), rather than as the backend's all-reduce."""
        return False

    def all_reduce(self, x: torch.Tensor, op: Any, async_op: bool) -> Optional[Work]:
        return dist.all_reduce(x, op=op, group=self.group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Optional[Work]:
        """The backend's own: this rank's slice of the sum of every rank's `input` into `output`."""
        return reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def scatter_pieces(self, input: torch.Tensor, received: torch.Tensor) -> Work:
        """Slice j of `input` to rank j; slice `rank` of every peer j into slice j of `received` (only where
        `receives_pieces`)."""
        raise NotImplementedError(f"{type(self).__name__} runs the backend's own reduce-scatter")

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Optional[Work]:
        """Every rank's `input` into its slice of `output` (input may be a view of output's own slice)."""
        return all_gather_single(output, input, group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, source: int) -> None:
        """Rank `source`'s tensor (a global rank) on every rank of the group, in place."""
        dist.broadcast(tensor, src=source, group=self.group)


class NcclTransport(Transport):
    """NCCL's collectives. NCCL reduces only device tensors: a small CPU tensor (a flag, a metric) is reduced
    through the current CUDA device and copied back (synchronous calls only)."""

    def all_reduce(self, x: torch.Tensor, op: Any, async_op: bool) -> Optional[Work]:
        if x.device.type == "cpu" and not async_op:
            staged = x.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(staged, op=op, group=self.group)
            x.copy_(staged)
            return None
        return super().all_reduce(x, op, async_op)


class GlooTransport(Transport):
    """gloo's collectives, but the reduce-scatter's pieces and the all-gather's slices as point-to-point exchanges
    (peer_exchange.py: gloo's own move more than the bytes they must), and a short all-reduce of at least 2
    elements per rank as an all-gather of every rank's copy (small_reduce.py: gloo's ring takes twice the rounds;
    below 2 elements per rank gloo's own reduces in one step and is the faster)."""

    receives_pieces = True

    def __init__(self, group: Any):
        super().__init__(group)
        self.tags = peer_exchange.Tags()  # every exchange on the group takes the next (every rank in order)

    def reduces_by_copies(self, numel: int) -> bool:
        return numel >= 2 * self.size

    def scatter_pieces(self, input: torch.Tensor, received: torch.Tensor) -> Work:
        return peer_exchange.scatter_pieces(input, received, self.group, self.tags.take())

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Optional[Work]:
        if not output.is_contiguous():
            return super().all_gather(output, input, async_op)
        return launched(self.gathered_slices(output, input), async_op)

    def gathered_slices(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """all_gather of a contiguous `output`, launched as slices sent to every peer."""
        return peer_exchange.all_gather(output, input, self.group, self.tags.take())


def launched(work: Work, async_op: bool) -> Optional[Work]:
    """`work` for an asynchronous call; for a synchronous one, None once it completed."""
    if async_op:
        return work
    work.wait()
    return None


def transport_of(group: Any) -> Transport:
    """The transport serving `group` (a group of more than one rank): the one groups.py served it, or its
    backend's default, made on first use and kept."""
    transport = _served.get(group)
    if transport is None:
        transport = _served[group] = default_transport(group)
    return transport


def default_transport(group: Any) -> Transport:
    """What serves a group nobody chose a transport for: by its backend."""
    backend = dist.get_backend(group)
    if backend == "gloo":
        return GlooTransport(group)
    if backend == "nccl":
        return NcclTransport(group)
    return Transport(group)


def serve(group: Any, transport: Transport) -> Optional[Transport]:
    """From now on `transport` carries `group`'s collectives (collective in effect: every rank of the group serves
    it the same kind, before any collective on it or between two that every rank completed). Gives the transport
    it replaces, left open (its parts may serve the new one): the caller closes what is left of it."""
    replaced = _served.get(group)
    _served[group] = transport
    return replaced


def release(group: Any) -> None:
    """Close the transport serving `group`, if any (the group is being destroyed)."""
    transport = _served.pop(group, None)
    if transport is not None:
        transport.close()


class Waited:
    """A launched collective whose wait gives `value` (received into by the collective)."""

    def __init__(self, work: Any, value: Any, wait: Optional[Callable[[Any], None]] = None):
        self.work, self.value, self.how = work, value, wait

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> Any:
        """`timeout`: as torch's wait (a later wait resumes); without one, the work is waited as `wait` says."""
        if self.how is None or timeout is not None:
            wait_for(self.work, timeout)
        else:
            self.how(self.work)
        return self.value


class AllGatheredCopies:
    """Every rank's copy of a short CPU tensor as the backend's all-gather: once waited for, `copies` holds them
    flat in rank order. The backend's all-gather, not the point-to-point exchange of peer_exchange.py: a gloo
    receive reports completion only once waited for, and a wait given a timeout ends it, while waits watched in
    slices (`agreement.watched_wait`) and records checked as they arrive need both."""

    def __init__(self, x: torch.Tensor, group: Any):
        self.copies = torch.empty(dist.get_world_size(group) * x.numel(), dtype=x.dtype)
        self.work = all_gather_single(self.copies, x.reshape(-1), group=group, async_op=True)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        wait_for(self.work, timeout)
        return True
