"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to min_lr (Megatron's)."""
from __future__ import annotations

import math

from moezero.config import TrainConfig


def learning_rate(iteration: int, config: TrainConfig) -> float:
    """The lr of optimizer step `iteration` (0-based)."""
    if config.lr_warmup_iters > 0 and iteration < config.lr_warmup_iters:
        return config.lr * (iteration + 1) / config.lr_warmup_iters
    if config.lr_decay_style == "constant":
        return config.lr
    decay_iters = config.lr_decay_iters or config.train_iters
    span = max(decay_iters - config.lr_warmup_iters, 1)
    ratio = min(max((iteration - config.lr_warmup_iters) / span, 0.0), 1.0)
    if config.lr_decay_style == "linear":
        coefficient = 1.0 - ratio
    else:
        coefficient = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return config.min_lr + (config.lr - config.min_lr) * coefficient
