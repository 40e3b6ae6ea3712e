"""The exchanges between the ranks of a group that all run on one host: the bytes through shared memory, a notice
through pipes (local_channel.py); part of the group's `LocalTransport` (local_transport.py). The ep group's token
all-to-alls (notices on the group's channel), and the dp and edp groups' ZeRO bucket reduce-scatters and
all-gathers (their own rings, sized for bucket slices, and a channel of their own: their notices never pair with
the group's short all-reduces).

Why: gloo moves an all-to-all through the TCP stack and wakes its own threads on both ranks, a latency and a CPU
cost per exchange whatever its size, taken from the cores the model's work holds; an MoE step has four per MoE
layer and micro-batch. Here the sender copies each peer's rows into a ring of shared memory it writes to that
peer and posts one notice per peer (where the rows lie); the receiver, when it waits, copies them out and frees
the space. Nothing runs in between, so the exchange costs two copies on the ranks' own threads and no wake-up
(tools/bench_small_reduce.py, docs/benchmarks.md#small-reduce). For a bucket's slices (MBs) gloo's TCP path is
worse: posting a receive itself held the caller for a visible share of a bf16 step (torch.profiler's
c10d::recv_; docs/benchmarks.md#distribution).

Every rank posts one notice per exchange to every peer (also where it sends nothing), so notices pair by index as
the exchanges pair by order. A message larger than a share of a ring (RingSizes) goes as a gloo send and receive instead
(both ends know its size, so both decide alike), as does one that finds its ring full (its receive posted when the
notice is read). Only notices go through the pipes: a post never waits for a peer to read.
A peer that exits closes its pipes, and a wait for its notice raises at once; one that never posts raises at the
group's timeout (local_channel.py).

Rings are built with a channel of the group (`connect`, collective) in /dev/shm where it exists, their space
reserved up front (a full /dev/shm makes `connect` give None, never a SIGBUS later), their names removed once
every rank mapped them; on x86 hosts only (see _ORDERED_STORES).
"""

from __future__ import annotations

import datetime
import mmap
import os
import platform
import struct
import tempfile
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moezero.parallel import local_channel
from moezero.parallel.work import whole_waits_only


@dataclass(frozen=True)
class RingSizes:
    """How large a group's rings are, and which messages take them."""

    rank_bytes: int  # a rank's rings from all its peers together (shared memory: the host's RAM) ...
    bounds: Tuple[int, int]  # ... each ring within these
    largest_share: int  # a message over capacity / largest_share goes by gloo

    def ring_bytes(self, size: int) -> int:
        """Each ring's capacity in a group of `size` ranks."""
        low, high = self.bounds
        return max(low, min(high, self.rank_bytes // max(1, size - 1)))


# the token all-to-alls: many messages of every size in flight (two micro-batches' layers)
TOKENS = RingSizes(32 << 20, (256 << 10, 8 << 20), 8)
# ZeRO's bucket reduce-scatters and all-gathers: a few slices of a bucket each (2M fp32 over 2 ranks: 4 MB)
BUCKETS = RingSizes(32 << 20, (1 << 20, 16 << 20), 2)

_HEADER_BYTES = 64  # the ring's shared word (how far the receiver freed), on its own cache line
_NOTICE = struct.Struct("<qqq")  # start, end (positions in the ring's running count; start -1: no ring), bytes
_BY_GLOO, _LATE_GLOO = -1, -2  # a notice's start when the message does not lie in the ring
# The receiver frees a span by a plain store after its copy out, which the sender reads without a syscall between:
# safe where a store is never seen before earlier loads (x86's total store order); elsewhere gloo.
_ORDERED_STORES = ("x86_64", "amd64")


class _Ring:
    """One sender's bytes to one receiver in a shared file both map. Positions count every byte the sender ever
    placed (a message's data lies at position % capacity, never split by the wrap); the receiver frees a
    message's span once it copied it out, and the shared word says up to where every span was freed."""

    def __init__(self, mapped: mmap.mmap, capacity: int):
        self.mapped, self.capacity = mapped, capacity
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
        self.freed_word = whole[:8].view(torch.int64)
        self.data = whole[_HEADER_BYTES:]
        self.head = 0  # sender: the running count after its last message
        self.skips: Dict[int, int] = {}  # sender: span start -> the bytes it skipped to the ring's start
        self.freed_spans: Dict[int, int] = {}  # receiver: start -> end of spans copied out, not yet contiguous

    def place(self, source: torch.Tensor) -> Optional[tuple]:
        """Sender: copy `source` (bytes) in; (start, end) of its span, or None when the ring has no room."""
        n, freed = source.numel(), int(self.freed_word.item())
        at = self.head % self.capacity
        # to the ring's start: a message never wraps, and an empty ring starts over (the same pages stay in use)
        skip = self.capacity - at if at and (at + n > self.capacity or (freed == self.head and n <= at)) else 0
        # bytes skipped by the oldest span still held hold no data: counting them as used would leave an empty
        # ring that started over with `at` bytes of room until that span is freed (small messages then fell to gloo)
        if self.head + skip + n - freed > self.capacity + self.skips.get(freed, 0):
            return None
        for old in [key for key in self.skips if key < freed]:
            del self.skips[old]
        if skip:
            self.skips[self.head] = skip
        start, self.head = self.head, self.head + skip + n
        offset = (self.head - n) % self.capacity
        self.data[offset : offset + n].copy_(source)
        return start, self.head

    def take(self, start: int, end: int, n: int, into: torch.Tensor) -> None:
        """Receiver: copy the message of span [start, end) out, then free every span now contiguous."""
        offset = (end - n) % self.capacity
        into.copy_(self.data[offset : offset + n])
        self.freed_spans[start] = end
        freed = int(self.freed_word.item())
        while freed in self.freed_spans:
            freed = self.freed_spans.pop(freed)
        self.freed_word.fill_(freed)  # after the copy: the sender may now write there

    def close(self) -> None:
        self.freed_word = self.data = None
        try:
            self.mapped.close()
        except BufferError:  # a tensor still views it: the mapping goes with the last view
            pass


class LocalExchange:
    """The rings of this rank (group rank `me`) to and from every peer of a group, with a channel for the notices
    (the group's short messages' own, or one of the exchange's own, which it closes with the rings). Each
    exchange takes the group's next point-to-point `tag` (peer_exchange.Tags, held by the group's transport): a
    message that does not lie in a ring goes as a gloo send and receive."""

    def __init__(
        self,
        channel: local_channel.LocalChannel,
        outgoing: Dict[int, _Ring],
        incoming: Dict[int, _Ring],
        largest_share: int = 8,
        owns_channel: bool = False,
    ):
        self.channel, self.outgoing, self.incoming = channel, outgoing, incoming
        self.me, self.size, self.owns_channel = channel.me, channel.size, owns_channel
        self.limit = min([ring.capacity for ring in outgoing.values()] or [0]) // largest_share
        self.lock = threading.Lock()  # the rings' positions (a backward may run on another thread)
        # every gloo send and receive posted, with its bytes, until it completed: an exchange that a rank drops
        # unwaited (it raised) keeps its part of the transfer, which a peer may be waiting for
        self.unfinished: List[Tuple[Any, torch.Tensor]] = []

    def hold(self, work: Any, buffer: torch.Tensor) -> Any:
        """Keep a posted gloo `work` and its bytes alive until it completed; returns the work."""
        with self.lock:
            self.unfinished[:] = [(w, b) for w, b in self.unfinished if not w.is_completed()] + [(work, buffer)]
        return work

    def launch(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        group: Any,
        tag: int,
    ) -> "LocalAllToAll":
        """Rows x[sum(input_splits[:j]) ...] to rank j, rows from rank i into `out` (contiguous), launched."""
        sends = [_bytes(t) for t in x.contiguous().split(list(input_splits))]
        pieces = [_bytes(t) for t in out.split(list(output_splits))]
        pieces[self.me].copy_(sends[self.me])
        return LocalAllToAll(self, sends, pieces, group, tag)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Any, tag: int) -> "LocalAllToAll":
        """Rank j's `input` into slice j of the flat, contiguous `output` (input may already be this rank's
        slice), launched (peer_exchange.all_gather's contract)."""
        slices = output.view(-1).split(input.numel())
        mine = slices[self.me]
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input.reshape(-1))
        return LocalAllToAll(self, [_bytes(mine)] * self.size, [_bytes(t) for t in slices], group, tag)

    def scatter_pieces(self, input: torch.Tensor, received: torch.Tensor, group: Any, tag: int) -> "LocalAllToAll":
        """Slice j of `input` to rank j; slice me of every peer j into slice j of `received` (its own slot
        unused), launched (peer_exchange.scatter_pieces's contract)."""
        sends, pieces = input.view(self.size, -1), received.view(self.size, -1)
        return LocalAllToAll(self, [_bytes(t) for t in sends], [_bytes(t) for t in pieces], group, tag)

    def close(self) -> None:
        for ring in list(self.outgoing.values()) + list(self.incoming.values()):
            ring.close()
        if self.owns_channel:
            self.channel.close()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class LocalAllToAll:
    """One all-to-all in flight (a work handle: is_completed, wait). Every message to a peer goes one of three
    ways, which its notice names: through the ring (the usual), as a gloo send and receive posted now by both ends
    (larger than the limit: both know its size), or as a gloo send of a copy posted now and a receive posted when
    the receiver reads the notice (its ring was full; the sender's wait does not wait for that send, which a peer
    that raised before its wait never receives). No bytes ride in the pipes, so a post never waits for a reader."""

    def __init__(
        self, exchange: LocalExchange, sends: List[torch.Tensor], pieces: List[torch.Tensor], group: Any, tag: int
    ):
        """sends[j]: the bytes for rank j; pieces[i]: where rank i's bytes go (contiguous; this rank's own entries
        are not moved: the caller did what it needs); `tag`: the group's next (every rank, every exchange)."""
        self.exchange, self.group, self.tag, me = exchange, group, tag, exchange.me
        self.pieces = pieces
        self.works = [
            exchange.hold(dist.irecv(piece, group=group, group_src=p, tag=self.tag), piece)
            for p, piece in enumerate(self.pieces)
            if p != me and piece.numel() > exchange.limit
        ]
        notices = {me: b""}
        for p, sent in enumerate(sends):
            if p != me:
                notices[p] = self._send(p, sent)
        self.keep = sends  # a gloo send reads its rows until completed
        self.index = exchange.channel.post_each(notices)

    def _send(self, peer: int, sent: torch.Tensor) -> bytes:
        n = sent.numel()
        span = None
        if 0 < n <= self.exchange.limit:
            with self.exchange.lock:
                span = self.exchange.outgoing[peer].place(sent)
        if span is not None:
            return _NOTICE.pack(span[0], span[1], n)
        if n > self.exchange.limit:  # both ends post now: waiting for it needs nothing more of the peer
            self.works.append(
                self.exchange.hold(dist.isend(sent, group=self.group, group_dst=peer, tag=self.tag), sent)
            )
        elif n:
            # the peer posts its receive only when it waits for this exchange, which a peer that raised never does:
            # a copy is sent, held until done, and this rank's wait does not wait for it (no deadlock)
            copy = sent.clone()
            self.exchange.hold(dist.isend(copy, group=self.group, group_dst=peer, tag=self.tag), copy)
        return _NOTICE.pack(_BY_GLOO if n > self.exchange.limit else _LATE_GLOO, 0, n)

    def is_completed(self) -> bool:
        return self.exchange.channel.arrived(self.index) and all(w.is_completed() for w in self.works)

    @torch.compiler.disable  # inside a compiled model's forward or backward too: bytes, not graph ops
    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        whole_waits_only(timeout, "a shared-memory exchange")
        if self.pieces is None:
            return True
        every = self.exchange.channel.wait(self.index)
        for peer, notice in enumerate(every):
            if peer != self.exchange.me:
                self._receive(peer, notice)
        for work in self.works:
            work.wait()
        self.pieces = self.keep = self.works = None
        return True

    def _receive(self, peer: int, notice: bytes) -> None:
        start, end, n = _NOTICE.unpack_from(notice)
        piece = self.pieces[peer]
        if n != piece.numel():
            raise RuntimeError(
                f"an all-to-all expected {piece.numel()} bytes from rank {peer} of its group and "
                f"that rank sent {n}: the ranks exchanged different splits"
            )
        if start == _LATE_GLOO and n:
            self.works.append(
                self.exchange.hold(dist.irecv(piece, group=self.group, group_src=peer, tag=self.tag), piece)
            )
        elif start >= 0:
            with self.exchange.lock:
                self.exchange.incoming[peer].take(start, end, n, piece)


def connect(
    group: Any, channel: Optional[local_channel.LocalChannel], sizes: RingSizes = TOKENS, owns_channel: bool = False
) -> Optional[LocalExchange]:
    """Collective over `group` (nothing when `channel` is None): build its rings (None on every rank when any rank
    could not), their notices through `channel` (local_channel.connect), the group's short messages' one, or with
    `owns_channel` one of the exchange's own, closed with it (messages on it never pair with the group's other
    ones; closed here if the rings cannot be built)."""
    if channel is None:
        return None
    if platform.machine().lower() not in _ORDERED_STORES:
        if owns_channel:
            channel.close()
        return None
    size, me = channel.size, channel.me
    folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    tokens: List[Any] = [None] * size
    dist.all_gather_object(tokens, uuid.uuid4().hex, group=group)
    capacity = sizes.ring_bytes(size)
    path = lambda sender, receiver: os.path.join(folder, f"moezero-rows-{tokens[0]}-{sender}-{receiver}")
    peers = [p for p in range(size) if p != me]
    incoming: Dict[int, _Ring] = {}
    outgoing: Dict[int, _Ring] = {}
    make_incoming = lambda: incoming.update({p: _make_ring(path(p, me), capacity) for p in peers})
    map_outgoing = lambda: outgoing.update({p: _map_ring(path(me, p), capacity) for p in peers})
    try:
        ok = local_channel.each_rank_did(make_incoming, group) and local_channel.each_rank_did(map_outgoing, group)
    finally:
        for sender in range(size):
            for receiver in range(size):
                local_channel.remove(path(sender, receiver))
    exchange = LocalExchange(channel, outgoing, incoming, sizes.largest_share, owns_channel)
    if not ok:
        exchange.close()
        return None
    return exchange


def ring_bytes(size: int, sizes: RingSizes = TOKENS) -> int:
    """Each ring's capacity in a group of `size` ranks."""
    return sizes.ring_bytes(size)


def _make_ring(path: str, capacity: int) -> _Ring:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, _HEADER_BYTES + capacity)  # the space now, or an error now
        return _Ring(mmap.mmap(fd, _HEADER_BYTES + capacity), capacity)
    finally:
        os.close(fd)


def _map_ring(path: str, capacity: int) -> _Ring:
    fd = os.open(path, os.O_RDWR)
    try:
        return _Ring(mmap.mmap(fd, _HEADER_BYTES + capacity), capacity)
    finally:
        os.close(fd)
