"""Which global samples each rank reads at each micro-step: Megatron's pretraining-sampler order.

Pure functions of (consumed samples, batch sizes, data-parallel rank and size); no process group.

Step `it` reads global samples [consumed, consumed + global_batch), consumed = it * global_batch.
That range is cut into micro-batches of `micro_batch` consecutive indices, numbered m = 0, 1, ...
Rank r of dp runs micro-steps j = 0 .. global_batch / (micro_batch * dp) - 1 and reads micro-batch
m = j * dp + r. Every layout therefore forms the same micro-batches from the same samples (one
process simply runs more accumulation steps), which layout invariance needs; see DESIGN.md.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

import torch

from moezero.config import ConfigError


def num_micro_steps(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Gradient-accumulation steps per optimizer step; ConfigError unless the sizes divide evenly."""
    if min(global_batch_size, micro_batch_size, dp_size) < 1:
        raise ConfigError(
            f"--global-batch-size ({global_batch_size}), --micro-batch-size ({micro_batch_size}) "
            f"and the data-parallel world size ({dp_size}) must all be >= 1"
        )
    if global_batch_size % (micro_batch_size * dp_size):
        raise ConfigError(
            f"--global-batch-size ({global_batch_size}) must be divisible by --micro-batch-size "
            f"({micro_batch_size}) x the data-parallel world size ({dp_size}) = "
            f"{micro_batch_size * dp_size}"
        )
    return global_batch_size // (micro_batch_size * dp_size)


def micro_batch_indices(
    consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> List[List[int]]:
    """Global sample indices of each micro-step of one step for one rank (outer list: micro-steps)."""
    steps = num_micro_steps(global_batch_size, micro_batch_size, dp_size)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
    batches = []
    for j in range(steps):
        start = consumed_samples + (j * dp_size + dp_rank) * micro_batch_size
        batches.append(list(range(start, start + micro_batch_size)))
    return batches


def train_micro_batches(
    iteration: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> List[List[int]]:
    """Micro-batches of training step `iteration` (0-based; no batch-size ramp-up)."""
    return micro_batch_indices(iteration * global_batch_size, global_batch_size, micro_batch_size, dp_rank, dp_size)


def eval_micro_batches(
    eval_iters: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    consumed_samples: int = 0,
) -> List[List[int]]:
    """Micro-batches of one evaluation: `eval_iters` global batches from sample `consumed_samples` on
    (Megatron's: each validation reads the next samples; the test evaluation reads from 0).

    Every rank runs the same number of micro-steps (they are collectives under EP).
    """
    return [
        mb
        for k in range(eval_iters)
        for mb in micro_batch_indices(
            consumed_samples + k * global_batch_size, global_batch_size, micro_batch_size, dp_rank, dp_size
        )
    ]


def collate(samples: Sequence[Mapping[str, torch.Tensor]], indices: Sequence[int]) -> Dict[str, torch.Tensor]:
    """Stack samples into a batch: tokens/labels [B, S] long, loss_mask [B, S] float, and
    sample_index [B] long, the global indices that key the model's dropout randomness."""
    batch = {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask")}
    batch["sample_index"] = torch.tensor(list(indices), dtype=torch.long)
    return batch


def load_micro_batch(dataset, indices: Sequence[int]) -> Dict[str, torch.Tensor]:
    """Read `dataset[i]` for each global index and collate them."""
    return collate([dataset[i] for i in indices], indices)
