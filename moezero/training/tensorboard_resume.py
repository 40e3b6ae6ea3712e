"""A resumed run's TensorBoard folder shows each step once: the events its own run logged after the checkpoint it
resumes from are removed before the new run logs them again.

TensorBoard's own mechanism (`SummaryWriter(purge_step=N)`, a session-start event) drops every event at step
>= N of *every* tag, which would also drop the '<tag> vs samples' series (stepped by consumed samples, so far
above N) back to sample N. Instead the event files are rewritten: iteration-stepped events after the resumed
iteration and sample-stepped ones after its consumed samples are left out, everything else (the file header,
text, hparams) is kept, and each file is replaced atomically. Megatron leaves the duplicates.

Only the event files of the run's own lineage are rewritten: each checkpoint records the names of the files
its run and the runs it resumed from wrote (`run_event_files`), and a file of another run that logs to the same
folder (another job, the demo and the example script) is never touched. Each file rewritten is said in a line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

VS_SAMPLES = " vs samples"


@dataclass(frozen=True)
class Dropped:
    """What a rewrite left out of one event file."""

    path: str
    events: int
    first_step: Optional[int]  # the iteration-stepped events' steps (None: only 'vs samples' ones)
    last_step: Optional[int]

    def line(self, iteration: int) -> str:
        steps = f" (steps {self.first_step}-{self.last_step})" if self.first_step is not None else ""
        return (
            f" TensorBoard: dropped {self.events} events logged after iteration {iteration}{steps} from "
            f"{self.path}, which this run logs again"
        )


def trim_after(log_dir: str, iteration: int, consumed_samples: int, own_files: Optional[Sequence[str]]) -> List[str]:
    """Rank 0, before its writer opens `log_dir`: drop the events logged after (iteration, consumed_samples) from
    the files named in `own_files` (the event files the checkpoint's lineage wrote; None: the checkpoint recorded
    none, it was saved before they were); returns the lines to print, one per file rewritten."""
    if not os.path.isdir(log_dir):
        return []
    present = sorted(
        name for name in os.listdir(log_dir) if "tfevents" in name and os.path.isfile(os.path.join(log_dir, name))
    )
    if own_files is None:
        return (
            [
                f" TensorBoard: the checkpoint does not record which event files in {log_dir} its run wrote (saved "
                f"before moezero recorded them): none is rewritten, steps after iteration {iteration} may show "
                "twice"
            ]
            if present
            else []
        )
    lines = []
    for name in sorted(set(own_files) & set(present)):
        dropped = _trim_file(os.path.join(log_dir, name), iteration, consumed_samples)
        if dropped is not None:
            lines.append(dropped.line(iteration))
    return lines


def _trim_file(path: str, iteration: int, consumed_samples: int) -> Optional[Dropped]:
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    records = list(RawEventFileLoader(path).Load())
    kept, dropped_steps, dropped = [], [], 0
    for record in records:
        event = Event.FromString(record)
        after = _after(event, iteration, consumed_samples)
        if after is None:
            kept.append(record)
            continue
        dropped += 1
        if after == "iteration":
            dropped_steps.append(event.step)
    if not dropped:
        return None
    partial = path + ".trim"
    with open(partial, "wb") as f:
        writer = RecordWriter(f)
        for record in kept:
            writer.write(record)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    return Dropped(path, dropped, min(dropped_steps, default=None), max(dropped_steps, default=None))


def _after(event, iteration: int, consumed_samples: int) -> Optional[str]:
    """For a scalar event logged after the resume point, the counter its step is ('iteration' or 'samples', its tag
    says which); None for any other event."""
    values = event.summary.value if event.HasField("summary") else ()
    if not values:
        return None
    if values[0].tag.endswith(VS_SAMPLES):
        return "samples" if event.step > consumed_samples else None
    return "iteration" if event.step > iteration else None
