"""Training checkpoints: the one owner of their format (DCP keys, train state, consolidation).

save_checkpoint(root, iteration, model, opt, run_state, group)   # collective, atomic
train_state = load_checkpoint(path, model, opt, group)           # collective, any layout
CheckpointError                                                  # missing, damaged: one line naming the file
read_train_state(path); consolidate_checkpoint(path)             # one process, offline
CheckpointReader(path).read(name, lo, hi)                        # one process, a range at a time
save_read_checkpoint(root, 0, ranges, read, buffers, train_state)  # one process, a piece at a time
"""

from moezero.checkpoint.errors import CheckpointError
from moezero.checkpoint.layout import (
    POINTER,
    check_writable,
    iteration_dir,
    latest_iteration,
    resolve_checkpoint,
    saved_iterations,
    unfinished_saves,
)
from moezero.checkpoint.store import (
    CheckpointReader,
    consolidate_checkpoint,
    load_checkpoint,
    read_train_state,
    save_checkpoint,
    save_read_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "POINTER",
    "check_writable",
    "iteration_dir",
    "latest_iteration",
    "resolve_checkpoint",
    "saved_iterations",
    "unfinished_saves",
    "save_checkpoint",
    "save_read_checkpoint",
    "load_checkpoint",
    "read_train_state",
    "consolidate_checkpoint",
]
