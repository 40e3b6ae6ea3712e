"""Clearing gradients by torch's habits (`p.grad = None`, `zero_grad()` either way) between backwards, before
step() and after a backward that raised, at every stage, for params whose .grad is a view of the optimizer's
buffer (fp32) and those whose .grad is a placeholder (bf16 params, reduced in fp32): torch's own training of the
same model is the oracle (one process, so the average over ranks is the local gradient)."""

import pytest
import torch
from torch import nn

from moezero.zero import ZeroOptimizer

CLEARS = {
    "p.grad = None": lambda m: [setattr(p, "grad", None) for p in m.parameters()],
    "model.zero_grad()": lambda m: m.zero_grad(),
    "model.zero_grad(set_to_none=False)": lambda m: m.zero_grad(set_to_none=False),
}


def _pair(dtype):
    torch.manual_seed(0)
    model = nn.Linear(4, 4).to(dtype)
    reference = nn.Linear(4, 4).to(dtype)
    reference.load_state_dict(model.state_dict())
    return model, reference


@pytest.mark.parametrize("clear", list(CLEARS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage,no_sync", [(0, False), (0, True), (1, True)])
def test_clearing_between_micro_batches_drops_the_local_gradient(stage, no_sync, dtype, clear):
    """Stage 0 shows its (averaged) gradient, stage 1 under no_sync its local one: both are cleared, as torch's."""
    model, reference = _pair(dtype)
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=stage, lr=1.0, bucket_size=64)
    first, second = torch.ones(2, 4, dtype=dtype), torch.full((2, 4), 0.5, dtype=dtype)
    with opt.no_sync() if no_sync else torch.enable_grad():
        model(first).sum().backward()
    CLEARS[clear](model)
    model(second).sum().backward()
    opt.step()
    reference(second).sum().backward()  # torch: only the second micro-batch's gradient is left
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage,no_sync", [(0, False), (0, True), (1, True)])
def test_clearing_before_step_is_what_torchs_optimizer_sees(stage, no_sync, dtype):
    """After the last backward, where .grad shows what is not yet in a shard: `p.grad = None` leaves the weight out
    of the step (torch's AdamW skips it, weight decay included), zero_() on the bias makes its gradient zero (AdamW
    still decays it). What stages 1-3 reduced stays (tests/distributed/test_zero_torch_habits.py)."""
    model, reference = _pair(dtype)
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=0.1, weight_decay=0.5)
    for net in (model, reference):
        with opt.no_sync() if no_sync and net is model else torch.enable_grad():
            net(torch.ones(2, 4, dtype=dtype)).sum().backward()
        net.weight.grad = None
        net.bias.grad.zero_()
    opt.step()
    torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.5).step()
    with opt.full_parameters():
        torch.testing.assert_close(model.weight, reference.weight, rtol=0, atol=0)
        torch.testing.assert_close(model.bias, reference.bias, rtol=0, atol=0)


class _Six(nn.Module):
    """p4 gets a gradient in both backwards; the first raises after p4's arrived, before p3's."""

    def __init__(self):
        super().__init__()
        self.p = nn.ParameterList([nn.Parameter(torch.zeros(16, dtype=torch.float64)) for _ in range(6)])

    def forward(self, failing: bool):
        two, three = torch.full((16,), 2.0, dtype=torch.float64), torch.full((16,), 3.0, dtype=torch.float64)
        if failing:
            b = three * self.p[2]
            b.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("a hook failed")))
            return b.sum() + (two * self.p[3]).sum()
        return self.p[4].sum() * 5.0 + (two * self.p[3]).sum() + (three * self.p[5]).sum()


@pytest.mark.parametrize("clear", ["nothing"] + list(CLEARS))
def test_a_retry_after_a_backward_that_raised_has_only_its_own_gradients(clear):
    """The failed backward's p4 pointed into a staging buffer that went back to the pool; the retry's first
    bucket took it and summed p6's gradient there: the retry's p4 must not start from it."""
    model = _Six()
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=2, bucket_size=32, lr=1.0, grad_reduce_dtype=torch.float64)
    with pytest.raises(RuntimeError, match="a hook failed"):
        model(True).backward()
    if clear != "nothing":
        CLEARS[clear](model)
    model(False).backward()
    opt.step()
    for index, want in ((3, -2.0), (4, -5.0), (5, -3.0), (2, 0.0)):
        assert torch.equal(model.p[index].detach(), torch.full((16,), want, dtype=torch.float64)), index
