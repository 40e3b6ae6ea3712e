"""The transport of a gloo group whose ranks all run on this host: short messages through pipes, exchanges through
shared memory, each rank's own thread doing the work, where gloo wakes its threads and goes through the TCP
stack (figures: docs/benchmarks.md#small-reduce and #distribution).

groups.py builds the parts (collectively, when it makes the groups) and serves each group a `LocalTransport` of
those it has; a part that could not be built (ranks on several hosts, no /dev/shm room, a non-x86 host) leaves
that part's collectives on gloo (`GlooTransport`, which this extends):
- `pipes` (local_channel.py): the agreement records, the short all-reduces (any length, from one element), the
  count exchanges. The data-parallel, control, expert-parallel and agreement groups have them.
- `rings` (local_exchange.py): the token all-to-alls (the expert-parallel group's, their notices on its pipes) and
  the bucket reduce-scatters and all-gathers (the data-parallel groups' and stage 3's gather groups', their
  notices on a channel of the rings' own).
Only CPU tensors take them; a device tensor on such a group goes by gloo.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable, Optional, Sequence

import torch

from moezero.parallel.local_channel import LocalChannel
from moezero.parallel.local_exchange import LocalExchange
from moezero.parallel.transport import GlooTransport, Waited
from moezero.parallel.work import Work


class LocalTransport(GlooTransport):
    """A gloo group's collectives through its `pipes` and `rings` (either may be None: gloo's, then)."""

    def __init__(self, group: Any, pipes: Optional[LocalChannel] = None, rings: Optional[LocalExchange] = None):
        super().__init__(group)
        self.pipes, self.rings = pipes, rings

    def close(self) -> None:
        if self.rings is not None:
            self.rings.close()  # and the rings' own channel
        if self.pipes is not None:
            self.pipes.close()

    def all_to_all(
        self, out: torch.Tensor, sent: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int]
    ) -> Work:
        if self.rings is None or sent.device.type != "cpu":
            return super().all_to_all(out, sent, output_splits, input_splits)
        return self.rings.launch(out, sent, output_splits, input_splits, self.group, self.tags.take())

    def exchange_counts(self, send_counts: torch.Tensor, wait: Optional[Callable[[Any], None]] = None) -> Work:
        if self.pipes is None or send_counts.device.type != "cpu":
            return super().exchange_counts(send_counts, wait)
        # each rank posts its whole table and keeps its row of each: one message, where gloo's all-to-all wakes
        # its threads
        return RowsOfCopies(self.gather_copies(send_counts), send_counts, self.rank, wait)

    def gather_copies(self, x: torch.Tensor) -> Work:
        return super().gather_copies(x) if self.pipes is None else PipedCopies(self.pipes, x)

    def reduces_by_copies(self, numel: int) -> bool:
        return self.pipes is not None or super().reduces_by_copies(numel)

    def scatter_pieces(self, input: torch.Tensor, received: torch.Tensor) -> Work:
        if self.rings is None or input.device.type != "cpu":
            return super().scatter_pieces(input, received)
        return self.rings.scatter_pieces(input, received, self.group, self.tags.take())

    def gathered_slices(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        if self.rings is None or output.device.type != "cpu":
            return super().gathered_slices(output, input)
        return self.rings.all_gather(output, input, self.group, self.tags.take())


class PipedCopies:
    """Every rank's copy of a short CPU tensor through the group's pipes: completed once every copy came or the
    group's timeout passed since the launch (wait() then raises, as a gloo work's would); once waited for,
    `copies` holds them flat in rank order."""

    def __init__(self, channel: LocalChannel, x: torch.Tensor):
        self.channel, self.dtype, self.numel = channel, x.dtype, x.numel()
        self.index = channel.post(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        self.deadline = time.monotonic() + channel.timeout
        self.copies: Optional[torch.Tensor] = None

    def is_completed(self) -> bool:
        return self.channel.arrived(self.index) or time.monotonic() >= self.deadline

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        left = max(0.0, self.deadline - time.monotonic())
        if timeout is None or timeout.total_seconds() >= left:  # up to the group's timeout from the launch
            every = self.channel.wait(self.index, left)
        else:  # a slice: ChannelTimeout, and a later wait resumes
            every = self.channel.wait(self.index, timeout.total_seconds(), final=False)
        if any(len(m) != len(every[0]) for m in every):
            raise RuntimeError(
                f"a short all-reduce of {self.numel} elements met a rank's of another length: the "
                "ranks are not running the same collectives"
            )
        self.copies = torch.frombuffer(bytearray(b"".join(every)), dtype=self.dtype)
        return True


class RowsOfCopies(Waited):
    """An all-to-all of one row per rank, as every rank's copy of the whole table: row `me` of each copy."""

    def __init__(self, work: PipedCopies, sent: torch.Tensor, me: int, wait: Optional[Callable[[Any], None]]):
        super().__init__(work, None, wait)
        self.shape, self.me = sent.shape, me

    @torch.compiler.disable
    def wait(self, timeout: Optional[datetime.timedelta] = None) -> torch.Tensor:
        super().wait(timeout)
        return self.work.copies.view(-1, *self.shape)[:, self.me].clone()
