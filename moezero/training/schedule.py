"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to min_lr (Megatron's).

Megatron's scheduler counts samples: a --train-samples run's warmup and decay are given in samples,
an iteration-based run's in iterations of --global-batch-size samples, and every step advances the
schedule by the samples it consumed (its own batch size along a batch-size ramp).
"""
from __future__ import annotations

import math
from typing import Tuple


def schedule_lengths(config) -> Tuple[float, float]:
    """(warmup, decay) lengths in samples."""
    if config.train_samples is not None:
        decay, warmup = config.lr_decay_samples or config.train_samples, config.lr_warmup_samples or 0
    else:
        per_iteration = config.global_batch_size
        decay = (config.lr_decay_iters or config.train_iters) * per_iteration
        warmup = (config.lr_warmup_iters or 0) * per_iteration
    if config.lr_warmup_fraction is not None:
        warmup = config.lr_warmup_fraction * decay
    return warmup, decay


def learning_rate(consumed_samples: int, batch_size: int, config) -> float:
    """The lr of the optimizer step that starts after `consumed_samples` and consumes `batch_size` more,
    under a `TrainConfig` (warmup reaches the step's end: the first step does not run at lr 0)."""
    warmup, decay = schedule_lengths(config)
    if warmup > 0 and consumed_samples < warmup:
        start = config.lr_warmup_init
        return start + (config.lr - start) * min(1.0, (consumed_samples + batch_size) / warmup)
    if config.lr_decay_style == "constant":
        return config.lr
    span = max(decay - warmup, 1)
    ratio = min(max((consumed_samples - warmup) / span, 0.0), 1.0)
    if config.lr_decay_style == "linear":
        coefficient = 1.0 - ratio
    else:
        coefficient = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return config.min_lr + (config.lr - config.min_lr) * coefficient
