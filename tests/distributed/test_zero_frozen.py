"""Frozen params follow torch: given to the optimizer they stay in their group with their state,
are skipped while frozen, and train again once unfrozen (inside `opt.modify_model()`).

torch's reference: `AdamW(model.parameters())` with the same params frozen and unfrozen by
`requires_grad_` at the same steps; a frozen param has no gradient, so torch skips it (and its
weight decay) and keeps its state.
"""

import torch
import torch.distributed as dist

from moezero.parallel import ParallelGroups
from moezero.zero import ZeroOptimizer
from tests.dist_utils import run_distributed
from tests.zero_model import ZeroTestModel
from tests.zero_reference import OPTIMIZERS, ZERO_STAGES, assert_params_match, reference_run, train_step

TOL = 1e-10
STEPS = 6


def _schedule(step, model):
    """`frozen` (frozen from the start) trains from step 2; block.0 is frozen at step 1 (it had state) and
    trains again from step 4; the MoE experts of layer 2 freeze at step 3."""
    changes = {
        2: [(model.frozen, True)],
        1: [(model.block[0], False)],
        4: [(model.block[0], True)],
        3: [(model.moe2.experts, False)],
    }
    for module, trainable in changes.get(step, []):
        module.requires_grad_(trainable)
        for p in module.parameters():
            p.grad = None


def _frozen_like_torch(stage, ep, optimizer, default_groups):
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=ep)
    model = ZeroTestModel(groups).double()
    cls, kwargs = OPTIMIZERS[optimizer]
    given = {} if default_groups else {"param_groups": model.parameters()}
    opt = ZeroOptimizer(
        model, cls, groups, stage=stage, bucket_size=64, grad_reduce_dtype=torch.float64, **given, **kwargs
    )
    assert any(p is model.frozen.weight for p in opt.param_groups[0]["params"]), "frozen params are in the group"
    reference = reference_run(
        optimizer,
        world,
        1,
        STEPS,
        make_opt=lambda m: cls(m.parameters(), **kwargs),
        each_step=lambda step, m, o: _schedule(step, m),
    )
    for step in range(STEPS):
        with opt.modify_model():
            _schedule(step, model)
        train_step(model, opt, step, 1, use_no_sync=False)
        opt.step()
        opt.zero_grad()
        with opt.full_parameters():
            assert_params_match(model, reference[step]["params"], rtol=TOL, atol=1e-13)
    groups.destroy()
    return True


def test_frozen_params_stay_in_their_group_and_train_again_once_unfrozen():
    for stage in ZERO_STAGES:
        assert all(run_distributed(_frozen_like_torch, 2, stage, 2, "adamw", stage % 2 == 0)), f"stage {stage}"
    assert all(run_distributed(_frozen_like_torch, 2, 3, 1, "sgd", False))


def _gradient_bytes(stage, freeze_first):
    """A frozen family is stored (sharded at stage 3) but never reduced: no gradient bytes, no hook."""
    groups = ParallelGroups.build()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    model[0].requires_grad_(not freeze_first)
    opt = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=stage, lr=0.01)
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    grads = opt.memory_bytes()["grads"]
    fires = sorted(opt.counters.fires)
    groups.destroy()
    return grads, fires


def test_a_frozen_family_is_never_reduced():
    for stage in (0, 1):  # full-size gradient buffers: only the trainable layer has one
        frozen, fires = run_distributed(_gradient_bytes, 2, stage, True)[0]
        trainable, _ = run_distributed(_gradient_bytes, 2, stage, False)[0]
        assert frozen <= 0.51 * trainable, (stage, frozen, trainable)
        assert fires == ["1.bias", "1.weight"]
