"""What the console line reports: Megatron's training_log averages over the iterations since the last line.

    interval = LogInterval()
    interval.add(step_time, losses, stepped)     # every iteration
    values = interval.summary(); interval.reset()   # at a console line

The losses (lm loss and the MoE losses under the names Megatron's tracker gives them) are averaged over the
iterations that stepped; the time per iteration over all of them; skipped iterations are counted, and those
whose loss was not finite are also "nan iterations" (Megatron's counts, reset at each line).
"""

from __future__ import annotations

import math
from typing import Dict, Set


class LogInterval:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.loss_sums: Dict[str, float] = {}
        self.loss_names: Set[str] = set()  # of every step, skipped ones too
        self.elapsed_s = 0.0
        self.advanced = self.skipped = self.nan = 0

    def add(self, step_time_s: float, losses: Dict[str, float], stepped: bool) -> None:
        self.elapsed_s += step_time_s
        self.loss_names.update(losses)
        if stepped:
            self.advanced += 1
            for name, value in losses.items():
                self.loss_sums[name] = self.loss_sums.get(name, 0.0) + value
        else:
            self.skipped += 1
            self.nan += int(not all(math.isfinite(v) for v in losses.values()))

    def summary(self) -> Dict[str, float]:
        """{metric name: value} for the console line (names of moezero.metrics); a loss only where a step of the
        interval was taken (Megatron's line has none when every step was skipped)."""
        iterations = max(self.advanced + self.skipped, 1)
        values = {name: total / max(self.advanced, 1) for name, total in self.loss_sums.items()}
        values.update(
            step_time_ms=self.elapsed_s / iterations * 1000, skipped_iterations=self.skipped, nan_iterations=self.nan
        )
        return values
