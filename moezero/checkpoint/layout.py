"""Where checkpoints live on disk, and the atomic switch to a new one.

    DIR/iter_0000100/                         one DCP checkpoint: .metadata + one __<rank>_0.distcp per rank
    DIR/latest_checkpointed_iteration.txt     Megatron's pointer file, replaced last

A save writes `iter_N.tmp`, renames it to `iter_N` only after every rank finished, then replaces the
pointer; a crash or Ctrl-C at any point leaves the previous checkpoint and pointer intact (stale
`.tmp` folders are ignored and removed by the next save). A checkpoint is removed (pruned, or replaced by a save of
the same iteration) by renaming it to `iter_N.removed` first, so a kill mid-removal never leaves a half-deleted
`iter_N` behind.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import List, Optional

from moezero.checkpoint.errors import CheckpointError, first_line

POINTER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_(\d+)$")
_REMOVED = ".removed"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> Optional[int]:
    """The iteration the pointer file names, or None when there is no checkpoint."""
    path = os.path.join(root, POINTER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit() or not os.path.isdir(iteration_dir(root, int(text))):
        raise CheckpointError(
            f"{path}: names iteration {text!r}, which has no checkpoint folder (saved: "
            f"{saved_iterations(root) or 'none'}; pick one with --ckpt-step)"
        )
    return int(text)


def saved_iterations(root: str) -> List[int]:
    """The iterations of the complete checkpoints in `root`, oldest first (staging folders excluded)."""
    if not os.path.isdir(root):
        return []
    found = (_ITER.match(name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


def unfinished_saves(root: str) -> List[str]:
    """Staging folders a save left behind (interrupted before its rename); ignored by loads."""
    if not os.path.isdir(root):
        return []
    return sorted(name for name in os.listdir(root) if name.endswith(".tmp") and name.startswith("iter_"))


def resolve_checkpoint(path: str, flag: str = "--load") -> str:
    """An `iter_N` folder, or a --save root whose pointer file names the latest one."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    iteration = latest_iteration(path) if os.path.isdir(path) else None
    if iteration is None:
        what = "does not exist" if not os.path.exists(path) else f"is not a checkpoint (no .metadata, no {POINTER})"
        raise CheckpointError(f"{flag}={path}: {what}")
    return iteration_dir(path, iteration)


def check_writable(root: str) -> None:
    """Each rank, at start: create `root`, write and remove a probe file of its own, so an unwritable --save is
    one line before training, not a traceback at the first save an interval later."""
    probe = os.path.join(root, f".moezero-write-probe-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(f"--save={root}: cannot write there ({first_line(exc)})") from None


def staging_dir(root: str, iteration: int) -> str:
    """The folder a save writes into before `publish` renames it."""
    return iteration_dir(root, iteration) + ".tmp"


def remove_stale(root: str) -> None:
    """Rank 0, before a save: create `root`, remove the staging folders of crashed saves and what a killed
    removal left."""
    os.makedirs(root, exist_ok=True)
    leftovers = [name for name in os.listdir(root) if name.startswith("iter_") and name.endswith(_REMOVED)]
    for stale in unfinished_saves(root) + leftovers:
        shutil.rmtree(os.path.join(root, stale), ignore_errors=True)


def _remove(root: str, iteration: int) -> None:
    """Take the folder out of the checkpoints in one rename, then delete it."""
    doomed = iteration_dir(root, iteration) + _REMOVED
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(iteration_dir(root, iteration), doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune(root: str, keep: int) -> List[int]:
    """Rank 0, after a publish: of the checkpoints up to the one the pointer names (the run's own history),
    remove all but the newest `keep`; returns the removed iterations. Newer ones come from a run this one
    rolled back from (--ckpt-step): counting them would delete the checkpoint just resumed from, so they stay
    until this run saves their iteration again."""
    if keep <= 0:
        return []
    latest = latest_iteration(root)
    history = [i for i in saved_iterations(root) if latest is None or i <= latest]
    old = history[:-keep]
    for iteration in old:
        _remove(root, iteration)
    return old


def publish(root: str, iteration: int) -> str:
    """Rank 0, after every rank wrote: rename the staged folder into place, then replace the pointer."""
    final = iteration_dir(root, iteration)
    if os.path.exists(final):
        _remove(root, iteration)
    os.replace(staging_dir(root, iteration), final)
    pointer_tmp = os.path.join(root, POINTER + ".tmp")
    with open(pointer_tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, os.path.join(root, POINTER))
    return final
