"""Language-model loss of a model on the first N samples of a dataset, on any number of ranks.

Micro-batch k holds samples [k * m, (k + 1) * m); rank r runs micro-batches r, r + W, ... Ranks
with fewer run a weightless repeat so every rank makes the same number of forwards (each MoE
forward is a collective under expert parallelism). Token losses are summed in fp64 and
all-reduced, so the result is the mean over the same tokens for any world size or ep.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from moezero.config import DataConfig
from moezero.data import build_datasets, load_micro_batch
from moezero.parallel import ParallelGroups, comm


def eval_dataset(data: DataConfig, seq_length: int, seed: int, num_samples: int):
    """The validation split (the test split when the validation split is empty), `num_samples` long."""
    split = 1 if data.split_weights[1] > 0 else 2
    sizes = [0, 0, 0]
    sizes[split] = num_samples
    datasets = build_datasets(data, seq_length, seed, num_samples=tuple(sizes))
    return datasets.valid if split == 1 else datasets.test


def rank_micro_batches(num_samples: int, micro_batch_size: int, rank: int, world: int) -> List[Tuple[List[int], float]]:
    """(sample indices, weight) of this rank's micro-batches; weight 0 marks a padding repeat."""
    starts = list(range(0, num_samples, micro_batch_size))
    mine = starts[rank::world]
    steps = math.ceil(len(starts) / world)
    out = [(list(range(s, min(s + micro_batch_size, num_samples))), 1.0) for s in mine]
    while len(out) < steps:
        out.append((list(range(0, min(micro_batch_size, num_samples))), 0.0))
    return out


@torch.no_grad()
def lm_loss(model, dataset, num_samples: int, micro_batch_size: int, groups: Optional[ParallelGroups] = None) -> float:
    """Mean token cross-entropy over samples [0, num_samples) (a collective over groups.dp)."""
    groups = groups or ParallelGroups.single()
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)  # loss sum, token count
    for indices, weight in rank_micro_batches(num_samples, micro_batch_size, groups.rank, groups.world_size):
        batch = load_micro_batch(dataset, indices)
        logits, _ = model(batch["tokens"])
        losses = F.cross_entropy(
            logits.double().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), reduction="none"
        )
        mask = batch["loss_mask"].reshape(-1).double()
        totals += weight * torch.stack([(losses * mask).sum(), mask.sum()]).cpu()
    comm.all_reduce(totals, groups.dp)
    return float(totals[0] / totals[1].clamp(min=1.0))
