"""gloo's all-gather and reduce-scatter as point-to-point exchanges: each rank sends every peer the one slice
that peer needs, straight from where it lies, and receives each peer's slice straight into its place.

Why: gloo's own collectives move more than the bytes they must, so its all_gather_into_tensor and
all_to_all_single (what the reduce-scatter used) took clearly longer than the same bytes sent by isend/irecv, in
bf16 and fp32; and the parameter all-gather after each step is a visible share of a small model's step
(tools/bench_vs_peers.py; figures: docs/benchmarks.md#peer-exchange). The exchanges of a gloo group's transport
(`GlooTransport`, transport.py).

Matching: gloo pairs a send with the receive of the same (source, destination, tag). Every exchange on a group
takes the group's next tag (its transport's `Tags`), and every rank issues its group's exchanges in the same order
(as it must issue collectives), so two exchanges in flight on one group never take each other's messages. A peer
that never posts its side makes wait() raise at the process group's timeout, as a collective would.
"""

from __future__ import annotations

import datetime
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moezero.parallel.work import whole_waits_only

_TAG_LIMIT = 2**31


class Tags:
    """The tags of one group's point-to-point messages: every exchange takes the next (every rank in the same
    order). Held by the group's transport, so a new group starts at 0 on every rank."""

    def __init__(self):
        self.next = 0

    def take(self) -> int:
        tag, self.next = self.next, (self.next + 1) % _TAG_LIMIT
        return tag


class PeerExchange:
    """The sends and receives of one exchange, in flight. wait() blocks until all completed (a work handle)."""

    def __init__(self, works: List[Any]):
        self.works = works

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        whole_waits_only(timeout, "a point-to-point exchange")
        for work in self.works:
            work.wait()
        self.works = []
        return True


def exchange(
    sends: Sequence[Tuple[int, torch.Tensor]], receives: Sequence[Tuple[int, torch.Tensor]], group: Any, tag: int
) -> PeerExchange:
    """Post every (group rank, contiguous tensor) send and receive of one exchange, with its tag (the group's next)."""
    works = [dist.irecv(t, group=group, group_src=peer, tag=tag) for peer, t in receives if t.numel()]
    works += [dist.isend(t, group=group, group_dst=peer, tag=tag) for peer, t in sends if t.numel()]
    return PeerExchange(works)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Any, tag: int) -> PeerExchange:
    """Rank j's `input` into slice j of the flat, contiguous `output` (input may already be this rank's slice)."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    n = input.numel()
    slices = output.view(-1).split(n)
    if slices[me].data_ptr() != input.data_ptr():
        slices[me].copy_(input.reshape(-1))
    mine = slices[me]
    peers = [p for p in range(size) if p != me]
    return exchange([(p, mine) for p in peers], [(p, slices[p]) for p in peers], group, tag)


def scatter_pieces(input: torch.Tensor, received: torch.Tensor, group: Any, tag: int) -> PeerExchange:
    """Slice j of `input` to rank j; slice me of every peer j into slice j of `received` (its own slot unused)."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    mine, pieces = input.view(size, -1), received.view(size, -1)
    peers = [p for p in range(size) if p != me]
    return exchange([(p, mine[p]) for p in peers], [(p, pieces[p]) for p in peers], group, tag)
