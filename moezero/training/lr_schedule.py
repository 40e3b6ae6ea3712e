"""Learning-rate schedule: Megatron's OptimizerParamScheduler, counted in samples.

    schedule = LearningRateSchedule.from_config(cfg.train)
    lr = schedule.lr(num_steps)          # num_steps: samples the schedule has advanced before this step
    lr = schedule.lr(num_steps, group.get("max_lr"), group.get("min_lr"))   # a param group's (--decoupled-lr)
    wd = schedule.weight_decay_at(num_steps)   # the decayed params' (--weight-decay-incr-style)
    num_steps += batch_size              # after a step that was taken (a skipped step does not advance it)

Megatron's scheduler counts samples: a --train-samples run's warmup and decay are given in samples, an
iteration-based run's in iterations of --global-batch-size samples, and each successful step advances it by the
samples that step consumed. Its first step runs at --lr-warmup-init (num_steps 0), the step that ends the warmup
at --lr. A checkpoint records the schedule (`state`); a resume whose command line gives another schedule is
refused unless --override-opt_param-scheduler (the command line's) or --use-checkpoint-opt_param-scheduler (the
checkpoint's) says which to keep (`resumed_schedule`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from moezero.config import ConfigError

_WSD_COEFFICIENT = {
    "linear": lambda r: 1.0 - r,
    "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
    "exponential": lambda r: 2.0 * 0.5**r - 1.0,
    "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
}


@dataclass(frozen=True)
class LearningRateSchedule:
    """Warmup from `init_lr` to `max_lr` over `warmup` samples, then `style` down to `min_lr` at `decay`."""

    init_lr: float
    max_lr: float
    min_lr: float
    warmup: float
    decay: float
    style: str
    wsd_decay: Optional[float] = None  # WSD: the samples of the final anneal
    wsd_style: str = "exponential"
    weight_decay: float = 0.0  # of the decayed params (a group's wd_mult: 0 for biases and norms); the first
    decoupled_max_lr: Optional[float] = None  # --decoupled-lr: the embedding and output layer's groups' peak
    decoupled_min_lr: Optional[float] = None  # their final lr: --decoupled-min-lr, else --min-lr
    # --weight-decay-incr-style linear / cosine: from weight_decay to end_weight_decay over wd_incr samples
    wd_incr_style: str = "constant"
    end_weight_decay: Optional[float] = None
    wd_incr: float = 0.0

    # what a resume compares (Megatron's scheduler state, its start/end weight decay too), with the flags each
    # comes from. The WSD anneal is not in it: as in Megatron, a resume may choose it anew (deciding the anneal
    # late is what WSD is for)
    COMPARED = {
        "max_lr": "--lr",
        "min_lr": "--min-lr",
        "warmup": "the warmup (--lr-warmup-*)",
        "decay": "the decay length (--lr-decay-*, --train-iters / --train-samples)",
        "style": "--lr-decay-style",
        "weight_decay": "--weight-decay",
        "decoupled_max_lr": "--decoupled-lr",
        "decoupled_min_lr": "--decoupled-min-lr",
        "wd_incr_style": "--weight-decay-incr-style",
        "end_weight_decay": "--end-weight-decay",
        "wd_incr": "the weight-decay increment's length (--train-iters / --train-samples)",
    }

    @classmethod
    def from_config(cls, config) -> "LearningRateSchedule":
        """From a `TrainConfig` (Megatron's get_optimizer_param_scheduler)."""
        if config.train_samples is not None:
            decay = config.lr_decay_samples or config.train_samples
            warmup = config.lr_warmup_samples or 0
            wsd = config.lr_wsd_decay_samples
        else:
            per_iteration = config.global_batch_size
            decay = (config.lr_decay_iters or config.train_iters) * per_iteration
            warmup = (config.lr_warmup_iters or 0) * per_iteration
            wsd = config.lr_wsd_decay_iters * per_iteration if config.lr_wsd_decay_iters is not None else None
        if config.lr_warmup_fraction is not None:
            warmup = config.lr_warmup_fraction * decay
        increments = config.weight_decay_incr_style != "constant"
        wd_incr = (config.train_samples or config.train_iters * config.global_batch_size) if increments else 0.0
        return cls(
            config.lr_warmup_init,
            config.lr,
            config.min_lr,
            warmup,
            decay,
            config.lr_decay_style,
            wsd,
            config.lr_wsd_decay_style,
            config.start_weight_decay if increments else config.weight_decay,
            config.decoupled_lr,
            _decoupled_min_lr(config),
            config.weight_decay_incr_style,
            config.end_weight_decay if increments else None,
            wd_incr,
        )

    def lr(self, num_steps: float, max_lr: Optional[float] = None, min_lr: Optional[float] = None) -> float:
        """The learning rate of a step taken when the schedule has advanced `num_steps` samples; `max_lr` and
        `min_lr` override the schedule's for a param group (Megatron's param-group overrides: --decoupled-lr)."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup > 0 and num_steps <= self.warmup:
            return self.init_lr + (max_lr - self.init_lr) * num_steps / self.warmup
        if self.style == "constant":
            return max_lr
        if num_steps > self.decay:
            return min_lr
        if self.style == "inverse-square-root":
            return max(min_lr, max_lr * max(self.warmup, 1) ** 0.5 / max(num_steps, 1) ** 0.5)
        ratio = (num_steps - self.warmup) / (self.decay - self.warmup)
        if self.style == "linear":
            coefficient = 1.0 - ratio
        elif self.style == "cosine":
            coefficient = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: constant until the anneal's samples before the end, then the anneal
            anneal_start = self.decay - self.wsd_decay
            coefficient = (
                1.0
                if num_steps <= anneal_start
                else _WSD_COEFFICIENT[self.wsd_style]((num_steps - anneal_start) / self.wsd_decay)
            )
        return min_lr + coefficient * (max_lr - min_lr)

    def weight_decay_at(self, num_steps: float) -> float:
        """The decayed params' weight decay of a step taken at `num_steps` (Megatron's get_wd)."""
        if self.wd_incr_style == "constant":
            return self.weight_decay
        if num_steps > self.wd_incr:
            return self.end_weight_decay
        ratio = num_steps / self.wd_incr
        coefficient = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.weight_decay + coefficient * (self.end_weight_decay - self.weight_decay)

    def group_lr(self, num_steps: float, group: Dict[str, Any]) -> float:
        """A param group's learning rate: the groups --decoupled-lr made (they carry "max_lr") on this schedule's
        decoupled peak and final lr, not on the values a checkpoint's groups brought back."""
        if "max_lr" not in group or self.decoupled_max_lr is None:
            return self.lr(num_steps)
        group["max_lr"], group["min_lr"] = self.decoupled_max_lr, self.decoupled_min_lr
        return self.lr(num_steps, self.decoupled_max_lr, self.decoupled_min_lr)

    def state(self, num_steps: float) -> Dict[str, Any]:
        """What a checkpoint records: the schedule and where it stands."""
        return dict(dataclasses.asdict(self), num_steps=num_steps)

    def differences(self, saved: "LearningRateSchedule") -> List[str]:
        """'what: X in the checkpoint, Y now' for each compared value that differs."""
        named = dict(self.COMPARED)
        if self.wd_incr_style != "constant":  # the first weight decay is --start-weight-decay's then
            named["weight_decay"] = "--start-weight-decay"
        return [
            f"{what}: {_shown(getattr(saved, n))} in the checkpoint, {_shown(getattr(self, n))} now"
            for n, what in named.items()
            if getattr(saved, n) != getattr(self, n)
        ]


def _decoupled_min_lr(config) -> Optional[float]:
    """The decoupled groups' final lr as they run it: --decoupled-min-lr, else --min-lr (None without the groups)."""
    if config.decoupled_lr is None:
        return None
    return config.min_lr if config.decoupled_min_lr is None else config.decoupled_min_lr


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def resumed_schedule(
    current: LearningRateSchedule, saved: Dict[str, Any], override: bool, use_checkpoint: bool
) -> LearningRateSchedule:
    """The schedule a resume runs: the command line's if it equals the checkpoint's or with `override`
    (--override-opt_param-scheduler), the checkpoint's with `use_checkpoint`; else a ConfigError listing what
    differs (Megatron refuses the same way). --lr-warmup-init and the WSD anneal are the command line's, as in
    Megatron (its checkpoint does not record them)."""
    # a checkpoint saved before a value was recorded (the weight decay) is taken to have the command line's
    checkpoint = dataclasses.replace(current, **{n: saved[n] for n in current.COMPARED if n in saved})
    if override:
        return current
    if use_checkpoint:
        return checkpoint
    differences = current.differences(checkpoint)
    if differences:
        raise ConfigError(
            f"--load: the checkpoint's learning-rate schedule differs ({'; '.join(differences)}); "
            "give --override-opt_param-scheduler to take the command line's or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        )
    return current
