"""The gated activations' kernels (csrc/swiglu.cpp): SwiGLU against its float64 reference and torch's
silu(gate) * up, GPT-OSS's clamped quick GEGLU against its reference and torch's chain of ops; forward and backward,
fp32 and bf16, widths off the vector length and the kernel's block (threads: test_kernel_threads.py)."""

import pytest
import torch
import torch.nn.functional as F

from moezero.moe.experts import activation
from moezero.ops import reference, swiglu
from tests.ops.helpers import assert_each_case_raises

WIDTHS = (300, 7, 1024)  # F: the rows are [gate | up] of 2F


def _inputs(rows, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
    return h, torch.randn(rows, width, generator=g).to(dtype)


def _ulp(dtype):
    return 2.0**-7 if dtype == torch.bfloat16 else 2.0**-23


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
        floor = 8 * 2.0**-23 * want.double().abs().max().item()
        within, worst = _close_in_ulps(got, want, dtype, 1, floor)
        assert within > 0.99 and _close_in_ulps(got, want, dtype, 3, floor)[0] == 1.0, (within, worst)
    torch.set_num_threads(1)  # rows are independent: the same bits whatever the threads
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
            assert swiglu.fused_glu_applies(h_)
            out = activation(h_, "swiglu")
        else:
            gate, up = h_.chunk(2, dim=-1)
            out = F.silu(gate) * up
        out.backward(grad)
        results.append((out, h_.grad))
    for ours, theirs in zip(*results):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        if dtype == torch.bfloat16:  # most bit for bit; the rest an ulp of silu's rounding
            assert (ours == theirs).double().mean() > 0.98
            torch.testing.assert_close(ours, theirs, rtol=2**-6, atol=2**-6)
        else:  # two sigmoids (torch's exp and ours) an ulp or two apart, 1 - sigmoid cancelling for large gates
            torch.testing.assert_close(ours, theirs, rtol=4e-7, atol=8 * 2.0**-23 * theirs.abs().max().item())


def test_the_activation_takes_the_kernels_for_plain_swiglu_and_any_quick_geglu(cpu_ext, monkeypatch):
    calls = []
    half = lambda h: h[:, : h.shape[1] // 2] * 1
    monkeypatch.setattr(swiglu._SwiGLU, "apply", lambda h: calls.append("swiglu") or half(h))
    monkeypatch.setattr(swiglu._QuickGEGLU, "apply", lambda h, *p: calls.append(("quick_geglu",) + p) or half(h))
    h = torch.randn(3, 8)
    activation(h, "swiglu")
    activation(h, "swiglu", offset=1.0)  # Megatron's --glu-linear-offset: torch's ops
    activation(h, "swiglu", clamp=7.0)  # a clamped SwiGLU: torch's ops
    activation(h, "quick_geglu", 1.0, 7.0)  # GPT-OSS's: its own kernel, with any offset and clamp
    activation(h, "quick_geglu")
    activation(h.double(), "swiglu")  # float64 (the HF oracles): torch's ops
    activation(h.double(), "quick_geglu", 1.0, 7.0)
    assert calls == ["swiglu", ("quick_geglu", 1.702, 1.0, 7.0), ("quick_geglu", 1.702, 0.0, None)]


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


# GPT-OSS's (offset 1, clamp 7), a clamp alone, an offset alone, neither, and an offset and a clamp that bf16
# cannot hold (torch rounds both to the rows' dtype before using them)
GEGLU_CASES = [(1.0, 7.0), (0.0, 2.0), (1.0, None), (0.0, None), (1.01, 7.02)]


def _as_rows(value, dtype):
    """A Python float as torch's clamp and add meet it against rows of `dtype`."""
    return torch.tensor(value, dtype=torch.float32).to(dtype).item()


def _torch_quick_geglu(h, offset, clamp):
    """The chain of torch ops the kernel replaces (experts.activation without it)."""
    gate, up = h.chunk(2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    gated = gate * torch.sigmoid(1.702 * gate)
    return gated * (up + offset) if offset else gated * up


@pytest.mark.parametrize("offset,clamp", GEGLU_CASES, ids=str)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quick_geglu_matches_the_reference(cpu_ext, num_threads, width, dtype, offset, clamp):
    h, grad = _inputs(37, width, dtype, seed=2)
    y = cpu_ext.quick_geglu(h, 1.702, offset, clamp)
    grad_h = cpu_ext.quick_geglu_backward(grad, h, 1.702, offset, clamp)
    assert y.shape == (37, width) and grad_h.shape == h.shape and y.dtype == grad_h.dtype == dtype
    want_y = reference.quick_geglu(h, 1.702, offset, clamp)
    want_grad = reference.quick_geglu_backward(grad, h, 1.702, offset, clamp)
    # as SwiGLU's: the sigmoid within an ulp or two, 1 - s cancelling for large gates (a floor of a few ulps of the
    # largest value); the reference rounds a product of three once where torch rounds twice (fp32: an ulp more)
    for got, want in ((y, want_y), (grad_h, want_grad)):
        floor = 8 * 2.0**-23 * want.double().abs().max().item()
        within, worst = _close_in_ulps(got, want, dtype, 1, floor)
        assert within > 0.99 and _close_in_ulps(got, want, dtype, 4, floor)[0] == 1.0, (within, worst)
    if clamp is not None:  # what a clamp held gets no gradient, exactly
        gate, up, bound = *h.chunk(2, dim=-1), _as_rows(clamp, dtype)
        assert (grad_h[:, :width][gate > bound] == 0).all() and (grad_h[:, width:][up.abs() > bound] == 0).all()
        assert (gate > bound).any() and (up.abs() > bound).any()
    torch.set_num_threads(1)
    assert torch.equal(y, cpu_ext.quick_geglu(h, 1.702, offset, clamp))
    assert torch.equal(grad_h, cpu_ext.quick_geglu_backward(grad, h, 1.702, offset, clamp))


@pytest.mark.parametrize("offset,clamp", GEGLU_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quick_geglu_autograd_agrees_with_torchs_chain(cpu_ext, dtype, offset, clamp):
    h, grad = _inputs(64, 96, dtype, seed=3)
    h, grad = h.view(4, 16, 192), grad.view(4, 16, 96)
    results = []
    for fused in (True, False):
        h_ = h.clone().requires_grad_(True)
        out = activation(h_, "quick_geglu", offset, clamp) if fused else _torch_quick_geglu(h_, offset, clamp)
        out.backward(grad)
        results.append((out, h_.grad))
    for ours, theirs in zip(*results):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        if dtype == torch.bfloat16:  # rounded where torch rounds: bit for bit but where a sigmoid's bit moves one
            assert (ours == theirs).double().mean() > 0.99
            torch.testing.assert_close(ours, theirs, rtol=2**-6, atol=2**-6)
        else:
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=8 * 2.0**-23 * theirs.abs().max().item())


@pytest.mark.parametrize("offset,clamp", GEGLU_CASES, ids=str)
def test_quick_geglus_reference_is_torchs_chain(offset, clamp):
    """The oracle rounds where torch's ops round: bf16 values equal but where float64's sigmoid rounds apart."""
    h, grad = _inputs(64, 96, torch.bfloat16, seed=4)
    h_ = h.clone().requires_grad_(True)
    out = _torch_quick_geglu(h_, offset, clamp)
    out.backward(grad)
    for ours, theirs in (
        (reference.quick_geglu(h, 1.702, offset, clamp), out.detach()),
        (reference.quick_geglu_backward(grad, h, 1.702, offset, clamp), h_.grad),
    ):
        assert (ours == theirs).double().mean() > 0.99
        assert _close_in_ulps(ours, theirs, torch.bfloat16, 1, 0.0)[0] == 1.0  # the rest: a rounding apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quick_geglu_non_finite_values_follow_torch(cpu_ext, dtype):
    nan, inf = float("nan"), float("inf")
    h = torch.tensor([[0.0, 100.0, -100.0, nan, inf, -inf, 1.0, 1.0, nan, 1.0, inf, -inf, 1.0, 2.0]]).to(dtype)
    for offset, clamp in GEGLU_CASES:
        h_ = h.clone().requires_grad_(True)
        want = _torch_quick_geglu(h_, offset, clamp)
        want.backward(torch.ones_like(want))
        got = cpu_ext.quick_geglu(h, 1.702, offset, clamp)
        got_grad = cpu_ext.quick_geglu_backward(torch.ones_like(want), h, 1.702, offset, clamp)
        for ours, theirs in ((got, want.detach()), (got_grad, h_.grad)):
            assert torch.equal(ours.isnan(), theirs.isnan()), (offset, clamp, ours, theirs)
            finite = ~theirs.isnan()
            torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("offset,clamp", [(1.0, 7.0), (1.01, 7.02), (0.0, 0.0)], ids=str)
def test_quick_geglu_at_the_clamps_bounds_follows_torch(cpu_ext, offset, clamp):
    """bf16 rows at, just inside and just outside +-the bound (as torch rounds it), and signed zeros. What does not
    hang on a sigmoid is compared bit for bit: which gradients a clamp zeroes, and every zero's sign; the rest to a
    bf16 ulp (torch's sigmoid changes its last fp32 bit with the CPU's SIMD width, which may move a rounding; a
    bound that is not torch's moves values by several ulps, as 7.02 did)."""
    bound = _as_rows(clamp, torch.bfloat16)
    step = 2.0**-5 * max(bound, 1.0)
    edges = [bound, bound - step, bound + step, -bound, -bound + step, -bound - step, 0.0, -0.0, 1.0, -1.0]
    gate = torch.tensor(edges).repeat(len(edges))
    up = torch.tensor(edges).repeat_interleave(len(edges))
    h = torch.cat([gate, up]).view(1, -1).to(torch.bfloat16)
    grad = torch.linspace(-2, 2, gate.numel()).view(1, -1).to(torch.bfloat16)
    h_ = h.clone().requires_grad_(True)
    want = _torch_quick_geglu(h_, offset, clamp)
    want.backward(grad)
    for ours, theirs in (
        (cpu_ext.quick_geglu(h, 1.702, offset, clamp), want.detach()),
        (cpu_ext.quick_geglu_backward(grad, h, 1.702, offset, clamp), h_.grad),
    ):
        assert torch.equal(ours == 0, theirs == 0)
        zeros = theirs == 0
        assert torch.equal(ours[zeros].signbit(), theirs[zeros].signbit())
        assert _close_in_ulps(ours, theirs, torch.bfloat16, 1, 0.0)[0] == 1.0


def test_quick_geglu_double_backward_raises(cpu_ext):
    h = torch.randn(4, 8, requires_grad=True)
    out = swiglu.quick_geglu(h, 1.702, 1.0, 7.0)
    (grad,) = torch.autograd.grad((out * out).sum(), h, create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        grad.sum().backward()


GEGLU_BAD_INPUTS = r"""
import torch, moezero._C as C
h = torch.randn(6, 8)
cases = {
    "float32 or bfloat16": lambda: C.quick_geglu(h.double(), 1.702, 1.0, 7.0),
    "is not [gate | up]": lambda: C.quick_geglu(torch.randn(6, 7), 1.702, 1.0, None),
    "clamp -1 must be >= 0": lambda: C.quick_geglu(h, 1.702, 1.0, -1.0),
    "at half its width": lambda: C.quick_geglu_backward(torch.randn(6, 3), h, 1.702, 1.0, 7.0),
}
"""


def test_quick_geglu_bad_inputs_raise_one_clear_error_in_a_subprocess(cpu_ext):
    assert_each_case_raises(GEGLU_BAD_INPUTS)
