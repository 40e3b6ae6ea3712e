"""Ranks that must do the same thing check that they do, before a collective that pairs by order.

Collectives pair up by their order on a process group: a rank that runs one more forward, or
units in another order, or a backward that reaches no parameter, pairs its next collective with
a different one on its peers, which hangs, aborts the process on a size mismatch (gloo), or
silently mixes unrelated tensors. So before such a collective every rank states what it is doing
as a short record of integers. Records travel on a group that carries nothing else, always as the
same all-reduce (the maximum of the record and of its negation, and of one flag that rides along:
whether any rank has something to do, e.g. gradients left unreduced), so records only ever pair with
records and never abort; when the maximum and the minimum differ, every rank raises
`RanksDisagree`, naming what it was doing and what another rank was doing (with two ranks: the
other one exactly). A record can be launched ahead and checked when it matters (`Agreement`), so a
check costs no waiting when the ranks are in step. A rank whose peers never arrive (blocked in a
collective of their own, or gone) raises when the group's timeout expires, naming where it waited.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

RECORD_LENGTH = 6
Describe = Callable[[Sequence[int]], str]


class RanksDisagree(RuntimeError):
    """The ranks of a collective step were not doing the same thing."""


class Agreement:
    """One record, launched now (async) on `group`; `check()` waits for it and raises on a difference."""

    def __init__(self, record: Sequence[int], group: Optional[Any], describe: Describe, flag: int = 0):
        self.record = list(record) + [0] * (RECORD_LENGTH - len(record))
        self.describe = describe
        self.work = None
        self.flag_anywhere = flag   # the flag's maximum over the ranks, once checked
        if group is not None and dist.get_world_size(group) > 1:
            mine = torch.tensor(self.record, dtype=torch.int64)
            self.extremes = torch.cat([mine, -mine, torch.tensor([flag], dtype=torch.int64)])
            self.work = dist.all_reduce(self.extremes, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def check(self) -> None:
        if self.work is None:
            return
        work, self.work = self.work, None
        try:
            work.wait()
        except RuntimeError as exc:   # the group's timeout, or a peer that exited
            raise RanksDisagree(f"rank {dist.get_rank()} {self.describe(self.record)}, and not every other rank "
                                "arrived there (one is blocked in a collective of its own, ran a different number "
                                f"of forwards or backwards, or exited): {str(exc).splitlines()[0]}") from None
        high, low = self.extremes[:RECORD_LENGTH].tolist(), (-self.extremes[RECORD_LENGTH:-1]).tolist()
        self.flag_anywhere = int(self.extremes[-1])
        if high != low:
            raise RanksDisagree(disagreement_message(dist.get_rank(), self.record, high, low, self.describe))


    def wait(self) -> None:
        """Wait without comparing (the record belongs to a pass every rank abandoned)."""
        if self.work is not None:
            self.work.wait()
            self.work = None


class ExchangeRecord:
    """A record that rides on an exchange the model makes anyway (an MoE layer's token counts, the global aux
    loss's counts): no collective of its own, so it costs nothing, and ranks whose exchanges pair up with
    another layer's or another forward's raise RanksDisagree instead of mixing them."""

    def __init__(self, mine: Sequence[int], describe: Describe):
        self.mine = [int(v) for v in mine] + [0] * (RECORD_LENGTH - len(mine))
        self.describe = describe

    def check_received(self, records: torch.Tensor) -> None:
        """`records`: one row per rank of the exchange (what each sent)."""
        for theirs in records.tolist():
            if theirs != self.mine:
                raise RanksDisagree(disagreement_message(dist.get_rank(), self.mine, theirs, theirs, self.describe))

    def check_summed(self, sums: torch.Tensor, squares: torch.Tensor, ranks: int) -> None:
        """The record and its square summed over `ranks` ranks: all equal iff ranks * sum(r^2) == sum(r)^2."""
        if not torch.equal(sums * sums, squares * ranks):
            raise RanksDisagree("the ranks are not doing the same thing, so their collectives would not pair up: "
                                f"this rank ({dist.get_rank()}) {self.describe(self.mine)}; another rank was not")


def agree(record: Sequence[int], group: Optional[Any], describe: Describe) -> None:
    """Collective over `group`: every rank passes its record; raise on every rank if any differs."""
    Agreement(record, group, describe).check()


def disagreement_message(rank: int, mine: List[int], high: List[int], low: List[int], describe: Describe) -> str:
    """This rank's record and another's: per field the extreme that is not this rank's (with two ranks,
    exactly the other rank's record)."""
    other = [lo if m == hi else hi for m, hi, lo in zip(mine, high, low)]
    return ("the ranks are not doing the same thing, so their collectives would not pair up (every rank must run "
            f"the same forwards, backwards and optimizer calls, in the same order): this rank ({rank}) "
            f"{describe(mine)}; another rank {describe(other)}")
