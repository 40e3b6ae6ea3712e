"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to min_lr (Megatron's).

A run counts iterations, or samples with --train-samples (Megatron's sample-based schedule: every
iteration advances the schedule by --global-batch-size samples).
"""
from __future__ import annotations

import math
from typing import Tuple


def schedule_lengths(config) -> Tuple[int, float, float]:
    """(units one iteration advances, warmup length, decay length), in iterations or in samples."""
    if config.train_samples is not None:
        unit, decay, warmup = config.global_batch_size, config.lr_decay_samples or config.train_samples, \
            config.lr_warmup_samples or 0
    else:
        unit, decay, warmup = 1, config.lr_decay_iters or config.train_iters, config.lr_warmup_iters or 0
    if config.lr_warmup_fraction is not None:
        warmup = config.lr_warmup_fraction * decay
    return unit, warmup, decay


def learning_rate(iteration: int, config) -> float:
    """The lr of optimizer step `iteration` (0-based) under a `TrainConfig`."""
    unit, warmup, decay = schedule_lengths(config)
    position = iteration * unit
    if warmup > 0 and position < warmup:
        return config.lr * min(1.0, (position + unit) / warmup)
    if config.lr_decay_style == "constant":
        return config.lr
    span = max(decay - warmup, 1)
    ratio = min(max((position - warmup) / span, 0.0), 1.0)
    if config.lr_decay_style == "linear":
        coefficient = 1.0 - ratio
    else:
        coefficient = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return config.min_lr + (config.lr - config.min_lr) * coefficient
