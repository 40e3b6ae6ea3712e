"""The step's one small all-reduce: the gradient norm's sum of squares and which params got a gradient on some rank.

Both are sums over every rank, so they travel together: one float64 message over the control group (all ranks),
instead of the norm's all-reduce plus one per trainable family for the flags. Slot 0 is this rank's sum of squared
gradients; then, per trainable family, a block of 0/1 flags (did this rank's backward reach the param) for each
group the family is reduced over: a dense family has one group (every rank), an expert family one per
expert-parallel rank (the ranks holding the same experts), and a rank writes its flags into its own group's
block. After the sum, a flag above 0 means some rank of the group got a gradient, the MAX of before.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Set, Tuple

import torch

from moezero.parallel import ParallelGroups, comm
from moezero.zero.zero_param import ParamFamily


class StepTotals:
    def __init__(self, families: Sequence[ParamFamily], groups: ParallelGroups):
        self.group = groups.control
        self._blocks: List[Tuple[ParamFamily, int]] = []  # (family, offset of this rank's block)
        self._frozen = [family for family in families if not family.trainable]
        offset = 1
        for family in families:
            if not family.trainable:
                continue
            block, blocks = (groups.ep_rank, groups.ep_size) if family.kind == "expert" else (0, 1)
            self._blocks.append((family, offset + block * len(family.members)))
            offset += blocks * len(family.members)
        self._length = offset

    def sum(self, sum_of_squares: Optional[torch.Tensor], with_flags: bool) -> float:
        """Collective: the sum of squares over all ranks (0.0 when None); `with_flags`: also set every trainable
        param's `got_grad_anywhere` from this step's `got_grad` on the ranks of its group."""
        message = torch.zeros(self._length if with_flags else 1, dtype=torch.float64)
        if sum_of_squares is not None:
            message[0] = sum_of_squares
        if with_flags:
            for family, at in self._blocks:
                message[at : at + len(family.members)] = torch.tensor(
                    [zp.got_grad for zp in family.members], dtype=torch.float64
                )
        comm.all_reduce(message, self.group)
        if with_flags:
            summed = message.tolist()
            for family, at in self._blocks:
                for zp, count in zip(family.members, summed[at : at + len(family.members)]):
                    zp.got_grad_anywhere = count > 0
            for family in self._frozen:
                for zp in family.members:
                    zp.got_grad_anywhere = False
        return float(message[0])

    def marked_anywhere(self, marked: Set[int]) -> Set[int]:
        """Collective: ids of the trainable params that some rank of their group marked (`marked`: the ids of the
        ZeroParams this rank marks), in the same blocks as the flags above."""
        message = torch.zeros(self._length, dtype=torch.float64)
        for family, at in self._blocks:
            message[at : at + len(family.members)] = torch.tensor(
                [id(zp) in marked for zp in family.members], dtype=torch.float64
            )
        comm.all_reduce(message, self.group)
        summed = message.tolist()
        return {
            id(zp)
            for family, at in self._blocks
            for zp, count in zip(family.members, summed[at : at + len(family.members)])
            if count > 0
        }
