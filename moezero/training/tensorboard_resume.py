"""A resumed run's TensorBoard folder shows each step once: the events a run logged after the checkpoint it
resumes from are removed before the new run logs them again.

TensorBoard's own mechanism (`SummaryWriter(purge_step=N)`, a session-start event) drops every event at step
>= N of *every* tag, which would also drop the '<tag> vs samples' series (stepped by consumed samples, so far
above N) back to sample N. Instead the event files are rewritten: iteration-stepped events after the resumed
iteration and sample-stepped ones after its consumed samples are left out, everything else (the file header,
text, hparams) is kept, and each file is replaced atomically. Megatron leaves the duplicates.
"""
from __future__ import annotations

import os
from typing import List

VS_SAMPLES = " vs samples"


def trim_after(log_dir: str, iteration: int, consumed_samples: int) -> List[str]:
    """Rank 0, before its writer opens `log_dir`: drop the events logged after (iteration, consumed_samples);
    returns the files rewritten."""
    if not os.path.isdir(log_dir):
        return []
    rewritten = []
    for name in sorted(os.listdir(log_dir)):
        path = os.path.join(log_dir, name)
        if "tfevents" in name and os.path.isfile(path) and _trim_file(path, iteration, consumed_samples):
            rewritten.append(path)
    return rewritten


def _trim_file(path: str, iteration: int, consumed_samples: int) -> bool:
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    records = list(RawEventFileLoader(path).Load())
    kept = [r for r in records if not _after(Event.FromString(r), iteration, consumed_samples)]
    if len(kept) == len(records):
        return False
    partial = path + ".trim"
    with open(partial, "wb") as f:
        writer = RecordWriter(f)
        for record in kept:
            writer.write(record)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    return True


def _after(event, iteration: int, consumed_samples: int) -> bool:
    """A scalar event logged after the resume point (its tag says which counter its step is)."""
    values = event.summary.value if event.HasField("summary") else ()
    if not values:
        return False
    limit = consumed_samples if values[0].tag.endswith(VS_SAMPLES) else iteration
    return event.step > limit
