"""The experts' bias add (csrc/bias_add.cpp) against its reference and the torch-ops path of other devices, in fp32
and bf16, with experts that got no rows and with 1 and 2 threads; both against the per-expert add and sum they
replaced."""

import pytest
import torch

from moezero.ops import bias_add, reference
from tests.ops.helpers import assert_each_case_raises

COUNTS = ([7, 0, 12, 1], [20], [0, 0], [3, 0, 0, 17, 5])
WIDTH = 300  # not a multiple of a vector


def _inputs(counts, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(sum(counts), WIDTH, generator=g) * 3).to(dtype)
    bias = torch.randn(len(counts), WIDTH, generator=g).to(dtype)
    return y, bias


@pytest.mark.parametrize("counts", COUNTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_add_has_the_bits_of_the_reference_and_of_one_add_per_expert(cpu_ext, num_threads, counts, dtype):
    y, bias = _inputs(counts, dtype)
    out = cpu_ext.grouped_bias_add(y, bias, counts)
    assert out.dtype == dtype and out.shape == y.shape
    assert torch.equal(out, reference.grouped_bias_add(y, bias, counts))
    assert torch.equal(out, bias_add._ExpertBiasOps.apply(y, bias, counts))
    assert torch.equal(out, torch.cat([rows + bias[l] for l, rows in enumerate(y.split(counts))]))


@pytest.mark.parametrize("counts", COUNTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_bias_gradient_is_each_experts_column_sums(cpu_ext, num_threads, counts, dtype):
    grad = _inputs(counts, dtype, seed=1)[0]
    sums = cpu_ext.grouped_bias_grad(grad, counts)
    assert sums.dtype == torch.float32 and sums.shape == (len(counts), WIDTH)
    exact = torch.stack([block.double().sum(0) for block in grad.split(counts)])
    torch.testing.assert_close(sums.double(), exact, rtol=1e-6, atol=1e-5)
    assert torch.equal(sums, reference.grouped_bias_grad(grad, counts))  # the same order: the same bits
    torch.set_num_threads(1)  # threads split the columns: the same bits whatever their number
    assert torch.equal(sums, cpu_ext.grouped_bias_grad(grad, counts))


def _forward_and_grads(function, y, bias, grad, counts):
    y, bias = y.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    out = function(y, bias, counts)
    out.backward(grad)
    return out, y.grad, bias.grad


class _OneOpPerExpert(torch.autograd.Function):
    """What the experts did before: one broadcast add per expert, and torch's `sum` per expert (in the bias's
    dtype) for its gradient."""

    @staticmethod
    def forward(ctx, y, bias, counts):
        ctx.counts, ctx.bias_dtype = counts, bias.dtype
        return torch.cat([rows + bias[l].to(y.dtype) for l, rows in enumerate(y.split(counts))])

    @staticmethod
    def backward(ctx, grad):
        sums = torch.stack([block.sum(0, dtype=ctx.bias_dtype) for block in grad.split(ctx.counts)])
        return grad, sums, None


@pytest.mark.parametrize(
    "dtype, bias_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
    ],
    ids=str,
)
def test_autograd_of_the_kernel_and_of_the_ops_gives_the_same_bits(cpu_ext, dtype, bias_dtype):
    counts = [9, 0, 30, 4]
    y, bias = _inputs(counts, dtype, seed=2)
    bias = bias.to(bias_dtype)
    grad = _inputs(counts, dtype, seed=3)[0]
    ops = _forward_and_grads(bias_add._ExpertBiasOps.apply, y, bias, grad, counts)
    assert ops[2].dtype == bias_dtype
    if dtype != torch.float64:  # the kernel takes fp32 and bf16 rows
        kernel = _forward_and_grads(bias_add._FusedExpertBias.apply, y, bias, grad, counts)
        assert all(torch.equal(a, b) for a, b in zip(kernel, ops))
    # against one op per expert: the same add; the same sums in another order (torch's cascade), rounded to the
    # bias's dtype
    out, grad_y, grad_b = _forward_and_grads(_OneOpPerExpert.apply, y, bias, grad, counts)
    assert torch.equal(ops[0], out) and torch.equal(ops[1], grad_y)
    tolerance = {
        torch.float32: dict(rtol=1e-5, atol=1e-4),
        torch.bfloat16: dict(rtol=2**-7, atol=1e-2),
        torch.float64: dict(rtol=1e-13, atol=1e-13),
    }[bias_dtype]
    torch.testing.assert_close(ops[2], grad_b, **tolerance)


def test_both_ways_of_the_torch_ops_sum_in_row_order(monkeypatch):
    """Eager on the CPU index_add_ sums, elsewhere (CUDA, torch.compile) segment_reduce: the same bits as the
    reference's row order (no extension needed)."""
    counts = [5, 0, 11, 2]
    grad = _inputs(counts, torch.bfloat16, seed=5)[0]
    want = reference.grouped_bias_grad(grad, counts)
    assert torch.equal(bias_add._segment_sums(grad, counts), want)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(bias_add._segment_sums(grad, counts), want)
    assert bias_add._segment_sums(grad.double(), counts).dtype == torch.float64


def test_the_experts_take_the_kernel_where_it_applies(cpu_ext, monkeypatch):
    calls = []
    monkeypatch.setattr(bias_add._FusedExpertBias, "apply", lambda *a: calls.append(a) or a[0] + 0)
    y, bias = _inputs([2, 3], torch.float32)
    bias_add.add_expert_bias(y, bias, [2, 3])
    assert len(calls) == 1
    assert not bias_add.fused_bias_add_applies(y.double())  # float64 (the HF oracles): the torch ops
    bias_add.add_expert_bias(y.double(), bias.double(), [2, 3])
    assert len(calls) == 1


def test_a_second_derivative_goes_through_the_bias_gradient(cpu_ext):
    """The kernel's sums build no graph: with create_graph the backward takes torch's, so a gradient of the bias
    gradient is the torch ops', not silently zero."""
    counts = [3, 0, 5]
    y, bias = _inputs(counts, torch.float32, seed=4)
    seconds = []
    for function in (bias_add._FusedExpertBias, bias_add._ExpertBiasOps):
        y_, b_ = y.clone().requires_grad_(True), bias.clone().requires_grad_(True)
        out = function.apply(y_, b_, counts)
        (grad_b,) = torch.autograd.grad((out * out).sum(), b_, create_graph=True)
        (second,) = torch.autograd.grad((grad_b * grad_b).sum(), y_)
        seconds.append(second)
    assert seconds[0].abs().sum() > 0
    assert torch.equal(seconds[0], seconds[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_gpu_path_sums_in_row_order_and_launches_no_op_per_expert(dtype):
    """On CUDA (tools/gpu_check.sh): the torch ops give the CPU reference's bits (segment_reduce sums each column of
    each expert in row order, no atomics: the same bits run after run), with a launch count that does not grow
    with the experts."""
    counts = [40, 0, 300, 17] * 32  # 128 experts, GPT-OSS-120B's
    y, bias = _inputs(counts, dtype, seed=6)
    grad = _inputs(counts, dtype, seed=7)[0]
    runs = [
        _forward_and_grads(bias_add._ExpertBiasOps.apply, *(t.cuda() for t in (y, bias, grad)), counts)
        for _ in range(2)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    cpu = _forward_and_grads(bias_add._ExpertBiasOps.apply, y, bias, grad, counts)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(runs[0], cpu))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _forward_and_grads(bias_add._ExpertBiasOps.apply, *(t.cuda() for t in (y, bias, grad)), counts)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) < 40, [e.name for e in kernels]


BAD_INPUTS = r"""
import torch, moezero._C as C
y, b = torch.randn(6, 8), torch.randn(2, 8)
cases = {
    "counts exceed": lambda: C.grouped_bias_add(y, b, [4, 4]),
    "counts add up": lambda: C.grouped_bias_add(y, b, [2, 2]),
    "bias_LF must be": lambda: C.grouped_bias_add(y, torch.randn(3, 8), [2, 4]),
    "dtype differs": lambda: C.grouped_bias_add(y, b.bfloat16(), [2, 4]),
    "float32 or bfloat16": lambda: C.grouped_bias_add(y.double(), b.double(), [2, 4]),
    "contiguous 2-D": lambda: C.grouped_bias_add(y.t(), torch.randn(2, 6), [4, 4]),
    "grad_MF must be float32": lambda: C.grouped_bias_grad(y.double(), [6]),
    "grouped_bias_grad: counts add up": lambda: C.grouped_bias_grad(y, [1]),
}
"""


def test_bad_inputs_raise_one_clear_error_in_a_subprocess(cpu_ext):
    """Wrong counts, shapes or dtypes are a RuntimeError naming the problem, never a crash."""
    assert_each_case_raises(BAD_INPUTS)
