"""Gradients assigned by hand (`p.grad = g` before `step()`): external gradients from `torch.autograd.grad`,
gradient surgery. They are what the step uses for those params, as torch's optimizers use `.grad`.

Each rank's assigned tensor is its gradient for the param, as a backward's would be: the step averages it over
the data-parallel world (summed over the param's group, divided by the dp size). It replaces what the step held for
the param (at stages 1-3 the shard may already hold earlier backwards' sums), on every rank of the param's group
if any rank of it assigned one (a rank that assigned none adds zero, as a rank whose backward did not reach a param).
At stage 0, where `.grad` showed the averaged gradient, an assignment made from it is an average too (an expert's
is rescaled as stage 0 rescales what it showed, `AllReduceGrads.adopt_assigned`).

Collective, and only when some rank assigned a gradient (a bit on the step's agreement record says so): one
all-reduce of which params were assigned where (StepTotals' blocks), then one all-reduce per bucket that holds one.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

from moezero.parallel import comm
from moezero.zero.bucket import Bucket
from moezero.zero.step_totals import StepTotals
from moezero.zero.zero_param import ZeroParam

Assigned = Dict[int, Tuple[Bucket, ZeroParam, torch.Tensor]]  # id(record) -> (its bucket, record, gradient)


@torch.no_grad()
def reduce_assigned(assigned: Assigned, buckets: Sequence[Bucket], step_totals: StepTotals, scale: float) -> None:
    """Collective: the reduced gradient of every param assigned on some rank of its group becomes the average of
    the assigned tensors (`scale`: the fp16 loss scale the step divides by)."""
    anywhere = step_totals.marked_anywhere(set(assigned))
    for bucket in buckets:
        members = [zp for zp in bucket.members if id(zp) in anywhere]
        if not members:  # the same on every rank of the group
            continue
        family, strategy = bucket.family, bucket.strategy
        summed = torch.zeros(bucket.numel, dtype=strategy.reduce_dtype, device=family.device)
        factor = scale * strategy.assigned_scale(bucket)
        for zp in members:
            if id(zp) in assigned:
                lo, hi = zp.bucket_range((0, zp.slot.numel))
                summed[lo:hi] = assigned[id(zp)][2].detach().reshape(-1).to(summed.dtype) * factor
        comm.all_reduce(summed, family.group)
        start, stop = strategy.optimizer_range(bucket.index)
        reduced = strategy.reduced_grad(bucket)
        for zp in members:
            lo, hi = zp.bucket_range((0, zp.slot.numel))
            lo, hi = max(lo, start), min(hi, stop)
            if lo < hi:
                reduced[lo - start : hi - start] = summed[lo:hi] / strategy.dp_size
            zp.got_grad = True
        bucket.generation += 1
