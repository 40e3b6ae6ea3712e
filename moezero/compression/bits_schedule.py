"""The QAT bit schedule as a pure function of the optimizer step.

MoQ-style (DeepSpeed's "Mixture of Quantization"): train `offset` steps in full precision, then
quantize with `start` bits and drop one bit every `period` steps until `target` bits, which are
kept to the end. Dropping bits gradually lets the weights adapt to each coarser grid in turn.
(DeepSpeed doubles the period after each drop; a fixed period is easier to reason about and to
set from a run's length.)
"""

from __future__ import annotations

from typing import Optional


def bits_at(step: int, start: int, target: int, period: int, offset: int) -> Optional[int]:
    """Bits of the weights used in the forward of step `step` (0-based count of optimizer steps done).

    None before `offset` (full precision); then start, start - 1, ... every `period` steps, never
    below `target`.
    """
    if step < offset:
        return None
    return max(target, start - (step - offset) // period)
