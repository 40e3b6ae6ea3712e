"""PrecisionAwareAdam against torch: with fp32 states it is torch's fused AdamW/Adam step for step; with narrow
states it is torch's fused AdamW whose moments are rounded after every step by TransformerEngine's storage rule;
the fp32 master of a bf16 param is kept exactly in the param and a 16-bit remainder."""

import pytest
import torch

from moezero.zero import PrecisionAwareAdam
from moezero.zero.precision_aware_adam import FP8, SCALED_RANGE

N = 2500
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _grads(steps, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=generator) * (1 + step) for step in range(steps)]


@pytest.mark.parametrize("decoupled", [True, False])
def test_fp32_states_equal_torch_fused(decoupled):
    torch.manual_seed(0)
    ours = [torch.randn(N, requires_grad=True), torch.randn(7, 9, requires_grad=True)]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    groups = lambda ps: [{"params": [ps[0]], "lr": 0.01}, {"params": [ps[1]], "lr": 0.003, "weight_decay": 0.0}]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    reference = cls(groups(theirs), betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, fused=True)
    opt = PrecisionAwareAdam(
        groups(ours), betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, decoupled_weight_decay=decoupled
    )
    for step, grad in enumerate(_grads(6)):
        for a, b in zip(ours, theirs):
            g = None if (step == 2 and a.dim() == 2) else grad[: a.numel()].view_as(a)  # skipped: no gradient
            a.grad, b.grad = g, (g.clone() if g is not None else None)
        opt.step()
        reference.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    assert "master_param" not in opt.state[ours[0]]  # an fp32 param is its own master


def _round_like_storage(values: torch.Tensor, dtype: torch.dtype) -> None:
    """TransformerEngine's rule: bf16 as is; fp16 / fp8 divided by a per-tensor scale amax / range."""
    if dtype == FP32:
        return
    if dtype not in SCALED_RANGE:
        values.copy_(values.to(dtype))
        return
    scale = values.abs().max() / SCALED_RANGE[dtype]
    stored = (values * torch.where(scale > 0, scale.reciprocal(), 0.0)).to(dtype)
    values.copy_(stored.float() * scale)


@pytest.mark.parametrize("exp_avg,exp_avg_sq", [(BF16, BF16), (FP16, FP16), (FP8, BF16), (BF16, FP32)])
def test_narrow_moments_are_torch_with_rounded_state(exp_avg, exp_avg_sq):
    torch.manual_seed(1)
    param = torch.randn(N).to(BF16).requires_grad_()
    master = param.detach().float().clone().requires_grad_()
    reference = torch.optim.AdamW([master], lr=0.01, weight_decay=0.1, fused=True)
    opt = PrecisionAwareAdam([param], lr=0.01, weight_decay=0.1, exp_avg_dtype=exp_avg, exp_avg_sq_dtype=exp_avg_sq)
    for grad in _grads(8, seed=1):
        param.grad, master.grad = grad.to(BF16), grad.to(BF16).float()
        opt.step()
        reference.step()
        state = reference.state[master]
        _round_like_storage(state["exp_avg"], exp_avg)
        _round_like_storage(state["exp_avg_sq"], exp_avg_sq)
        assert torch.equal(opt.master_values(param), master.detach())
    assert opt.state[param]["exp_avg"].dtype == exp_avg and opt.state[param]["master_param"].dtype == torch.int16
    _, full = opt.full_precision_state(param)
    assert torch.equal(full["exp_avg"], state["exp_avg"]) and torch.equal(full["exp_avg_sq"], state["exp_avg_sq"])


def test_param_and_remainder_hold_the_fp32_master_exactly():
    """Every fp32 bit pattern class: ties of both parities, carries into the exponent, negatives, tiny, huge."""
    high = torch.tensor([0x3F80, 0x3F81, 0x7F7F, 0xBF80, 0xBF81, 0x0000, 0x8000, 0x0001, 0x4049], dtype=torch.int64)
    low = torch.tensor([0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = ((high[:, None] << 16) | low[None, :]).reshape(-1)
    values = (bits - ((bits >= 2**31).long() << 32)).to(torch.int32).view(FP32)
    values = torch.cat([values, torch.randn(4000) * 10.0 ** torch.randint(-30, 30, (4000,)).float()])
    param = values.to(BF16).requires_grad_()
    opt = PrecisionAwareAdam([param], lr=0.0)
    opt.load_full_precision_state(
        param,
        values,
        {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(values), "exp_avg_sq": torch.zeros_like(values)},
    )
    assert torch.equal(opt.master_values(param).view(torch.int32), values.view(torch.int32))
    finite = values.isfinite() & param.detach().float().isfinite()
    _, exponent = torch.frexp(param.detach().float())
    half_ulp = torch.ldexp(torch.ones_like(values), (exponent - 9).clamp(min=-134))  # 8 significant bits
    assert ((param.detach().float() - values).abs()[finite] <= half_ulp[finite]).all()


@pytest.mark.parametrize("master_dtype,remainders", [(FP32, False), (FP16, False)])
def test_other_master_storages(master_dtype, remainders):
    torch.manual_seed(2)
    param = torch.randn(N).to(BF16).requires_grad_()
    master = param.detach().float().clone().requires_grad_()
    reference = torch.optim.AdamW([master], lr=0.01, weight_decay=0.1, fused=True)
    opt = PrecisionAwareAdam(
        [param], lr=0.01, weight_decay=0.1, master_weight_dtype=master_dtype, store_param_remainders=remainders
    )
    _round_like_storage(master.data, master_dtype)
    for grad in _grads(5, seed=2):
        param.grad, master.grad = grad.to(BF16), grad.to(BF16).float()
        opt.step()
        reference.step()
        assert torch.equal(param.detach(), master.detach().to(BF16))  # the new master, rounded (RNE)
        _round_like_storage(master.data, master_dtype)
        assert torch.equal(opt.master_values(param), master.detach())
    assert opt.state[param]["master_param"].dtype == master_dtype


def test_full_precision_state_resumes_bit_exactly():
    torch.manual_seed(3)
    make = lambda p: PrecisionAwareAdam([p], lr=0.02, exp_avg_dtype=BF16, exp_avg_sq_dtype=FP16)
    start = torch.randn(N).to(BF16)
    straight = start.clone().requires_grad_()
    resumed = start.clone().requires_grad_()
    opt_straight, opt_first = make(straight), make(resumed)
    grads = _grads(8, seed=3)
    for step, grad in enumerate(grads):
        straight.grad = grad.to(BF16)
        opt_straight.step()
        if step < 4:
            resumed.grad = grad.to(BF16)
            opt_first.step()
    master, state = opt_first.full_precision_state(resumed)
    again = torch.zeros(N, dtype=BF16, requires_grad=True)
    opt_again = make(again)
    opt_again.load_full_precision_state(again, master, state)
    for grad in grads[4:]:
        again.grad = grad.to(BF16)
        opt_again.step()
    assert torch.equal(opt_again.master_values(again), opt_straight.master_values(straight))
    assert torch.equal(again.detach(), straight.detach())


def test_bad_dtype_is_one_clear_error():
    with pytest.raises(ValueError, match="exp_avg_dtype=torch.int8"):
        PrecisionAwareAdam([torch.zeros(2, requires_grad=True)], exp_avg_dtype=torch.int8)
