"""Console lines in Megatron's format and TensorBoard scalars; a null logger on non-writing ranks.

Metrics are reduced on every rank before they get here; only the writing is rank 0's.
"""
from __future__ import annotations

import sys
import time
from typing import Dict, Optional


class MetricsLogger:
    """Writes nothing (every rank but 0)."""

    def log(self, metrics: Dict[str, float], step: int) -> None:
        pass

    def print(self, line: str) -> None:
        pass

    def close(self) -> None:
        pass


class Rank0Logger(MetricsLogger):
    """Console to stdout, scalars to TensorBoard when a directory is given."""

    def __init__(self, tensorboard_dir: Optional[str]):
        self.writer = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir)

    def log(self, metrics: Dict[str, float], step: int) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)

    def print(self, line: str) -> None:
        print(line, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


def build_logger(rank: int, tensorboard_dir: Optional[str]) -> MetricsLogger:
    return Rank0Logger(tensorboard_dir) if rank == 0 else MetricsLogger()


def format_train_line(iteration: int, train_iters: int, metrics: Dict[str, float], eta_s: float) -> str:
    """Megatron-style: ' iteration   10/ 100 | consumed samples: ... | lm loss: ... |'."""
    width = len(str(train_iters))
    parts = [
        f" iteration {iteration:>{width}}/{train_iters:>{width}}",
        f"consumed samples: {int(metrics['consumed_samples']):>8}",
        f"elapsed time per iteration (ms): {metrics['step_time_s'] * 1000:.1f}",
        f"learning rate: {metrics['lr']:.6E}",
        f"global batch size: {int(metrics['global_batch_size']):>4}",
        f"lm loss: {metrics['lm_loss']:.6E}",
        f"aux loss: {metrics['aux_loss']:.4E}",
        f"z loss: {metrics['z_loss']:.4E}",
        f"grad norm: {metrics['grad_norm']:.4f}",
    ]
    if "loss_scale" in metrics:
        parts.append(f"loss scale: {metrics['loss_scale']:.1f}")
    parts += [
        f"tokens/s: {metrics['tokens_per_s']:.0f}",
        f"skipped iterations: {int(metrics['skipped_iterations'])}",
        f"ETA: {format_duration(eta_s)}",
    ]
    return " | ".join(parts) + " |"


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Timer:
    def __init__(self):
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def warn(message: str) -> None:
    print(f"WARNING: {message}", file=sys.stderr, flush=True)
