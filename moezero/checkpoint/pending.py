"""An asynchronous save in flight (--async-save): written in the background, published when every rank is done.

    pending = save_checkpoint(..., async_group=group)   # returns once the state is copied (training goes on)
    if pending.done_everywhere(): pending.finish()      # each iteration: publish once all ranks finished
    pending.finish()                                    # before the next save and at the end: wait, publish

The background writer runs its collectives on a process group of its own (`async_group`), never on the
groups training uses. Nothing is published until `finish()`: a job stopped while a save is in flight keeps the
previous checkpoint as `latest` (the staging folder is removed by the next save).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from torch.distributed.checkpoint.api import CheckpointException

from moezero.checkpoint.errors import CheckpointError, innermost_cause, no_space
from moezero.parallel import comm


@dataclass
class PendingSave:
    future: Future
    path: str  # the iter_N folder it becomes
    publish: Callable[[], str]  # collective: rename into place, point `latest` at it, prune
    group: Any  # the control group the ranks agree on
    abandon: Callable[[], None] = lambda: None  # collective: remove the partial folder after a failed write
    disk_full: Callable[[], bool] = lambda: False  # whether the folder's file system is full (before `abandon`)

    def done_everywhere(self) -> bool:
        """Collective: whether every rank's background write has ended (an all-reduce of one flag)."""
        return comm.all_true(self.future.done(), self.group)

    def finish(self) -> str:
        """Collective: wait for this rank's write, agree that every rank's succeeded, then publish; a failed
        write is a CheckpointError on every rank (nothing published, the previous checkpoint stays latest)."""
        error = None
        try:
            self.future.result()
        except (Exception, CheckpointException) as exc:  # the writer's error, whatever its kind (DCP's
            error = exc  # CheckpointException is a BaseException): never a hang
        if comm.all_true(error is None, self.group):
            return self.publish()
        reason = innermost_cause(error) if error is not None else "another rank could not write its part"
        if error is not None and self.disk_full():  # torch's writer may report a full disk as a bad offset
            reason = no_space(reason)
        self.abandon()  # frees the space: asked above
        raise CheckpointError(
            f"--async-save: writing {self.path} failed ({reason}); its partial folder is removed "
            "and the previous checkpoint stays latest"
        )
