"""TpPartialSums: the reduced gradients of "tp_partial" families, summed over the tensor-parallel group.

A tp_partial param is whole on every tp rank but each rank's backward gives its part of the gradient (a
row-parallel bias under sequence parallelism sees only the rank's sequence shard): the one-process gradient is the
sum over tp (Megatron all-reduces such params' gradients over tp in finalize_model_grads). The family reduces over
dp as any dense one; the sum over tp is taken once per step, on the reduced gradients (the dp average of the sum
over tp equals the sum over tp of the dp averages), outside backward: tp ranks also exchange activations over the
same group inside backward, so nothing of the optimizer's may pair with those there.

The sums are copies, kept until a bucket is reduced again (`Bucket.generation`) or the step's gradients are
cleared, so that clip_grad_norm_() and the step that follows scale and read the same tensors, and every tp rank
steps its replica with the same bits (a sum over the group is the same on every rank).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from moezero.parallel import comm
from moezero.zero.bucket import Bucket
from moezero.zero.zero_param import ParamFamily

ReducedGrads = Dict[ParamFamily, List[Optional[torch.Tensor]]]


class TpPartialSums:
    def __init__(self, buckets: Sequence[Bucket], tp_group: Optional[Any]):
        """`buckets`: every bucket of the trainable families (those of tp_partial ones are summed)."""
        self.group = tp_group
        self.buckets = [b for b in buckets if b.family.kind == "tp_partial"] if comm.group_size(tp_group) > 1 else []
        self._generations: Optional[List[int]] = None  # the buckets' generations the sums were taken at
        self._sums: Dict[int, torch.Tensor] = {}  # id(bucket) -> its reduced gradient summed over tp

    def apply(self, reduced: ReducedGrads) -> ReducedGrads:
        """Collective over tp (when some bucket was reduced since the last sums): `reduced` with the tp_partial
        buckets' gradients replaced by their sums over tp."""
        if not self.buckets:
            return reduced
        generations = [b.generation for b in self.buckets]
        if generations != self._generations:  # the same on every tp rank: they run the same backwards
            self._sums = {id(b): reduced[b.family][b.index].clone() for b in self.buckets}
            for summed in self._sums.values():
                comm.all_reduce(summed, self.group)
            self._generations = generations
        out = {family: list(grads) for family, grads in reduced.items()}
        for b in self.buckets:
            out[b.family][b.index] = self._sums[id(b)]
        return out

    def clear(self) -> None:
        """The step's gradients were cleared: the next sums are taken anew."""
        self._generations = None
        self._sums = {}
