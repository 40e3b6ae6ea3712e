"""The fused bias + GELU kernel (csrc/gelu.cpp), exact and tanh-approximated, against its float64 reference, and
its autograd against torch's GELU on the biased input, in fp32 and bf16, with experts that got no rows and with 1
and 2 threads."""

import pytest
import torch
import torch.nn.functional as F

from moezero.ops import gelu, reference
from tests.ops.helpers import assert_each_case_raises

COUNTS = ([7, 0, 12, 1], [20], [0, 0], [3, 0, 0, 17, 5])
WIDTH = 300  # not a multiple of the bf16 block (256) nor of a vector


def _inputs(counts, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(sum(counts), WIDTH, generator=g) * 3).to(dtype)
    bias = torch.randn(len(counts), WIDTH, generator=g).to(dtype)
    return y, bias


def _ulps(dtype):
    return 2.0**-7 if dtype == torch.bfloat16 else 2.0**-23


def _assert_close_in_ulps(got, want, dtype, ulps=1, atol=0.0):
    tol = ulps * _ulps(dtype) * want.abs().double() + atol
    excess = (got.double() - want.double()).abs() - tol
    assert excess.max().item() <= 0 if excess.numel() else True, excess.max().item()


@pytest.mark.parametrize("counts", COUNTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("tanh", [False, True], ids=["erf", "tanh"])
def test_forward_matches_the_reference(cpu_ext, num_threads, counts, dtype, with_bias, tanh):
    y, bias = _inputs(counts, dtype)
    bias = bias if with_bias else None
    a, h = cpu_ext.bias_gelu(y, bias, counts, tanh)
    a_ref, h_ref = reference.bias_gelu(y, bias, counts, tanh)
    assert a.dtype == h.dtype == dtype and a.shape == h.shape == y.shape
    assert torch.equal(h, h_ref)  # GELU's input, one rounded add: the bits of y + bias
    assert bias is not None or h.data_ptr() == y.data_ptr()  # no bias: y itself, no copy
    # erf's Abramowitz-Stegun form (as torch's own CPU GELU) is good to 1.5e-7 absolute, so h * cdf to |h| times
    # that, on top of the rounding; tanh's s = sigmoid(2u) inherits u's fp32 rounding times 2|u| in the tail
    _assert_close_in_ulps(a, a_ref, dtype, ulps=1, atol=2e-7 * (1 + h.double().abs()))


@pytest.mark.parametrize("counts", COUNTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tanh", [False, True], ids=["erf", "tanh"])
def test_backward_matches_the_reference(cpu_ext, num_threads, counts, dtype, tanh):
    g_a, h = _inputs(counts, dtype, seed=1)
    h = (torch.randn(sum(counts), WIDTH, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    grad_h, grad_b = cpu_ext.bias_gelu_backward(g_a, h, counts, True, tanh)
    ref_h, ref_b = reference.bias_gelu_backward(g_a, h, counts, True, tanh)
    # gelu'(h) in fp32 to the erf form's 4e-7 (the tanh form's u rounding), then one rounding of the product
    _assert_close_in_ulps(grad_h, ref_h, dtype, ulps=1, atol=4e-7 * g_a.double().abs())
    assert grad_b.dtype == torch.float32 and grad_b.shape == (len(counts), WIDTH)
    torch.testing.assert_close(grad_b, reference.grouped_bias_grad(grad_h, counts), rtol=0, atol=0)  # row order
    torch.testing.assert_close(grad_b, ref_b, rtol=1e-5, atol=1e-4 if dtype == torch.float32 else 5e-2)
    assert torch.equal(cpu_ext.bias_gelu_backward(g_a, h, counts, False, tanh)[0], grad_h)
    assert cpu_ext.bias_gelu_backward(g_a, h, counts, False, tanh)[1] is None


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bf16_gradients_are_torchs_gelu_backward(cpu_ext, approximate):
    """gelu'(h) in fp32 and one rounding, as torch's gelu_backward: bf16 gradients bit for bit but where the erf
    form or the exp moves a rounding (the version that saved a bf16 gelu'(h) differed in 27% of them)."""
    g = torch.Generator().manual_seed(6)
    h = (torch.randn(256, 300, generator=g) * 2).bfloat16()
    grad = torch.randn(256, 300, generator=g).bfloat16()
    ours, _ = cpu_ext.bias_gelu_backward(grad, h, [256], False, approximate == "tanh")
    h_ = h.clone().requires_grad_(True)
    F.gelu(h_, approximate=approximate).backward(grad)
    assert (ours == h_.grad).double().mean() > 0.98
    # the rest an ulp apart, or (the tanh form's far tail, where torch's own tanh is off) 2e-7 absolute
    _assert_close_in_ulps(ours, h_.grad, torch.bfloat16, ulps=1, atol=1e-6 * grad.double().abs() + 2e-7)


def _slope(ext, y, tanh=False):
    """gelu'(y) as the kernel's backward computes it (a gradient of ones)."""
    return ext.bias_gelu_backward(torch.ones_like(y), y, [y.shape[0]], False, tanh)[0]


def test_non_finite_and_tail_values(cpu_ext):
    y = torch.tensor([[float("nan"), float("inf"), -40.0, 40.0, 0.0, -5.0, 1e-30]])
    a, d = cpu_ext.bias_gelu(y, None, [1])[0], _slope(cpu_ext, y)
    assert torch.isnan(a[0, 0]) and torch.isnan(d[0, 0])
    assert a[0, 1] == float("inf")
    assert a[0, 2].item() == 0.0 and d[0, 2].item() == 0.0  # exp(-800) is 0, as torch's
    assert a[0, 3].item() == 40.0 and d[0, 3].item() == 1.0
    assert a[0, 4].item() == 0.0 and d[0, 4].item() == 0.5
    assert abs(a[0, 5].item() - (-5 * 2.866515718791939e-07)) < 5e-7  # the absolute bound of the erf form
    ab, _ = cpu_ext.bias_gelu(y.bfloat16(), None, [1])
    assert torch.isnan(ab[0, 0]) and ab[0, 1] == float("inf")


def test_non_finite_and_tail_values_of_the_tanh_form(cpu_ext):
    y = torch.tensor([[float("nan"), float("inf"), -40.0, 40.0, 0.0, -5.0, 1e-30, float("-inf")]])
    a, d = cpu_ext.bias_gelu(y, None, [1], True)[0], _slope(cpu_ext, y, True)
    want = F.gelu(y.double(), approximate="tanh")
    assert torch.isnan(a[0, 0]) and torch.isnan(d[0, 0]) and torch.isnan(a[0, 7]) == torch.isnan(want[0, 7])
    assert a[0, 1] == float("inf")
    assert a[0, 2].item() == 0.0 and d[0, 2].item() == 0.0  # exp(-2|u|) is 0 past 87: the tail is exactly 0
    assert a[0, 3].item() == 40.0 and d[0, 3].item() == 1.0
    assert a[0, 4].item() == 0.0 and d[0, 4].item() == 0.5
    assert abs(a[0, 5].item() / want[0, 5].item() - 1) < 1e-6 and a[0, 6] == y[0, 6] / 2  # s(0) = 1/2 exactly
    big = torch.tensor([[1e20, -1e20]])
    huge, d_huge = cpu_ext.bias_gelu(big, None, [1], True)[0], _slope(cpu_ext, big, True)  # h^2 overflows: no 0 * inf
    assert huge[0, 0] == big[0, 0] and huge[0, 1] == 0 and d_huge.tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_autograd_matches_torch_gelu_of_the_biased_input(cpu_ext, dtype, approximate):
    counts = [5, 0, 9, 2]
    y, bias = _inputs(counts, dtype, seed=2)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(dtype)

    def run(fused):
        y_, b_ = y.clone().requires_grad_(), bias.clone().requires_grad_()
        assert gelu.fused_gelu_applies(y_, b_)
        if fused:
            out = gelu.bias_gelu(y_, b_, counts, approximate)
        else:
            out = F.gelu(y_ + torch.repeat_interleave(b_, torch.tensor(counts), dim=0), approximate=approximate)
        out.backward(grad)
        return out, y_.grad, b_.grad

    (out, gy, gb), (out_t, gy_t, gb_t) = run(True), run(False)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2e-2)
    torch.testing.assert_close(out, out_t, **tol)
    torch.testing.assert_close(gy, gy_t, **tol)
    torch.testing.assert_close(
        gb.float(), gb_t.float(), **(tol if dtype == torch.float32 else dict(rtol=2**-6, atol=6e-2))
    )
    assert gb.dtype == dtype


def test_falls_back_where_the_kernel_does_not_apply(cpu_ext):
    y = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    assert not gelu.fused_gelu_applies(y)  # float64: torch's GELU (the HF oracles')
    assert not gelu.fused_gelu_applies(torch.randn(4, 8))  # no gradient needed: no derivative to save
    with torch.no_grad():
        assert not gelu.fused_gelu_applies(torch.randn(4, 8, requires_grad=True))
    assert gelu.fused_gelu_applies(torch.randn(4, 8, requires_grad=True))


BAD_INPUTS = r"""
import torch, moezero._C as C
y, b = torch.randn(6, 8), torch.randn(2, 8)
cases = {
    "counts exceed": lambda: C.bias_gelu(y, b, [4, 4]),
    "counts add up": lambda: C.bias_gelu(y, b, [2, 2]),
    "bias_LF must be": lambda: C.bias_gelu(y, torch.randn(3, 8), [2, 4]),
    "dtype differs": lambda: C.bias_gelu(y, b.bfloat16(), [2, 4]),
    "float32 or bfloat16": lambda: C.bias_gelu(y.double(), None, [6]),
    "contiguous 2-D": lambda: C.bias_gelu(y.t(), None, [8]),
    "differ in shape": lambda: C.bias_gelu_backward(y, y[:5], [6], False),
    "add up to": lambda: C.bias_gelu(y, b, [2, 2], True),
    "must be float32": lambda: C.bias_gelu(y.double(), None, [6], True),
}
"""


def test_bad_inputs_raise_one_clear_error_in_a_subprocess(cpu_ext):
    """Wrong counts, shapes or dtypes are a RuntimeError naming the problem, never a crash (run in a child: a
    segfault there fails this test instead of the whole run)."""
    assert_each_case_raises(BAD_INPUTS)


def test_an_unknown_approximation_is_one_clear_error(cpu_ext):
    with pytest.raises(ValueError, match="approximate='erf'"):
        gelu.bias_gelu(torch.randn(2, 4, requires_grad=True), approximate="erf")


def test_double_backward_raises_instead_of_dropping_the_second_derivative(cpu_ext):
    """The kernel's backward builds no graph: differentiating through it again must raise, not give a gradient
    that silently misses the GELU's second derivative."""
    y = torch.randn(4, 8, requires_grad=True)
    out = gelu.bias_gelu(y)
    (grad,) = torch.autograd.grad((out * out).sum(), y, create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        grad.sum().backward()
