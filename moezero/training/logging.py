"""Console lines in Megatron's format and TensorBoard scalars; a null logger on non-writing ranks.

Metrics are reduced on every rank before they get here; only the writing is rank 0's. Labels, formats
and tags come from `moezero.metrics`.
"""
from __future__ import annotations

import datetime
import time
from typing import Any, Dict, Iterable, Mapping, Optional, Union

from moezero.metrics import console_fields


class NullLogger:
    """Writes nothing (every rank but 0)."""

    def log(self, scalars: Dict[str, float], step: int) -> None:
        pass

    def print(self, line: str) -> None:
        pass

    def log_run_config(self, flags: Mapping[str, Any], metric_tags: Iterable[str]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Console lines to stdout; scalars ({tag: value}) to TensorBoard when a directory is given."""

    def __init__(self, tensorboard_dir: Optional[str]):
        self.writer = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir)

    def log(self, scalars: Dict[str, float], step: int) -> None:
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)

    def print(self, line: str) -> None:
        print(line, flush=True)

    def log_run_config(self, flags: Mapping[str, Any], metric_tags: Iterable[str]) -> None:
        """The run's flags as a text table ("arguments") and as hparams, next to `metric_tags`."""
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        rows = "\n".join(f"| {flag} | {value} |" for flag, value in flags.items())
        self.writer.add_text("arguments", "| flag | value |\n|---|---|\n" + rows, 0)
        values = {flag: v if isinstance(v, (bool, int, float, str)) else str(v) for flag, v in flags.items()}
        for summary in hparams(values, {tag: 0.0 for tag in metric_tags}):
            self.writer.file_writer.add_summary(summary)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


Logger = Union[NullLogger, TensorBoardLogger]


def build_logger(rank: int, tensorboard_dir: Optional[str]) -> Logger:
    return TensorBoardLogger(tensorboard_dir) if rank == 0 else NullLogger()


def format_train_line(iteration: int, train_iters: int, values: Mapping[str, float], eta_s: float,
                      now: Optional[datetime.datetime] = None) -> str:
    """Megatron's training_log line, ' [2026-12-02 08:00:37.123456] iteration       10/     100 | consumed
    samples: ... | lm loss: ... |', with moezero's fields after Megatron's, ETA last."""
    stamp = (now or datetime.datetime.now()).strftime("%Y-%m-%d %H:%M:%S.%f")
    parts = [f" [{stamp}] iteration {iteration:8d}/{train_iters:8d}", *console_fields(values),
             f"ETA: {format_duration(eta_s)}"]
    return " | ".join(parts) + " |"


def format_validation_line(iteration: int, values: Mapping[str, float], split: str = "") -> str:
    """Megatron-style, framed by dashes: ' validation loss at iteration 50 | lm loss value: ... |'
    (' ... at iteration 50 on test set | ...' for the test split)."""
    where = f" on {split} set" if split else ""
    line = " | ".join([f" validation loss at iteration {iteration}{where}", *console_fields(values)]) + " |"
    bar = "-" * len(line)
    return f"{bar}\n{line}\n{bar}"


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Timer:
    def __init__(self):
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
