"""The global batch size as a run goes: constant, Megatron's ramp-up, or a step schedule.

    schedule = BatchSchedule.from_config(train_config, seq_length)
    size = schedule.batch_size(consumed_samples)      # the batch of the step that starts there

Both ramps are functions of the samples consumed so far (not of the iteration), so a run resumed with
another batch size, or a ramp, continues from the samples its checkpoint consumed:
  --rampup-batch-size START INCREMENT SAMPLES   START, START + INCREMENT, ... up to --global-batch-size,
      each size for SAMPLES / increments samples (Megatron's RampupBatchsizeNumMicroBatches);
  --step-batch-size-schedule "0:16 2.4B:320 ..."  from each threshold on, that size; thresholds count
      tokens (divided by --seq-length into samples, as Megatron does), with K/M/B/T suffixes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_number(text: str) -> int:
    """'2.4B' -> 2_400_000_000 (Megatron's suffixes K, M, B, T)."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def parse_step_schedule(text: str, seq_length: int) -> List[Tuple[int, int]]:
    """[(from consumed samples, batch size), ...] of a step schedule, ascending; ValueError if malformed."""
    steps = []
    for entry in text.replace(",", " ").split():
        threshold, _, size = entry.partition(":")
        if not size:
            raise ValueError(f"'{entry}' is not THRESHOLD:BATCH_SIZE")
        steps.append((parse_number(threshold) // seq_length, parse_number(size)))
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ValueError("the first threshold must be 0")
    if any(a[0] == b[0] for a, b in zip(steps, steps[1:])) or any(size < 1 for _, size in steps):
        raise ValueError("thresholds must differ and batch sizes be >= 1")
    return steps


def rampup_steps(start: int, increment: int, samples: int, final: int) -> List[Tuple[int, int]]:
    """Megatron's ramp-up as steps: size start + k * increment while int(consumed / (samples / increments))
    is k, and `final` beyond `samples` (thresholds found from Megatron's float formula, so they agree)."""
    increments = (final - start) // increment
    if increments < 1 or samples == 0:
        return [(0, final)]
    per_increment = samples / increments

    def first_consumed_of(k: int) -> int:
        consumed = math.ceil(k * per_increment)
        while consumed > 0 and int((consumed - 1) / per_increment) >= k:
            consumed -= 1
        while int(consumed / per_increment) < k:
            consumed += 1
        return consumed

    steps = [(first_consumed_of(k), start + k * increment) for k in range(increments + 1)]
    return [(c, size) for c, size in steps if c <= samples] + [(samples + 1, final)]


@dataclass(frozen=True)
class BatchSchedule:
    steps: Tuple[Tuple[int, int], ...]  # (from consumed samples, global batch size), ascending from 0
    ramp_samples: Optional[int] = None  # --rampup-batch-size's SAMPLES (Megatron counts a ramp's steps by it)

    @classmethod
    def from_config(cls, t, seq_length: int) -> "BatchSchedule":
        if t.step_batch_size_schedule:
            return cls(tuple(parse_step_schedule(t.step_batch_size_schedule, seq_length)))
        if t.rampup_batch_size:
            return cls(tuple(rampup_steps(*t.rampup_batch_size, t.global_batch_size)), t.rampup_batch_size[2])
        return cls(((0, t.global_batch_size),))

    def batch_size(self, consumed_samples: int) -> int:
        size = self.steps[0][1]
        for threshold, step_size in self.steps:
            if consumed_samples < threshold:
                break
            size = step_size
        return size

    def sizes_from(self, consumed_samples: int) -> List[int]:
        """The batch sizes a run that has consumed `consumed_samples` still meets (Megatron checks only those:
        a run resumed on more ranks may have passed sizes its layout cannot split)."""
        return sorted(
            {self.batch_size(consumed_samples)}
            | {size for threshold, size in self.steps if threshold > consumed_samples}
        )

    @property
    def final(self) -> int:
        return self.steps[-1][1]

    @property
    def is_constant(self) -> bool:
        return len(self.steps) == 1

    def consumed_after(self, consumed_samples: int, iterations: int) -> int:
        """Samples consumed after `iterations` more steps from `consumed_samples`."""
        for _ in range(iterations):
            consumed_samples += self.batch_size(consumed_samples)
        return consumed_samples

    def iterations_between(self, consumed_samples: int, target_samples: int) -> int:
        """Steps a --train-samples run takes from `consumed_samples` to `target_samples` (Megatron's count:
        whole batches with a constant size; along --rampup-batch-size, 0.16.1's update_train_iters: steps while
        the consumed samples are <= the ramp's and the target, then whole final batches, a partial last one
        thrown away; along a step schedule, steps until reaching the target)."""
        if self.is_constant:
            return max(target_samples - consumed_samples, 0) // self.final
        iterations = 0
        if self.ramp_samples is not None:
            while consumed_samples <= self.ramp_samples and consumed_samples <= target_samples:
                consumed_samples += self.batch_size(consumed_samples)
                iterations += 1
            return iterations + max(target_samples - consumed_samples, 0) // self.final
        while consumed_samples < target_samples:
            consumed_samples += self.batch_size(consumed_samples)
            iterations += 1
        return iterations
