"""Stage 3's edges of modify_model() and of freeing in backward: a module added under a new name trains as torch's
add_param_group; a unit is gathered at most once in a backward."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moezero.parallel import ParallelGroups
from moezero.zero import ZeroOptimizer
from tests.dist_utils import run_distributed


class _WithAdapter(nn.Module):
    """A body, and an adapter added later under a name the model did not have."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8)
        self.adapter = None

    def forward(self, x):
        y = self.body(x)
        return y if self.adapter is None else self.adapter(y)


def _adapter():
    torch.manual_seed(7)
    return nn.Linear(8, 8).double()


def _module_added_under_a_new_name(stage):
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = ParallelGroups.build()
    model, ref = _WithAdapter().double(), _WithAdapter().double()
    opt = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=stage, lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        if step == 1:
            with opt.modify_model():
                model.adapter = _adapter()
            ref.adapter = _adapter()
            ref_opt.add_param_group({"params": list(ref.adapter.parameters())})
        model(x.chunk(world)[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with opt.full_parameters():
        for name, p in ref.named_parameters():
            torch.testing.assert_close(model.get_parameter(name).detach(), p.detach(), rtol=1e-12, atol=1e-13, msg=name)
    groups.destroy()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_module_added_under_a_new_name_trains_like_torchs_add_param_group(stage):
    """modify_model() adopts a module the model gets under a new attribute (the tests swapped modules under
    names it had): from its first step it trains as torch's AdamW with add_param_group, on one process."""
    run_distributed(_module_added_under_a_new_name, 2, stage)


class _PreNormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.RMSNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


def _backward_gathers_per_unit():
    from moezero.zero.sharded_params import ShardedParams

    groups = ParallelGroups.build()
    torch.manual_seed(0)
    model = nn.Sequential(*[_PreNormBlock() for _ in range(3)]).double()
    opt = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=3, lr=0.01)
    seen, gather = {}, ShardedParams.gather

    def counting(self, unit):
        seen[unit] = seen.get(unit, 0) + 1
        return gather(self, unit)

    loss = model(torch.randn(4, 8, dtype=torch.float64)).square().mean()
    ShardedParams.gather = counting
    try:
        loss.backward()
    finally:
        ShardedParams.gather = gather
    opt.step()
    groups.destroy()
    return seen


def test_a_backward_gathers_each_unit_once():
    """A unit is freed in backward once every param of it got its gradient, not one param early (the numbers stay
    right then, but the block is gathered again for its last param)."""
    for seen in run_distributed(_backward_gathers_per_unit, 2):
        assert seen and set(seen.values()) == {1}, seen
