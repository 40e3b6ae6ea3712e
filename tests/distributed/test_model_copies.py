"""copy.deepcopy of an MoE model on 2 ranks (an EMA, a teacher), at every stage and ep 2.

The field failure: `cannot pickle ProcessGroup` (the MoE layer's dispatcher and router hold process
groups). A copy shares the groups (it talks to the same ranks) and copies everything else; its forward
is as collective as the original's. The EMA kept over the steps equals single-process torch's EMA.
"""

import copy

import torch
import torch.distributed as dist

from moezero.parallel import ParallelGroups
from moezero.zero import ZeroOptimizer
from tests.dist_utils import run_distributed
from tests.zero_model import ZeroTestModel, micro_batch
from tests.zero_reference import local_reference_slice

DECAY, STEPS = 0.8, 3


def _ema_update(ema, model):
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(DECAY).add_(p.detach(), alpha=1 - DECAY)


def _reference_ema(world):
    model = ZeroTestModel(ParallelGroups.single()).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    ema = copy.deepcopy(model)
    for step in range(STEPS):
        for rank in range(world):
            tokens, targets = micro_batch(step, rank)
            (model(tokens, targets, step) / world).backward()
        opt.step()
        opt.zero_grad()
        _ema_update(ema, model)
    return {name: p.detach().clone() for name, p in ema.named_parameters()}


def _ema_of_an_moe_model():
    world, rank = dist.get_world_size(), dist.get_rank()
    reference = _reference_ema(world)
    for stage in (0, 1, 2, 3):
        groups = ParallelGroups.build(expert_parallel_size=2)
        model = ZeroTestModel(groups).double()
        opt = ZeroOptimizer(
            model, torch.optim.AdamW, groups, stage=stage, lr=0.02, bucket_size=64, grad_reduce_dtype=torch.float64
        )
        with opt.full_parameters():
            ema = copy.deepcopy(model)
        assert ema.moe1.dispatcher.ep_group is model.moe1.dispatcher.ep_group  # shared, not copied
        for step in range(STEPS):
            tokens, targets = micro_batch(step, rank)
            model(tokens, targets, step).backward()
            opt.step()
            opt.zero_grad()
            with opt.full_parameters():
                _ema_update(ema, model)
        for name, p in ema.named_parameters():
            assert type(p) is torch.nn.Parameter, name
            want = local_reference_slice(name, p, reference[name])
            torch.testing.assert_close(p.detach(), want, rtol=1e-10, atol=1e-13, msg=lambda m: f"{stage} {name}: {m}")
        tokens, targets = micro_batch(9, rank)
        with torch.no_grad():
            ema(tokens, targets, 9)  # the copy runs its own (collective) forward; the original is untouched
        groups.destroy()
    return True


def test_deepcopy_of_an_moe_model_shares_groups_and_keeps_an_exact_ema():
    assert all(run_distributed(_ema_of_an_moe_model, 2))
