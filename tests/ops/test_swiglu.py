"""The SwiGLU kernel (csrc/swiglu.cpp) against its float64 reference and against torch's silu(gate) * up, forward
and backward, fp32 and bf16, widths off the vector length and the kernel's block, 1 and 2 threads."""

import pytest
import torch
import torch.nn.functional as F

from moezero.moe.experts import activation
from moezero.ops import reference, swiglu
from tests.ops.helpers import assert_each_case_raises

WIDTHS = (300, 7, 1024)   # F: the rows are [gate | up] of 2F


def _inputs(rows, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
    return h, torch.randn(rows, width, generator=g).to(dtype)


def _ulp(dtype):
    return 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23


def _close_in_ulps(got, want, dtype, ulps, atol):
    """The share of elements within `ulps` of the reference (plus atol), and the worst excess."""
    excess = (got.double() - want.double()).abs() - ulps * _ulp(dtype) * want.double().abs() - atol
    return (excess <= 0).double().mean().item(), excess.max().item()


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_and_backward_match_the_reference(cpu_ext, num_threads, width, dtype):
    h, grad = _inputs(37, width, dtype)
    y, grad_h = cpu_ext.swiglu(h), cpu_ext.swiglu_backward(grad, h)
    assert y.shape == (37, width) and grad_h.shape == h.shape and y.dtype == grad_h.dtype == dtype
    # the sigmoid's exp is good to an ulp or two of fp32, and 1 - sigmoid cancels where the gate is large (as in
    # torch's own formula): a few ulps of the largest value at most; in bf16 that flips a rounding of silu's
    # output now and then (an ulp)
    for got, want in ((y, reference.swiglu(h)), (grad_h, reference.swiglu_backward(grad, h))):
        floor = 8 * 2.0 ** -23 * want.double().abs().max().item()
        within, worst = _close_in_ulps(got, want, dtype, 1, floor)
        assert within > 0.99 and _close_in_ulps(got, want, dtype, 3, floor)[0] == 1.0, (within, worst)
    torch.set_num_threads(1)   # rows are independent: the same bits whatever the threads
    assert torch.equal(y, cpu_ext.swiglu(h)) and torch.equal(grad_h, cpu_ext.swiglu_backward(grad, h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_autograd_agrees_with_torchs_silu_times_up(cpu_ext, dtype):
    h, grad = _inputs(64, 96, dtype, seed=1)
    h = h.view(4, 16, 192)
    grad = grad.view(4, 16, 96)
    results = []
    for fused in (True, False):
        h_ = h.clone().requires_grad_(True)
        if fused:
            assert swiglu.fused_swiglu_applies(h_)
            out = activation(h_, "swiglu")
        else:
            gate, up = h_.chunk(2, dim=-1)
            out = F.silu(gate) * up
        out.backward(grad)
        results.append((out, h_.grad))
    for ours, theirs in zip(*results):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        if dtype == torch.bfloat16:   # most bit for bit; the rest an ulp of silu's rounding
            assert (ours == theirs).double().mean() > 0.98
            torch.testing.assert_close(ours, theirs, rtol=2 ** -6, atol=2 ** -6)
        else:   # two sigmoids (torch's exp and ours) an ulp or two apart, 1 - sigmoid cancelling for large gates
            torch.testing.assert_close(ours, theirs, rtol=4e-7, atol=8 * 2.0 ** -23 * theirs.abs().max().item())


def test_the_activation_takes_the_kernel_only_for_plain_swiglu(cpu_ext, monkeypatch):
    calls = []
    monkeypatch.setattr(swiglu._SwiGLU, "apply", lambda h: calls.append(h.shape) or h[:, : h.shape[1] // 2] * 1)
    h = torch.randn(3, 8)
    activation(h, "swiglu")
    activation(h, "swiglu", offset=1.0)         # Megatron's --glu-linear-offset: torch's ops
    activation(h, "swiglu", clamp=7.0)          # GPT-OSS's clamped SwiGLU: torch's ops
    activation(h, "quick_geglu")
    activation(h.double(), "swiglu")            # float64 (the HF oracles): torch's ops
    assert calls == [(3, 8)]


def test_non_finite_values_follow_torch(cpu_ext):
    h = torch.tensor([[0.0, 100.0, -100.0, float("nan"), float("inf"), 1.0, 1.0, 1.0, 1.0, 2.0]])
    gate, up = h.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = cpu_ext.swiglu(h)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=1e-30)


def test_double_backward_raises_instead_of_dropping_the_second_derivative(cpu_ext):
    h = torch.randn(4, 8, requires_grad=True)
    out = swiglu.swiglu(h)
    (grad,) = torch.autograd.grad((out * out).sum(), h, create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        grad.sum().backward()


BAD_INPUTS = r"""
import torch, moezero._C as C
h, g = torch.randn(6, 8), torch.randn(6, 4)
cases = {
    "float32 or bfloat16": lambda: C.swiglu(h.double()),
    "contiguous 2-D": lambda: C.swiglu(h.t()),
    "is not [gate | up]": lambda: C.swiglu(torch.randn(6, 7)),
    "at half its width": lambda: C.swiglu_backward(torch.randn(6, 3), h),
    "grad_MF must be float32": lambda: C.swiglu_backward(g.double(), h),
}
"""


def test_bad_inputs_raise_one_clear_error_in_a_subprocess(cpu_ext):
    """Wrong shapes or dtypes are a RuntimeError naming the problem, never a crash."""
    assert_each_case_raises(BAD_INPUTS)
