"""Short messages between the ranks of a group that all run on one host, through pipes.

What travels here (a group's `LocalTransport`, local_transport.py): the agreement records (`agreement.py`), a few
integers that every rank states before a collective that pairs by order, ~10 messages a stage-3 step; the short
all-reduces of the data-parallel and control groups (`small_reduce.py`: the step's norm and flags, the metrics,
the stop check); the expert-parallel group's count exchanges (`comm.launch_exchange_counts`, one per MoE layer
forward); and the notices of the shared-memory rings (`local_exchange.py`). On gloo each of these messages wakes
gloo's threads on both ranks and goes through the TCP stack, on a CPU rank out of the cores the model's work
uses; a pipe write and a poll take only the caller's own thread, a small share of that (figures:
docs/benchmarks.md#small-reduce, `tools/bench_small_reduce.py`). NCCL does the same between the GPUs of one node
(shared memory).

How: each rank writes its k-th message to one pipe per peer and waits for every peer's k-th message, so
messages pair by their index as collectives pair by their order, and a message can be posted now and
collected later (async), or polled (`arrived`) while a rank waits elsewhere. A peer that exits closes its
pipes: its readers see end-of-file at once. A peer that never writes makes a wait raise at the group's
timeout. Built (collectively, once per group, by groups.py) when every rank sees the same host and the same
temp directory; otherwise `connect` gives None and the group keeps its backend's transport. The pipes' names
are removed as soon as every rank opened them, so nothing is left on disk.
"""

from __future__ import annotations

import datetime
import os
import select
import socket
import struct
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

_HEADER = struct.Struct("<qq")  # message index, payload bytes
_READ_CHUNK = 1 << 16
_NAP = 0.05  # the longest a wait blocks before looking again (seconds)
_open_channels: "weakref.WeakSet[LocalChannel]" = weakref.WeakSet()


class ChannelError(RuntimeError):
    """A peer's message did not come: the peer exited, or the timeout passed."""


class ChannelTimeout(RuntimeError):
    """A wait shorter than the group's timeout ended before the message came (a watched wait's slice)."""


class LocalChannel:
    """Messages of this rank (group rank `me` of `size`) to and from its peers, by index."""

    def __init__(
        self,
        me: int,
        size: int,
        readers: Dict[int, int],
        writers: Dict[int, int],
        timeout: datetime.timedelta,
        name: str = "group",
    ):
        self.me, self.size, self.name = me, size, name
        self.readers, self.writers = readers, writers  # peer -> fd
        self.timeout = timeout.total_seconds()
        self.posted = 0
        self.closed = False
        self._mine: Dict[int, bytes] = {}
        self._received: Dict[int, Dict[int, bytes]] = {peer: {} for peer in readers}  # peer -> index -> payload
        self._unparsed: Dict[int, bytearray] = {peer: bytearray() for peer in readers}
        self._gone: Dict[int, str] = {}  # peer -> why no more of its messages will come (end-of-file)
        self._lock = threading.Lock()
        _open_channels.add(self)
        weakref.finalize(self, _close_all, readers, writers)  # a channel dropped without close()

    def post(self, payload: bytes) -> int:
        """Send this rank's next message to every peer; returns its index (for arrived / wait)."""
        return self.post_each({rank: payload for rank in range(self.size)})

    def post_each(self, payloads: Dict[int, bytes]) -> int:
        """Send this rank's next message, payloads[peer] to each peer (payloads[me]: what wait gives as this
        rank's own); returns its index."""
        with self._lock:
            self._check_open()
            index = self.posted
            self.posted += 1
            self._mine[index] = payloads[self.me]
            for peer in list(self.writers):
                self._write(peer, _HEADER.pack(index, len(payloads[peer])) + payloads[peer])
            return index

    def arrived(self, index: int) -> bool:
        """Whether wait(index) would return (or raise) at once; never blocks."""
        with self._lock:
            self._check_open()
            self._drain()
            return not self._missing(index)

    def wait(self, index: int, seconds: Optional[float] = None, final: bool = True) -> List[bytes]:
        """Every rank's message `index`, in group rank order. ChannelError if a peer exited or `seconds` (default:
        the group's timeout) passed; with final=False a wait that ran out of `seconds` raises ChannelTimeout
        instead (a watched wait's slice), and a later wait for the same message resumes."""
        deadline = time.monotonic() + (self.timeout if seconds is None else seconds)
        while True:
            with self._lock:  # not held while blocked: another thread may post or poll meanwhile
                self._check_open()
                self._drain()
                missing = self._missing(index)
                if not missing:
                    return self._take(index)
                waiting_on = {self.readers[p]: select.POLLIN for p in missing}
            left = deadline - time.monotonic()
            if left <= 0:
                if not final:
                    raise ChannelTimeout(f"message {index} not here from rank {missing[0]} within {seconds:.3f} s")
                raise ChannelError(
                    f"no message {index} from rank {missing[0]} of the {self.name} within "
                    f"the group's timeout ({self.timeout:.0f} s)"
                )
            _wait_for(waiting_on, min(left, _NAP))  # a nap: another thread may have read the message meanwhile

    def close(self) -> None:
        with self._lock:
            self.closed = True
            _close_all(self.readers, self.writers)

    def _check_open(self) -> None:
        if self.closed:
            raise ChannelError(f"the {self.name}'s pipes were closed (its process group was destroyed)")

    def _take(self, index: int) -> List[bytes]:
        for peer, why in self._gone.items():
            if index not in self._received[peer]:
                raise ChannelError(f"rank {peer} of the {self.name} {why}")
        return [
            self._mine.pop(index) if rank == self.me else self._received[rank].pop(index) for rank in range(self.size)
        ]

    def _missing(self, index: int) -> List[int]:
        """Peers whose message `index` has not come and still may."""
        return [p for p in self.readers if index not in self._received[p] and p not in self._gone]

    def _write(self, peer: int, frame: bytes) -> None:
        """The whole frame into the peer's pipe. While it is full, read what the peers sent (they may be writing
        to this rank just as hard); a peer that reads nothing for the group's timeout, or exited, loses its pipe:
        closed, so that it sees end-of-file rather than a torn frame."""
        fd, view = self.writers[peer], memoryview(frame)
        deadline = time.monotonic() + self.timeout
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._drain()
                events = {r: select.POLLIN for p, r in self.readers.items() if p not in self._gone}
                events[fd] = select.POLLOUT
                _wait_for(events, min(left, _NAP))
            except BrokenPipeError:
                break
        if view:
            os.close(self.writers.pop(peer))

    def _drain(self) -> None:
        """Read what has come from the peers, without blocking."""
        for peer, fd in self.readers.items():
            if peer in self._gone:
                continue
            buffer = self._unparsed[peer]
            while True:
                try:
                    chunk = os.read(fd, _READ_CHUNK)
                except BlockingIOError:
                    break
                if not chunk:
                    self._gone[peer] = "exited or stopped reading (its end of the pipe is closed)"
                    break
                buffer += chunk
                if len(chunk) < _READ_CHUNK:
                    break
            self._parse(peer, buffer)

    def _parse(self, peer: int, buffer: bytearray) -> None:
        while len(buffer) >= _HEADER.size:
            index, length = _HEADER.unpack_from(buffer)
            end = _HEADER.size + length
            if len(buffer) < end:
                return
            self._received[peer][index] = bytes(buffer[_HEADER.size : end])
            del buffer[:end]


def _close_all(readers: Dict[int, int], writers: Dict[int, int]) -> None:
    for fd in list(readers.values()) + list(writers.values()):
        try:
            os.close(fd)
        except OSError:
            pass
    readers.clear()
    writers.clear()


def _wait_for(events: Dict[int, int], seconds: float) -> None:
    """Block until one descriptor is ready for its event (or closed), at most `seconds`. poll, not select: a
    process with many groups and files has descriptors above select's limit of 1024."""
    poller = select.poll()
    for fd, event in events.items():
        poller.register(fd, event)
    poller.poll(max(1, int(seconds * 1000)))


def connect(group: Any, timeout: Optional[datetime.timedelta] = None, name: str = "group") -> Optional[LocalChannel]:
    """Collective over `group`: a channel between its ranks when every rank is on this host and sees this temp
    directory (None otherwise, on every rank). `timeout`: how long a wait lasts (None: torch's default for
    groups); `name`: the group, as errors call it. Each channel is its own: messages on one never pair with
    another's (the rings' notices get one apart from the group's short messages, local_exchange.py)."""
    return connect_all([(group, name)], timeout)[0]


def connect_all(
    named_groups: Sequence[Tuple[Any, str]], timeout: Optional[datetime.timedelta] = None
) -> List[Optional[LocalChannel]]:
    """`connect` for several (group, name) of the same ranks in the same order, with one exchange of the hosts
    and two of the outcome for all of them (on the first group)."""
    group = named_groups[0][0]
    size, me = dist.get_world_size(group), dist.get_rank(group)
    none: List[Optional[LocalChannel]] = [None] * len(named_groups)
    if any(dist.get_world_size(g) != size or dist.get_rank(g) != me for g, _ in named_groups):
        raise ValueError("local_channel.connect_all: the groups must hold the same ranks in the same order")
    if size < 2 or not hasattr(os, "mkfifo"):
        return none
    here = (_host_identity(), uuid.uuid4().hex, tempfile.gettempdir())
    every: List[Any] = [None] * size
    dist.all_gather_object(every, here, group=group)
    if any(e[0] != here[0] for e in every):
        return none
    token, folder = every[0][1], every[0][2]
    paths = [
        lambda sender, receiver, c=c: os.path.join(folder, f"moezero-records-{token}-{c}-{sender}-{receiver}")
        for c in range(len(named_groups))
    ]
    peers = [p for p in range(size) if p != me]
    readers: List[Dict[int, int]] = [{} for _ in named_groups]
    writers: List[Dict[int, int]] = [{} for _ in named_groups]
    try:
        ok = each_rank_did(lambda: [_open_readers(peers, me, path, r) for path, r in zip(paths, readers)], group)
        ok = ok and each_rank_did(
            lambda: [
                w.update({p: os.open(path(me, p), os.O_WRONLY | os.O_NONBLOCK) for p in peers})
                for path, w in zip(paths, writers)
            ],
            group,
        )
    except BaseException:  # a peer died or timed out during the setup: nothing stays open
        for r, w in zip(readers, writers):
            _close_all(r, w)
        raise
    finally:
        for path in paths:  # every rank opened both ends (or gave up): no name is needed any more (every
            for sender in range(size):  # rank removes them all, in case the one that made them died)
                for receiver in range(size):
                    remove(path(sender, receiver))
    channels = [
        LocalChannel(me, size, r, w, timeout or _default_timeout(), name)
        for r, w, (_, name) in zip(readers, writers, named_groups)
    ]
    if not ok:
        for channel in channels:
            channel.close()
        return none
    return list(channels)


def _open_readers(peers: List[int], me: int, path: Any, readers: Dict[int, int]) -> None:
    for p in peers:
        os.mkfifo(path(p, me), 0o600)
        readers[p] = os.open(path(p, me), os.O_RDONLY | os.O_NONBLOCK)


def each_rank_did(action: Any, group: Any) -> bool:
    """Run `action` here; whether it worked on every rank (collective)."""
    try:
        action()
        done = True
    except OSError:
        done = False
    every: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, done, group=group)
    return all(every)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _host_identity() -> str:
    """This host's name and boot: ranks on other machines (or another boot of a namesake) differ."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _default_timeout() -> datetime.timedelta:
    from torch.distributed.constants import default_pg_timeout

    return default_pg_timeout


def _close_in_child() -> None:
    """A forked child (a data loader's worker) must not keep a peer's pipes open: its end-of-file would never come."""
    for channel in list(_open_channels):
        channel._lock = threading.Lock()  # another thread of the parent may have held it at the fork
        channel.closed = True
        _close_all(channel.readers, channel.writers)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)
