"""The CUDA kernels (moezero._C_cuda) against their references; runs only on a GPU machine.

The kernels wired into the public ops on CUDA (moezero/ops/_library.py WIRED["cuda"]) passed these on an
H200; tools/gpu_check.sh runs this file.
"""

import pytest
import torch

from moezero.ops import _loader
from tests.ops.helpers import (
    CASES,
    DTYPES,
    bucket_tensors,
    check_combine,
    check_flatten,
    check_permute,
    check_sum_of_squares,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_ext():
    ext = _loader.load("cuda")
    assert ext is not None, "moezero._C_cuda is not built: run tools/gpu_check.sh (it builds with CUDA)"
    return ext


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_permute(cuda_ext, case, dtype):
    check_permute(cuda_ext, case, dtype, device="cuda")


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_unpermute_combine(cuda_ext, case, dtype, weighted):
    check_combine(cuda_ext, case, dtype, device="cuda", weighted=weighted)


@pytest.mark.parametrize("accumulate", [False, True], ids=["copy", "accumulate"])
@pytest.mark.parametrize("flat_dtype", DTYPES, ids=str)
def test_flatten_into(cuda_ext, flat_dtype, accumulate):
    check_flatten(cuda_ext, flat_dtype, 0.125, accumulate, device="cuda")


def test_sum_of_squares(cuda_ext):
    check_sum_of_squares(cuda_ext, bucket_tensors("cuda"))
    check_sum_of_squares(cuda_ext, [t.float() for t in bucket_tensors("cuda")])


def test_permute_large(cuda_ext):
    # many tiles and experts: exercises the cross-tile scan and the per-warp ranks
    from tests.ops.helpers import Case

    check_permute(cuda_ext, Case(16384, 2, 64, 256, drop=0.1), torch.bfloat16, device="cuda")


def test_public_ops_on_cuda_match_cpu_reference(cuda_ext, monkeypatch):
    """permute -> expert -> combine through torch.ops.moezero with every CUDA kernel wired in."""
    from moezero.ops import _library
    from tests.ops.helpers import Case, make_ids, rand
    from tests.ops.test_library import moe_like

    monkeypatch.setattr(_library, "WIRED", {"cuda": frozenset(_library.OPS), "cpu": frozenset()})
    case = Case(300, 2, 8, 24, drop=0.2)
    ids = make_ids(case)
    results = []
    for device in ("cpu", "cuda"):
        x = rand((case.T, case.D), torch.float64, device, 0).requires_grad_()
        w = rand((case.T, case.K), torch.float64, device, 1).requires_grad_()
        out = moe_like(x, w, ids.to(device), case.E)
        out.backward(torch.ones_like(out))
        results.append([t.detach().cpu() for t in (out, x.grad, w.grad)])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want)
