"""The dynamic loss scaler against megatron-core's DynamicGradScaler: the same scale after every step of random
overflow patterns (several hysteresis and growth intervals), and the same after a state round trip."""

import copy
import random

import pytest
import torch

from moezero.zero import DynamicLossScaler

grad_scaler = pytest.importorskip("megatron.core.optimizer.grad_scaler")


def _megatrons(monkeypatch, scale, growth_interval, hysteresis, min_scale):
    """Megatron's scaler keeps its scale on 'cuda': here on the CPU."""
    make = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *args, device=None, **kwargs: make(*args, **kwargs))
    scaler = grad_scaler.DynamicGradScaler(scale, min_scale, 2.0, 0.5, growth_interval, hysteresis)
    monkeypatch.setattr(torch, "tensor", make)
    return scaler


@pytest.mark.parametrize("hysteresis,growth_interval", [(1, 3), (2, 1), (2, 5), (3, 4)])
def test_the_scale_follows_megatrons_over_random_overflows(monkeypatch, hysteresis, growth_interval):
    rng = random.Random(hysteresis * 10 + growth_interval)
    for _ in range(40):
        theirs = _megatrons(monkeypatch, 2.0**20, growth_interval, hysteresis, 4.0)
        ours = DynamicLossScaler(scale=2.0**20, growth_interval=growth_interval, hysteresis=hysteresis, min_scale=4.0)
        for step in range(80):
            overflow = rng.random() < 0.4
            theirs.update(overflow)
            ours.update(overflow=overflow)
            assert ours.scale == theirs.scale.item(), (step, overflow)
            if step == 40:  # a checkpoint's round trip in the middle
                state = ours.state_dict()
                ours = DynamicLossScaler(growth_interval=growth_interval, hysteresis=hysteresis, min_scale=4.0)
                ours.load_state_dict(state)


def test_once_the_tolerated_overflows_are_used_every_overflow_halves_the_scale():
    """Hysteresis 2: the first overflow is tolerated, the next ones each halve (Megatron's; the scale an fp16
    run starts at, 2^32, must come down fast)."""
    scaler = DynamicLossScaler(scale=2.0**16, hysteresis=2)
    scales = []
    for _ in range(4):
        scaler.update(overflow=True)
        scales.append(scaler.scale)
    assert scales == [2.0**16, 2.0**15, 2.0**14, 2.0**13]


def test_a_skipped_step_reports_no_gradient_norm_or_zero_count():
    """As Megatron's optimizer returns None for both on a skipped step: the log leaves them out instead of
    showing 'grad norm: inf'."""
    from torch import nn

    from moezero.training.loop import StepMetrics
    from moezero.zero import ZeroOptimizer

    model = nn.Linear(4, 4)
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=2, lr=0.1, loss_scaler=DynamicLossScaler(scale=1024.0))
    opt.count_zeros_in_grad = True
    opt.backward(model(torch.full((2, 4), float("inf"))).sum())
    assert opt.step() is False and opt.last_num_zeros_in_grad is None
    metrics = StepMetrics(1.0, {}, opt.last_grad_norm, False, torch.zeros(0, 4), torch.zeros(0), {})
    assert "grad_norm" not in metrics.values()
    assert StepMetrics(1.0, {}, 2.0, True, torch.zeros(0, 4), torch.zeros(0), {}).values()["grad_norm"] == 2.0


def test_fp16_overflows_while_the_scale_backs_off_never_stop_the_run():
    """Megatron's fp16 run skips overflowing steps for as long as its loss scale backs off (from 2^32 a model
    needing 2^12 skips 41 steps with hysteresis 2); moezero's --max-consecutive-skipped-steps counts only the
    overflows at --min-loss-scale, where backing off no longer helps."""
    from torch import nn

    from moezero.zero import ZeroOptimizer

    model = nn.Linear(4, 1)
    scaler = DynamicLossScaler(scale=2.0**32, hysteresis=2, min_scale=4.0)
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, loss_scaler=scaler, max_skipped_steps=3)
    overflowing = torch.full((1, 4), float("inf"))
    for _ in range(33):  # 2^32 -> 4 in 31 overflows (one tolerated, then one halving each), then 2 at 4
        opt.backward(model(overflowing).sum())
        assert opt.step() is False
    assert scaler.scale == 4.0 and opt.consecutive_skips == 2  # the two at 4.0 count
    opt.backward(model(overflowing).sum())
    with pytest.raises(FloatingPointError, match="3 consecutive steps at the minimum loss scale"):
        opt.step()


def test_a_loss_scaled_step_clips_as_torch_does_on_the_unscaled_gradient():
    """fp16's loss scale and --clip-grad together: the norm that clips (and the one reported) is the unscaled
    gradient's, as torch's clip_grad_norm_ after GradScaler.unscale_. In float64, where a power-of-two scale is
    exact, three clipped AdamW steps equal torch's to 1e-12."""
    from torch import nn

    from moezero.zero import ZeroOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(model)
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=2,
        lr=0.1,
        clip_grad=0.05,
        grad_reduce_dtype=torch.float64,
        loss_scaler=DynamicLossScaler(scale=2.0**10),
    )
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        opt.backward(model(x).pow(2).sum())
        assert opt.step() is True
        opt.zero_grad()
        reference(x).pow(2).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        torch_opt.step()
        torch_opt.zero_grad()
        assert float(norm) > 0.05 and abs(opt.last_grad_norm - float(norm)) <= 1e-12 * float(norm)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-14)
