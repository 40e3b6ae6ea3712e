"""Console lines in Megatron's format, TensorBoard scalars and a Weights & Biases run; a null logger on
non-writing ranks.

Metrics are reduced on every rank before they get here; only the writing is rank 0's (Megatron writes W&B
from its last rank: the values are the same). Labels, formats and tags come from `moezero.metrics`.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

import torch.distributed as dist

from moezero.config import ConfigError
from moezero.metrics import console_fields
from moezero.training.tensorboard_resume import trim_after


class NullLogger:
    """Writes nothing (every rank but 0)."""

    def log(self, scalars: Dict[str, float], step: int) -> None:
        pass

    def log_vs_samples(self, scalars: Dict[str, float], consumed_samples: int) -> None:
        pass

    def print(self, line: str) -> None:
        pass

    def log_run_config(self, flags: Mapping[str, Any], metric_tags: Iterable[str]) -> None:
        pass

    def event_files(self) -> Tuple[str, ...]:
        return ()

    def close(self) -> None:
        pass


class WandbRun:
    """A Weights & Biases run that gets the scalars TensorBoard gets at iteration steps (Megatron's wandb_writer:
    --wandb-project, --wandb-exp-name, --wandb-save-dir, --wandb-entity; the run's flags as its config).
    WANDB_MODE=offline writes it to local files only (`wandb sync` uploads them later)."""

    def __init__(
        self, project: str, name: Optional[str], save_dir: str, entity: Optional[str], config: Mapping[str, Any]
    ):
        try:
            import wandb
        except ImportError:
            raise ConfigError("--wandb-project: needs the wandb package (pip install wandb)") from None
        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(
            dir=save_dir,
            project=project,
            name=name,
            entity=entity,
            config={k: v if isinstance(v, (bool, int, float, str, type(None))) else str(v) for k, v in config.items()},
        )

    def log(self, scalars: Dict[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        """Finish the run and, unless the process holds other W&B runs, wait for W&B's service to write it out:
        `finish()` only asks the service to close the run file, and a process that ends without the atexit hook
        (a multiprocessing child) or reads the file at once would find it incomplete."""
        import wandb

        self.run.finish()
        if wandb.run is None:
            wandb.teardown()


class TensorBoardLogger:
    """Console lines to stdout; scalars ({tag: value}) to TensorBoard when a directory is given, and to a W&B
    run when one is given (iteration-stepped scalars only: a W&B run's steps only go forward)."""

    def __init__(
        self,
        tensorboard_dir: Optional[str],
        wandb: Optional[WandbRun] = None,
        resumed_at: Optional[Tuple[int, int]] = None,
        queue_size: int = 1000,
        own_event_files: Optional[Sequence[str]] = None,
    ):
        """`resumed_at`: (iteration, consumed samples) of the checkpoint a resume starts from: what its run's event
        files (`own_event_files`, the names the checkpoint recorded) hold after it is dropped first, so each step
        shows once (tensorboard_resume.py)."""
        self.writer, self.wandb = None, wandb
        self._lineage: Tuple[str, ...] = tuple(own_event_files or ()) if resumed_at is not None else ()
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            if resumed_at is not None:
                for line in trim_after(tensorboard_dir, *resumed_at, own_event_files):
                    self.print(line)
            self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=queue_size)
            path = getattr(self.writer.file_writer.event_writer, "_file_name", None) or tensorboard_dir
            if os.path.isfile(path):
                self._lineage += (os.path.basename(path),)
            self.print(f" TensorBoard: events to {path} (view: tensorboard --logdir {tensorboard_dir})")

    def log(self, scalars: Dict[str, float], step: int) -> None:
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
        if self.wandb is not None and scalars:
            self.wandb.log(scalars, step)

    def log_vs_samples(self, scalars: Dict[str, float], consumed_samples: int) -> None:
        """Megatron's '<tag> vs samples' series (TensorBoard only, as in Megatron)."""
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, consumed_samples)

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

    def event_files(self) -> Tuple[str, ...]:
        """The names of the event files this run and the runs it resumed from wrote (what its checkpoints record)."""
        return self._lineage

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()


Logger = Union[NullLogger, TensorBoardLogger]


def build_logger(
    rank: int,
    train,
    save_dir: Optional[str],
    flags: Mapping[str, Any],
    resumed_at: Optional[Tuple[int, int]] = None,
    own_event_files: Optional[Sequence[str]] = None,
) -> Logger:
    """Rank 0's logger for a `TrainConfig` (TensorBoard, W&B under --wandb-save-dir or <save_dir>/wandb);
    `resumed_at`, `own_event_files`: see TensorBoardLogger."""
    if rank != 0:
        return NullLogger()
    wandb = None
    if train.wandb_project:
        wandb = WandbRun(
            train.wandb_project,
            train.wandb_exp_name,
            train.wandb_save_dir or os.path.join(save_dir, "wandb"),
            train.wandb_entity,
            flags,
        )
    return TensorBoardLogger(train.tensorboard_dir, wandb, resumed_at, train.tensorboard_queue_size, own_event_files)


def agreed_event_files(logger: Logger, group, source: int = 0) -> Tuple[str, ...]:
    """Collective over `group` (every rank): the logging rank's `event_files()` (`source`, its rank in `group`),
    which a checkpoint records. Every rank writes the same train state (DCP keeps one rank's copy of it), so every
    rank must hold the logging rank's names."""
    files = [logger.event_files()]
    if dist.is_initialized() and group is not None and dist.get_world_size(group) > 1:
        dist.broadcast_object_list(files, src=dist.get_global_rank(group, source), group=group)
    return tuple(files[0])


def format_train_line(
    iteration: int, train_iters: int, values: Mapping[str, float], eta_s: float, now: Optional[datetime.datetime] = None
) -> str:
    """Megatron's training_log line, ' [2026-12-02 08:00:37.123456] iteration       10/     100 | consumed
    samples: ... | lm loss: ... |', with moezero's fields after Megatron's, ETA last."""
    stamp = (now or datetime.datetime.now()).strftime("%Y-%m-%d %H:%M:%S.%f")
    parts = [
        f" [{stamp}] iteration {iteration:8d}/{train_iters:8d}",
        *console_fields(values),
        f"ETA: {format_duration(eta_s)}",
    ]
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
