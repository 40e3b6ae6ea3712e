"""The step's one small all-reduce (StepTotals): the norm's sum of squares and which params got a gradient on some
rank of their group, on 4 ranks at ep 2 (dense params over all ranks, expert params over the ranks holding the
same experts)."""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from moezero.parallel import ParallelGroups
from moezero.zero.step_totals import StepTotals
from tests.dist_utils import run_distributed

# got_grad of each rank's params: dense family (2 params), expert family (3 params); ranks 0 and 2 hold the same
# experts (ep rank 0), ranks 1 and 3 the others
DENSE = {0: [0, 0], 1: [0, 0], 2: [0, 0], 3: [1, 0]}
EXPERT = {0: [1, 0, 0], 1: [0, 0, 0], 2: [0, 1, 0], 3: [0, 0, 1]}


def _family(kind, flags, trainable=True):
    members = [SimpleNamespace(got_grad=bool(f), got_grad_anywhere=None) for f in flags]
    return SimpleNamespace(kind=kind, trainable=trainable, members=members)


def _totals():
    rank = dist.get_rank()
    groups = ParallelGroups.build(expert_parallel_size=2)
    dense, expert = _family("dense", DENSE[rank]), _family("expert", EXPERT[rank])
    frozen = _family("dense", [1], trainable=False)
    totals = StepTotals([dense, frozen, expert], groups)
    without = totals.sum(torch.tensor(float(rank + 1), dtype=torch.float64), with_flags=False)
    untouched = [zp.got_grad_anywhere for zp in dense.members + expert.members]
    summed = totals.sum(torch.tensor(float(rank + 1), dtype=torch.float64), with_flags=True)
    flags_only = totals.sum(None, with_flags=True)
    groups.destroy()
    return (
        without,
        untouched,
        summed,
        flags_only,
        [zp.got_grad_anywhere for zp in dense.members],
        [zp.got_grad_anywhere for zp in expert.members],
        frozen.members[0].got_grad_anywhere,
    )


def test_the_norm_and_the_gradient_flags_in_one_message():
    for rank, (without, untouched, summed, flags_only, dense, expert, frozen) in enumerate(run_distributed(_totals, 4)):
        assert without == summed == 10.0 and flags_only == 0.0
        assert untouched == [None] * 5  # without flags, nothing is set
        assert dense == [True, False]  # rank 3's gradient reaches every rank
        assert expert == ([True, True, False] if rank % 2 == 0 else [False, False, True]), (rank, expert)
        assert frozen is False
