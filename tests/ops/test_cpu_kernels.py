"""The compiled CPU kernels (moezero._C) against their references, case by case."""

import pytest
import torch

from tests.ops.helpers import (
    CASES,
    DTYPES,
    bucket_tensors,
    check_combine,
    check_flatten,
    check_permute,
    check_sum_of_squares,
    rand,
)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_permute(cpu_ext, case, dtype):
    check_permute(cpu_ext, case, dtype)


def test_permute_parallel(cpu_ext, num_threads):
    check_permute(cpu_ext, CASES[-1], torch.float32)


def test_permute_int32_ids(cpu_ext):
    x = rand((9, 4), torch.float32, "cpu", 0)
    ids = torch.tensor([[0, 2], [1, -1], [2, 0]] * 3, dtype=torch.int32)
    for got, want in zip(cpu_ext.permute(x, ids, 3), cpu_ext.permute(x, ids.long(), 3)):
        assert torch.equal(got, want)


def test_permute_rejects_out_of_range_ids(cpu_ext):
    with pytest.raises(RuntimeError, match="num_experts"):
        cpu_ext.permute(torch.zeros(2, 3), torch.tensor([[0], [4]]), 4)


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_unpermute_combine(cpu_ext, case, dtype, weighted):
    check_combine(cpu_ext, case, dtype, weighted=weighted)


def test_unpermute_combine_parallel(cpu_ext, num_threads):
    check_combine(cpu_ext, CASES[-1], torch.bfloat16)


def test_combine_backward_zeroes_unmapped_rows(cpu_ext):
    # y has a row no assignment points at: its gradient must be zero, not stale memory
    y = torch.ones(3, 4)
    row_map = torch.tensor([[0, -1], [2, -1]])
    grad_y, grad_w = cpu_ext.unpermute_combine_backward(torch.ones(2, 4), y, row_map, torch.ones(2, 2))
    assert torch.equal(grad_y[1], torch.zeros(4)) and torch.equal(grad_w[:, 1], torch.zeros(2))


def test_combine_rejects_out_of_range_rows(cpu_ext):
    with pytest.raises(RuntimeError, match="row"):
        cpu_ext.unpermute_combine(torch.ones(2, 4), torch.tensor([[0, 2]]), None)


@pytest.mark.parametrize("accumulate", [False, True], ids=["copy", "accumulate"])
@pytest.mark.parametrize("scale", [1.0, 0.125], ids=["scale1", "scale0.125"])
@pytest.mark.parametrize("flat_dtype", DTYPES, ids=str)
def test_flatten_into(cpu_ext, flat_dtype, scale, accumulate):
    check_flatten(cpu_ext, flat_dtype, scale, accumulate)


def test_flatten_into_parallel(cpu_ext, num_threads):
    check_flatten(cpu_ext, torch.float32, 0.5, True)


def test_flatten_into_non_contiguous_source(cpu_ext):
    src = rand((6, 5), torch.float32, "cpu", 0).t()
    flat = torch.zeros(30)
    cpu_ext.flatten_into(flat, [src], [0], 2.0, False)
    assert torch.equal(flat, 2.0 * src.reshape(-1))


def test_flatten_into_rejects_overflow(cpu_ext):
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_ext.flatten_into(torch.zeros(4), [torch.ones(3)], [2], 1.0, False)


@pytest.mark.parametrize(
    "name,tensors",
    [
        ("mixed", bucket_tensors()),
        ("fp32_only", [t.float() for t in bucket_tensors()]),
        ("bf16_only", [t.bfloat16() for t in bucket_tensors()]),
        ("all_empty", [torch.zeros(0), torch.zeros(3, 0)]),
        ("scalar", [torch.tensor(3.0)]),
    ],
)
def test_sum_of_squares(cpu_ext, name, tensors):
    check_sum_of_squares(cpu_ext, tensors)


def test_sum_of_squares_threads_do_not_change_the_result(cpu_ext):
    tensors = [rand((300000,), torch.float32, "cpu", i) for i in range(3)]
    results = []
    for n in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        results.append(cpu_ext.sum_of_squares(tensors))
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])
