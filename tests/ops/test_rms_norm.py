"""The RMSNorm kernel (csrc/rms_norm.cpp) against its float64 reference and against torch's own RMSNorm (the oracle
for what a model computes), forward and backward, fp32 and bf16, with and without a weight, widths off the vector
length, 1 and 2 threads."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from moezero.ops import reference, rms_norm
from tests.ops.helpers import assert_each_case_raises

WIDTHS = (300, 7, 1024)


def _inputs(rows, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    weight = (torch.rand(width, generator=g) + 0.5).to(dtype)
    return x, weight, torch.randn(rows, width, generator=g).to(dtype)


def _ulp(dtype):
    return 2.0**-7 if dtype == torch.bfloat16 else 2.0**-23


def _assert_within_ulps(got, want, dtype, ulps, floor):
    """|got - want| <= ulps * ulp * |want| + floor (floor: the scale of the row's values, for cancellations)."""
    excess = (got.double() - want.double()).abs() - ulps * _ulp(dtype) * want.double().abs() - floor
    assert excess.max().item() <= 0, excess.max().item()


def _sum_bound(width):
    """Relative error bound of the kernel's fp32 row sums: width / 8 terms a lane, 3 pairwise combinations."""
    return (width // 8 + 4) * 2.0**-24


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "noweight"])
def test_forward_matches_the_reference(cpu_ext, num_threads, width, dtype, with_weight):
    x, weight, _ = _inputs(33, width, dtype)
    weight = weight if with_weight else None
    y, rstd = cpu_ext.rms_norm(x, weight, 1e-5)
    y_ref, rstd_ref = reference.rms_norm(x, weight, 1e-5)
    assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (33,)
    # rstd: the bound of 8 fp32 running sums of width / 8 squares, combined pairwise (half of it after the sqrt),
    # on any input; y from that rstd: x * rstd * w in fp32 and one rounding, against the same in float64
    torch.testing.assert_close(rstd, rstd_ref, rtol=_sum_bound(width), atol=0)
    exact = x.double() * rstd.double()[:, None]
    exact = (exact if weight is None else exact * weight.double()).to(dtype)
    _assert_within_ulps(y, exact, dtype, 1 if dtype == torch.bfloat16 else 2, 0)
    torch.set_num_threads(1)  # each row is summed by one thread: the same bits whatever their number
    assert torch.equal(y, cpu_ext.rms_norm(x, weight, 1e-5)[0])


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "noweight"])
def test_backward_matches_the_reference(cpu_ext, num_threads, width, dtype, with_weight):
    x, weight, grad = _inputs(40, width, dtype, seed=1)
    weight = weight if with_weight else None
    rstd = cpu_ext.rms_norm(x, weight, 1e-5)[1]
    grad_x, grad_w = cpu_ext.rms_norm_backward(grad, x, rstd, weight, with_weight)
    ref_x, ref_w = reference.rms_norm_backward(grad, x, rstd, weight, with_weight)
    assert grad_x.dtype == dtype
    # the row's fp32 dot mean(gw * x) can cancel: its error bound, times the largest value, on top of an ulp
    floor = max(64 * 2.0**-23, 2 * _sum_bound(width)) * ref_x.double().abs().max()
    _assert_within_ulps(grad_x, ref_x, dtype, 1, floor)
    if with_weight:
        assert grad_w.dtype == torch.float32 and grad_w.shape == (width,)
        torch.testing.assert_close(grad_w, ref_w, rtol=1e-5, atol=1e-4)
        torch.set_num_threads(1)  # threads split the columns, each summing its rows in order
        assert torch.equal(grad_w, cpu_ext.rms_norm_backward(grad, x, rstd, weight, True)[1])
    else:
        assert grad_w is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 9, 64), (5, 300)], ids=str)
def test_autograd_agrees_with_torchs_rms_norm(cpu_ext, dtype, shape):
    """Against torch's F.rms_norm, what an nn.RMSNorm computes: bf16 to an ulp where a row's rstd differs in its last
    fp32 bit (most elements bit for bit), fp32 to a few ulps."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(*shape, generator=g) * 2).to(dtype)
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    grad = torch.randn(*shape, generator=g).to(dtype)
    results = []
    for norm in (rms_norm.rms_norm, F.rms_norm):
        x_, w_ = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = norm(x_, [shape[-1]], w_, 1e-6)
        out.backward(grad)
        results.append((out, x_.grad, w_.grad))
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2e-2)
    for ours, theirs in zip(*results):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, **tolerance)
    if dtype == torch.bfloat16:
        assert (results[0][0] == results[1][0]).float().mean() > 0.99


def test_the_models_rms_norms_take_the_kernel_and_fall_back_elsewhere(cpu_ext, monkeypatch):
    from moezero.models.attention import RMSNorm, RMSNorm1p

    calls = []
    monkeypatch.setattr(rms_norm._RMSNorm, "apply", lambda x, w, eps: calls.append(eps) or x * 1)
    norm = RMSNorm(16, eps=1e-5)
    assert isinstance(norm, torch.nn.RMSNorm) and list(norm.state_dict()) == ["weight"]
    norm(torch.randn(3, 16))
    RMSNorm1p(16, eps=1e-6)(torch.randn(3, 16))
    assert calls == [1e-5, 1e-6]
    norm.double()(torch.randn(3, 16, dtype=torch.float64))  # float64 (the HF oracles): torch's
    with warnings.catch_warnings():  # torch warns that it cannot fuse either
        warnings.simplefilter("ignore")
        rms_norm.rms_norm(torch.randn(3, 16), [16], torch.ones(16).bfloat16(), 1e-5)  # a weight of another dtype
    rms_norm.rms_norm(torch.randn(0, 16), [16], torch.ones(16), 1e-5)  # no rows
    assert len(calls) == 2
    with pytest.raises(RuntimeError):  # a shape torch refuses is torch's error
        rms_norm.rms_norm(torch.randn(3, 16), [8], None, 1e-5)
    with pytest.raises(RuntimeError, match="same shape"):  # a weight of the right size, the wrong shape too
        rms_norm.rms_norm(torch.randn(3, 2, 4), [2, 4], torch.ones(8), 1e-5)
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_no_eps_is_torchs_default_eps(cpu_ext, dtype):
    """eps=None (nn.RMSNorm's default): torch takes its computation dtype's eps, fp32's also for bf16 rows (bf16's
    would be 2^-7); on rows small enough for eps to matter the kernel's values are torch's (fp32: the rstd's
    bound, width/8 + 4 ulps, and y's 2, on any CPU; the wrong eps was off by up to 99%)."""
    x = (torch.randn(6, 64, generator=torch.Generator().manual_seed(4)) * 1e-3).to(dtype)
    torch.testing.assert_close(
        rms_norm.rms_norm(x, [64], None, None),
        F.rms_norm(x, [64], None, None),
        rtol=2**-7 if dtype == torch.bfloat16 else 4e-6,
        atol=0,
    )
    from moezero.models.attention import RMSNorm

    ours, theirs = RMSNorm(64).to(dtype), torch.nn.RMSNorm(64).to(dtype)
    torch.testing.assert_close(ours(x), theirs(x), rtol=2**-7 if dtype == torch.bfloat16 else 4e-6, atol=0)


def test_double_backward_raises_instead_of_dropping_the_second_derivative(cpu_ext):
    x = torch.randn(4, 8, requires_grad=True)
    out = rms_norm.rms_norm(x, [8], None, 1e-5)
    (grad,) = torch.autograd.grad((out * out * out).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        grad.sum().backward()


BAD_INPUTS = r"""
import torch, moezero._C as C
x, w = torch.randn(6, 8), torch.randn(8)
rstd = C.rms_norm(x, w, 1e-5)[1]
cases = {
    "float32 or bfloat16": lambda: C.rms_norm(x.double(), None, 1e-5),
    "contiguous 2-D": lambda: C.rms_norm(x.t(), None, 1e-5),
    "weight must be": lambda: C.rms_norm(x, torch.randn(7), 1e-5),
    "weight's dtype differs": lambda: C.rms_norm(x, w.bfloat16(), 1e-5),
    "differ in shape": lambda: C.rms_norm_backward(x[:5], x, rstd, w, True),
    "rstd_N must be": lambda: C.rms_norm_backward(x, x, rstd[:5], w, True),
}
"""


def test_bad_inputs_raise_one_clear_error_in_a_subprocess(cpu_ext):
    """Wrong shapes or dtypes are a RuntimeError naming the problem, never a crash."""
    assert_each_case_raises(BAD_INPUTS)
