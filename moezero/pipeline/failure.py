"""A pipeline step that raised on some rank: one line on every rank of the pipeline, naming the rank and stage that
failed first, and no rank left waiting in a send or receive until the timeout.

The rank that fails first states its line in the world's store (first writer wins: `compare_set`), then closes its
pipeline connections (`PipelineGroups.close_pp`), so a neighbour blocked in a receive from it fails at once with
"connection closed" (gloo's abort() does not close them; dropping the group does). That neighbour's error brings it
here too: the store already holds the first line, which it raises as its own, and it closes its connections in
turn, which frees the next stage. A rank that is not waiting on the failed one meets the closed connection at its
next send, receive or the gradient norm's pp all-reduce. Where no rank got to state a cause (a neighbour
that died), each rank's own error is the line. Bounded in every case by the pp group's timeout, which the
line of a rank that timed out names as its cause.

Ranks of other pipelines (data parallel > 1) that wait in a stage collective for a failed rank are not reached
here: they end when the failed process exits (torchrun) or at their group's timeout.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from moezero.parallel import comm

KEY_PREFIX = "moezero/pipeline_failure"


class PipelineFailed(RuntimeError):
    """A pipeline step failed on some rank; the message is one line naming it."""


def agreed_run_key(world_control: Optional[Any]) -> str:
    """A store key no earlier pipeline of this world used (collective over the world: rank 0's random id)."""
    token = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64)
    if world_control is not None:
        comm.broadcast(token, 0, world_control)
    return f"{KEY_PREFIX}/{int(token[0])}"


def first_line(error: BaseException) -> str:
    """`Type: message` of the error's root cause (torch's stage wraps a forward's error in a RuntimeError of its
    own), its first line."""
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    text = str(root).strip().splitlines()
    return f"{type(root).__name__}: {text[0] if text else ''}".rstrip(": ")


class FailureGuard:
    """Turns a rank's error in a pipeline step into the one line every rank raises."""

    def __init__(self, key: str, rank: int, stage_index: int):
        self.key, self.rank, self.stage_index = key, rank, stage_index
        self._store = _default_store()

    def line_for(self, cause: str, iteration: int) -> str:
        """The line to raise: the first failure's, stated by whichever rank got there first (this one if none)."""
        mine = f"pipeline stage {self.stage_index} (rank {self.rank}) failed at iteration {iteration}: {cause}"
        if self._store is None:
            return mine
        try:
            return self._store.compare_set(self.key, "", mine).decode()
        except Exception:  # the store is gone (the launcher tore the world down): our own line
            return mine


def _default_store() -> Optional[Any]:
    """The world's key-value store (torch's private accessor of the default group's store; None without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    return getter() if getter is not None else None
