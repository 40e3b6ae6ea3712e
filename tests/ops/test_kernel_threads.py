"""The element-wise CPU kernels split over OpenMP threads give the bits of one thread, on inputs large enough to
split: a kernel splits only work of 2 x 2^15 elements or more (cpu_utils.h threads_for), which the other tests'
small inputs never reach, so their "2threads" runs take the one-thread path. The sums over rows (the experts'
bias gradients, RMSNorm's weight gradient) split by columns, each summed in row order; their exact claims (the
reference's row-order sums) are checked here at two threads too."""

import pytest
import torch

from moezero.ops import reference

ROWS, WIDTH = 160, 1024  # 163,840 elements: split in 2 at 2 threads (torch.set_num_threads sets the kernels'
assert ROWS * WIDTH >= 2 * 2**15  # OpenMP too: one libgomp), in 5 on a machine with more cores
COUNTS = [40, 0, 100, 20]  # experts' rows, one of them empty


def _rows(dtype, seed, rows=ROWS, width=WIDTH):
    return (torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def _cases(ext, dtype):
    """name -> a call of the kernels that returns a tuple of tensors."""
    y, grad, x = _rows(dtype, 0), _rows(dtype, 1), _rows(dtype, 2)
    bias, weight = _rows(dtype, 3, len(COUNTS)), _rows(dtype, 4, 1)[0]
    gated, gated_grad = _rows(dtype, 5, width=2 * WIDTH), _rows(dtype, 6)
    logits = _rows(dtype, 7, 64, 4096)
    labels = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(8))
    labels[::7] = -100

    def bias_gelu():
        a, h = ext.bias_gelu(y, bias, COUNTS, False)
        return (a, h) + tuple(ext.bias_gelu_backward(grad, h, COUNTS, True))

    def rms_norm():
        out, rstd = ext.rms_norm(x, weight, 1e-5)
        return (out, rstd) + tuple(ext.rms_norm_backward(grad, x, rstd, weight, True))

    def cross_entropy():
        losses, lse = ext.cross_entropy(logits, labels, -100)
        return losses, lse, ext.cross_entropy_backward(torch.ones_like(losses), logits, labels, lse, -100)

    return {
        "bias_gelu": bias_gelu,
        "bias_add": lambda: (ext.grouped_bias_add(y, bias, COUNTS), ext.grouped_bias_grad(grad, COUNTS)),
        "rms_norm": rms_norm,
        "swiglu": lambda: (ext.swiglu(gated), ext.swiglu_backward(gated_grad, gated)),
        "quick_geglu": lambda: (
            ext.quick_geglu(gated, 1.702, 1.0, 7.0),
            ext.quick_geglu_backward(gated_grad, gated, 1.702, 1.0, 7.0),
        ),
        "cross_entropy": cross_entropy,
    }


CASES = ("bias_gelu", "bias_add", "rms_norm", "swiglu", "quick_geglu", "cross_entropy")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_two_threads_give_one_threads_bits(cpu_ext, case, dtype):
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            runs.append(_cases(cpu_ext, dtype)[case]())
    finally:
        torch.set_num_threads(before)
    for two, one in zip(*runs):
        assert torch.equal(two, one), case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_column_sums_are_the_references_row_order_sums(cpu_ext, dtype):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grad = _rows(dtype, 1)
        assert torch.equal(cpu_ext.grouped_bias_grad(grad, COUNTS), reference.grouped_bias_grad(grad, COUNTS))
        grad_h, bias_sums = cpu_ext.bias_gelu_backward(grad, _rows(dtype, 9), COUNTS, True)
        assert torch.equal(bias_sums, reference.grouped_bias_grad(grad_h, COUNTS))
    finally:
        torch.set_num_threads(before)
