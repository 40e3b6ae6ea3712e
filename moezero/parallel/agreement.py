"""Ranks that must do the same thing check that they do, before a collective that pairs by order.

Collectives pair up by their order on a process group: a rank that runs one more forward, or
units in another order, or a backward that reaches no parameter, pairs its next collective with
a different one on its peers, which hangs, aborts the process on a size mismatch (gloo), or
silently mixes unrelated tensors. So before such a collective every rank states what it is doing
as a short record of integers. Records travel as messages of one length that every rank sends every
rank (its records and one flag of bits that rides along: whether any rank has something to do, e.g.
gradients left unreduced), on a channel that carries nothing else: the group's pipes when its ranks share a host
(`local_channel.py`), else a gloo group's all-gather (docs/benchmarks.md#small-reduce). Messages pair by
their index, so records only ever pair with records and never abort; when
any rank's record differs, every rank raises `RanksDisagree`, naming what it was doing and what another
rank was doing. A record can be launched ahead and checked when it matters (`Agreement`), so a
check costs no waiting when the ranks are in step; records launched together share one message (a
message's cost is its rounds, hardly its integers: docs/benchmarks.md#stage3; on gloo an all-gather, not an
all-reduce, for the same reason: `small_reduce.py`). A rank
whose peers never arrive (blocked in a collective of their own, or gone) raises when the group's
timeout expires, naming where it waited. A record that rides on a model's exchange and is stated
among the records too lets that exchange wait watching them (`watched_wait`): a rank whose peer
went elsewhere finds the peer's differing record there and raises instead of waiting.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moezero.parallel import small_reduce

RECORD_LENGTH = 6
WATCH_SLICE = datetime.timedelta(milliseconds=20)  # a watched wait checks the agreement records this often
RECORDS_PER_MESSAGE = 8  # records launched together travel in one all-reduce (a short message: padded)
Describe = Callable[[Sequence[int]], str]
Record = Sequence[int]


class RanksDisagree(RuntimeError):
    """The ranks of a collective step were not doing the same thing."""


class Agreement:
    """Up to RECORDS_PER_MESSAGE records, launched now (async) on `group` as one message to every rank (through
    the group's pipes when its ranks share a host, `local_channel.py`, else gloo's all-gather); `check()` waits
    for every rank's and raises on a difference. Every message has the same length (unused slots are zeros), so
    a message only ever pairs with another message, whatever each holds."""

    def __init__(self, records: Sequence[Record], group: Optional[Any], describe: Describe, flag: int = 0):
        if not 1 <= len(records) <= RECORDS_PER_MESSAGE:
            raise ValueError(f"an agreement message holds 1 to {RECORDS_PER_MESSAGE} records, not {len(records)}")
        self.records = [_padded(r) for r in records]
        self.describe = describe
        self.message: Optional[Any] = None
        self.checked = False  # check() or wait() ran
        self.flag_anywhere = flag  # the flag's bits set on any rank (their OR), once checked
        if group is not None and dist.get_world_size(group) > 1:
            unused = [0] * (RECORD_LENGTH * (RECORDS_PER_MESSAGE - len(self.records)))
            self.mine = [v for r in self.records for v in r] + unused + [int(flag)]
            self.message = small_reduce.gather_copies(torch.tensor(self.mine, dtype=torch.int64), group)

    @property
    def record(self) -> List[int]:
        return self.records[0]

    def check(self) -> None:
        self.checked = True
        if self.message is None:
            return
        message, self.message = self.message, None
        try:
            message.wait()
        except RuntimeError as exc:  # the group's timeout, or a peer that exited
            raise RanksDisagree(not_arrived_message(self.describe(self.record), exc)) from None
        every = message.copies.view(-1, len(self.mine)).tolist()
        self.flag_anywhere = 0
        for row in every:  # bits of a flag are set where any rank set them
            self.flag_anywhere |= row[-1]
        mine = self.mine[:-1]
        if all(row[:-1] == mine for row in every):  # the common case: no per-record loop
            return
        empty = [[0] * RECORD_LENGTH] * (RECORDS_PER_MESSAGE - len(self.records))  # what an unused slot holds
        for slot, record in enumerate(self.records + empty):  # the first record that differs, on any rank
            for row in every:
                other = row[slot * RECORD_LENGTH : (slot + 1) * RECORD_LENGTH]
                if other != record:
                    raise RanksDisagree(disagreement_message(dist.get_rank(), record, other, self.describe))

    def arrived(self) -> bool:
        """Whether check() would return at once (every rank launched this message, or it needs none)."""
        return self.message is None or self.message.is_completed()

    def wait(self) -> None:
        """Wait without comparing (the record belongs to a pass every rank abandoned)."""
        self.checked = True
        if self.message is not None:
            message, self.message = self.message, None
            message.wait()


def _padded(record: Record) -> List[int]:
    return [int(v) for v in record] + [0] * (RECORD_LENGTH - len(record))


class ExchangeRecord:
    """A record that rides on an exchange the model makes anyway (an MoE layer's token counts, the global aux
    loss's counts): no collective of its own, so it costs nothing, and ranks whose exchanges pair up with
    another layer's or another forward's raise RanksDisagree instead of mixing them.

    `channel` (stage 3): (settle, check_arrived) of the same record stated in the agreement sequence too, where
    a peer waiting in a unit gather meets it. The exchange then waits watching that sequence (gloo), so a rank
    whose peer went elsewhere raises instead of waiting in the exchange for it; where a wait cannot be watched,
    the record is settled before the exchange."""

    def __init__(
        self, mine: Record, describe: Describe, channel: Optional[Tuple[Callable[[], None], Callable[[], None]]] = None
    ):
        self.mine = _padded(mine)
        self.describe = describe
        self.channel = channel

    def prepare(self, group: Any) -> Optional[Callable[[Any], None]]:
        """Before the exchange on `group`: how to wait for its (async) work; None: run it as usual."""
        if self.channel is None:
            return None
        settle, check_arrived = self.channel
        if dist.get_backend(group) != "gloo":  # only gloo's waits can be left and resumed
            settle()
            return None
        return lambda work: watched_wait(work, check_arrived)

    def check_received(self, records: torch.Tensor) -> None:
        """`records`: one row per rank of the exchange (what each sent)."""
        for theirs in records.tolist():
            if theirs != self.mine:
                raise RanksDisagree(disagreement_message(dist.get_rank(), self.mine, theirs, self.describe))

    def check_summed(self, sums: torch.Tensor, squares: torch.Tensor, ranks: int) -> None:
        """The record and its square summed over `ranks` ranks: all equal iff ranks * sum(r^2) == sum(r)^2."""
        if not torch.equal(sums * sums, squares * ranks):
            raise RanksDisagree(
                "the ranks are not doing the same thing, so their collectives would not pair up: "
                f"this rank ({dist.get_rank()}) {self.describe(self.mine)}; another rank was not"
            )


def watched_wait(work: Any, check_arrived: Callable[[], None]) -> None:
    """Wait for a gloo collective in slices; between them `check_arrived()` raises if an agreement record that
    arrived meanwhile differs (a peer that went elsewhere stated it there and will not join this collective)."""
    if work is None:
        return
    while True:
        try:
            work.wait(WATCH_SLICE)
            return
        except RuntimeError:
            if work.is_completed():  # it ended meanwhile, or failed: wait() says which
                _finish(work, check_arrived)
                return
            check_arrived()


def _finish(work: Any, check_arrived: Callable[[], None]) -> None:
    """A watched collective that ended: return, or raise why it failed. A peer that went elsewhere, raised and
    left closes its connections: its record, stated before it left, names the cause (RanksDisagree), not the
    closed connection."""
    try:
        work.wait()
    except RuntimeError:
        check_arrived()
        raise


def agree(record: Sequence[int], group: Optional[Any], describe: Describe) -> None:
    """Collective over `group`: every rank passes its record; raise on every rank if any differs."""
    Agreement([record], group, describe).check()


def not_arrived_message(doing: str, exc: BaseException) -> str:
    """A wait that ended without every peer: what this rank was doing, and the backend's reason."""
    return (
        f"rank {dist.get_rank()} {doing}, and not every other rank arrived there (one is blocked in a "
        "collective of its own, ran a different number of forwards or backwards, or exited): "
        f"{str(exc).splitlines()[0]}"
    )


def disagreement_message(rank: int, mine: List[int], other: List[int], describe: Describe) -> str:
    """This rank's record and another rank's."""
    return (
        "the ranks are not doing the same thing, so their collectives would not pair up (every rank must run "
        f"the same forwards, backwards and optimizer calls, in the same order): this rank ({rank}) "
        f"{describe(mine)}; another rank {describe(other)}"
    )
