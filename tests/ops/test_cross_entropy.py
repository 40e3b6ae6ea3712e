"""The fused token cross-entropy (--cross-entropy-loss-fusion) against torch's F.cross_entropy on fp32-widened
logits and against its pure-PyTorch reference: losses and logits' gradients, fp32 and bf16, an ignored row,
non-finite rows, a vocabulary that is not a multiple of the kernel's lanes or blocks; and the flag in training."""

import pytest
import torch
import torch.nn.functional as F

from moezero.ops import _loader, reference
from moezero.ops.cross_entropy import IGNORE_INDEX, token_cross_entropy

needs_kernel = pytest.mark.skipif(_loader.load("cpu") is None, reason="the C++ extension is not built")


def _case(dtype, rows, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[1] = IGNORE_INDEX
    return logits, labels, torch.rand(rows, generator=g)


def _loss_and_grad(logits, labels, weights, fused):
    x = logits.clone().requires_grad_(True)
    losses = token_cross_entropy(x, labels, fused=fused)
    (losses * weights).sum().backward()
    return losses.detach(), x.grad


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 1000, 1537])
def test_fused_cross_entropy_matches_torch_and_the_reference(dtype, vocab):
    logits, labels, weights = _case(dtype, 37, vocab)
    losses, grad = _loss_and_grad(logits, labels, weights, fused=True)
    torch_losses, torch_grad = _loss_and_grad(logits, labels, weights, fused=False)
    assert losses.dtype == torch.float32 and grad.dtype == dtype
    assert losses[1] == 0 and not grad[1].any()  # the ignored row
    torch.testing.assert_close(losses, torch_losses, rtol=2e-6, atol=1e-6)
    # bf16: one rounding of the gradient apart; fp32: p = exp(x - lse) carries lse's few-ulp difference
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 4e-6
    torch.testing.assert_close(grad.float(), torch_grad.float(), rtol=ulp, atol=ulp * torch_grad.abs().max().item())
    ref_losses, lse = reference.cross_entropy(logits, labels, IGNORE_INDEX)
    ref_grad = reference.cross_entropy_backward(weights, logits, labels, lse, IGNORE_INDEX)
    torch.testing.assert_close(losses, ref_losses, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=ulp, atol=ulp * ref_grad.abs().max().item())


@needs_kernel
def test_fused_cross_entropy_keeps_what_is_not_finite():
    logits = torch.tensor([[0.0, float("nan"), 1.0], [0.0, float("inf"), 1.0], [float("-inf"), 2.0, 1.0]])
    labels = torch.tensor([0, 2, 1])
    losses, grad = _loss_and_grad(logits, labels, torch.ones(3), fused=True)
    torch_losses, torch_grad = _loss_and_grad(logits, labels, torch.ones(3), fused=False)
    torch.testing.assert_close(losses, torch_losses, equal_nan=True)
    torch.testing.assert_close(grad, torch_grad, equal_nan=True)
    # a masked (-inf) logit and one far below the others get exactly no probability, as torch's
    masked = torch.tensor([[float("-inf"), 1.0, 2.0], [-200.0, 1.0, 2.0]])
    _, grad = _loss_and_grad(masked, torch.tensor([2, 2]), torch.ones(2), fused=True)
    assert (grad[:, 0] == 0).all()


def test_labels_torch_takes_the_kernel_does_not_go_to_torch():
    logits, labels = torch.randn(4, 10), torch.tensor([1, 2, 3, 9])
    torch.testing.assert_close(
        token_cross_entropy(logits, labels.to(torch.uint8), fused=True),
        token_cross_entropy(logits, labels, fused=False),
    )


@needs_kernel
def test_fused_cross_entropy_names_a_label_outside_the_vocabulary():
    logits, labels, _ = _case(torch.float32, 4, 10)
    labels[2] = 10
    with pytest.raises(RuntimeError, match="label 10 of row 2 is outside the vocabulary"):
        token_cross_entropy(logits, labels, fused=True)
    from moezero.ops import _library  # the backward kernel checks too: it would write outside the gradient

    with pytest.raises(RuntimeError, match="label 10 of row 2 is outside the vocabulary"):
        _library.kernel("cross_entropy_backward", logits.device)(
            torch.ones(4), logits, labels, torch.zeros(4, 2), IGNORE_INDEX
        )


def test_unfused_and_float64_are_torchs_own():
    logits, labels, weights = _case(torch.float64, 5, 11)
    for fused in (False, True):  # fp64 logits never take the kernel
        losses, _ = _loss_and_grad(logits, labels, weights, fused)
        assert torch.equal(losses, F.cross_entropy(logits, labels, reduction="none"))


def _train_losses(argv, steps=3):
    import dataclasses

    from moezero.models import GPTModel
    from moezero.parallel import ParallelGroups
    from moezero.training.loop import train_step
    from moezero.zero import ZeroOptimizer
    from tests.integration.pretrain_utils import TINY, configs

    cfg = configs(TINY + ["--hidden-dropout", "0", "--attention-dropout", "0"] + argv)
    model = GPTModel(dataclasses.replace(cfg.model, vocab_size=64), cfg.moe, seed=3)
    opt = ZeroOptimizer(model, torch.optim.AdamW, ParallelGroups.single(), stage=0, lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        tokens, labels = (torch.randint(0, 64, (2, 32), generator=g) for _ in range(2))
        batch = {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": torch.ones(2, 32),
            "sample_index": torch.arange(2 * step, 2 * step + 2),
        }
        losses.append(train_step(model, opt, [batch], step, 7, None).lm_loss)
    return losses


@needs_kernel
def test_the_flag_fuses_the_training_loss(monkeypatch):
    """--cross-entropy-loss-fusion reaches the model's loss (the kernel runs, once per micro-batch) and trains as the
    unfused loss does, to ~1e-6."""
    from moezero.ops import cross_entropy

    calls = []
    fused_apply = cross_entropy._CrossEntropy.apply
    monkeypatch.setattr(cross_entropy._CrossEntropy, "apply", lambda *a: calls.append(1) or fused_apply(*a))
    plain = _train_losses([])
    assert not calls
    fused = _train_losses(["--cross-entropy-loss-fusion"])
    assert len(calls) == 3 and fused == pytest.approx(plain, rel=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1e2, 1e4, 3e38])
def test_fused_cross_entropy_stays_accurate_at_large_logits(dtype, offset):
    """The error is the fp32 one at any logit size (torch's is): a row's max and log-sum-exp are kept apart, so
    no fp32 lse of the logits' size cancels against the label's logit (5e-4 off at 1e4, a 0 loss at 3e38)."""
    g = torch.Generator().manual_seed(3)
    logits = ((torch.randn(16, 300, generator=g) * 2).double() + offset).to(dtype)
    if offset == 3e38:
        logits = torch.full((16, 300), 3e38).to(dtype)
    labels = torch.randint(0, 300, (16,), generator=g)
    weights = torch.rand(16, generator=g)
    losses, grad = _loss_and_grad(logits, labels, weights, fused=True)
    exact, exact_grad = _loss_and_grad(logits.double(), labels, weights.double(), fused=False)
    torch.testing.assert_close(losses.double(), exact, rtol=2e-6, atol=2e-6)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 4e-6
    torch.testing.assert_close(grad.double(), exact_grad, rtol=ulp, atol=ulp * exact_grad.abs().max().item())
    ref_losses, stats = reference.cross_entropy(logits, labels, IGNORE_INDEX)
    torch.testing.assert_close(ref_losses.double(), exact, rtol=2e-6, atol=2e-6)
