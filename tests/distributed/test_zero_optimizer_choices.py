"""ZeroOptimizer's explicit choices do what they say and leave the numbers alone: `step_per_family` (the inner
optimizer stepped once per family or once over all) and `check_exchanges_with_gathers` (stage 3: the MoE layers'
agreement records also checked in the unit gathers' sequence)."""

import pytest
import torch
from torch import nn

from moezero.parallel import ParallelGroups
from moezero.zero import PrecisionAwareAdam, ZeroOptimizer
from tests.dist_utils import run_distributed
from tests.zero_model import ZeroTestModel
from tests.zero_reference import OPTIMIZERS, ZERO_STAGES, detached_params, train_step

STEPS = 3


def _train(model, opt):
    for step in range(STEPS):
        train_step(model, opt, step, accumulation=1, use_no_sync=False)
        opt.step()
        opt.zero_grad()
    with opt.full_parameters():
        return detached_params(model)


def _stepped_per_family_and_at_once(stage):
    """{step_per_family: (inner steps per optimizer step, params after the run)} on this rank."""
    groups = ParallelGroups.build(expert_parallel_size=2)
    out = {}
    for per_family in (True, False):
        model = ZeroTestModel(groups, mixed_dtypes=True).double()  # dense fp64, dense fp32, experts fp64
        cls, kwargs = OPTIMIZERS["adamw"]
        opt = ZeroOptimizer(model, cls, groups, stage=stage, bucket_size=64, step_per_family=per_family, **kwargs)
        calls = []
        inner_step = opt.inner.step
        opt.inner.step = lambda *args, **kw: (calls.append(1), inner_step(*args, **kw))[1]
        params = _train(model, opt)
        out[per_family] = (len(calls) / STEPS, params)
    groups.destroy()
    return out


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_step_per_family_is_honoured_both_ways_with_the_same_numbers(stage):
    """torch's AdamW stepped once per family (three here: dense fp64 and fp32, experts) or once over all gives the
    same params, bit for bit: its step skips params without a gradient and keeps its state per param."""
    for rank, out in enumerate(run_distributed(_stepped_per_family_and_at_once, 2, stage)):
        assert out[True][0] == 3 and out[False][0] == 1, (rank, out[True][0], out[False][0])
        for name, value in out[True][1].items():
            assert torch.equal(value, out[False][1][name]), (rank, name)


def test_the_default_steps_per_family_only_for_the_known_classes():
    class Subclass(torch.optim.AdamW):  # may keep state across params: stepped once unless it says otherwise
        pass

    def built(cls, **kwargs):
        return ZeroOptimizer(nn.Linear(4, 4).to(torch.bfloat16), cls, lr=1e-3, **kwargs).step_per_family

    assert built(torch.optim.AdamW) and built(torch.optim.SGD) and built(PrecisionAwareAdam)
    assert not built(Subclass) and built(Subclass, step_per_family=True)
    assert not built(torch.optim.AdamW, step_per_family=False)


def _agreement_messages(check):
    """(messages on the agreement group, params after the run) of a stage-3 run on this rank."""
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).double()
    cls, kwargs = OPTIMIZERS["adamw"]
    opt = ZeroOptimizer(model, cls, groups, stage=3, bucket_size=64, check_exchanges_with_gathers=check, **kwargs)
    params = _train(model, opt)
    messages = opt.engine.agreement.launched
    groups.destroy()
    return messages, params


def test_exchange_checks_off_issue_no_message_per_moe_layer_and_train_alike():
    """At stage 3 each MoE layer's forward checks its record in the gathers' sequence: one message on the
    agreement group per MoE layer and forward (2 layers x 3 forwards here). check_exchanges_with_gathers=False
    issues none of them; every other check stays, and the params are the same."""
    on = run_distributed(_agreement_messages, 2, True)
    off = run_distributed(_agreement_messages, 2, False)
    for rank in range(2):
        assert on[rank][0] - off[rank][0] == 2 * STEPS and off[rank][0] > 0, (rank, on[rank][0], off[rank][0])
        for name, value in on[rank][1].items():
            assert torch.equal(value, off[rank][1][name]), (rank, name)
