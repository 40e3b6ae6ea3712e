"""Routing cases and comparisons shared by the CPU and CUDA kernel tests.

Every compiled kernel module (`moezero._C`, `moezero._C_cuda`) has the same functions as
`moezero.ops.reference`; `check_*` runs one case through a module and the reference and
compares. Shape letters as in the reference: T tokens, K top-k, E experts, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moezero.ops import reference

DTYPES = (torch.float32, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Case:
    """One routing pattern; `layout` is random | skip_expert | one_expert | all_dropped."""

    T: int
    K: int
    E: int
    D: int
    layout: str = "random"
    drop: float = 0.0  # fraction of assignments dropped (id -1), as capacity dropping does

    def __str__(self):
        return f"T{self.T}-K{self.K}-E{self.E}-D{self.D}-{self.layout}-drop{self.drop}"


CASES = (
    Case(37, 2, 5, 13),
    Case(37, 2, 5, 13, drop=0.3),
    Case(50, 1, 4, 1),
    Case(29, 3, 6, 7, "skip_expert"),
    Case(31, 4, 3, 16, "one_expert"),
    Case(23, 4, 8, 5, drop=0.5),
    Case(19, 2, 4, 3, "all_dropped"),
    Case(0, 2, 4, 13),
    Case(600, 2, 8, 64, drop=0.1),  # large enough for the multi-threaded path
)


def make_ids(case: Case, device="cpu", seed=0) -> torch.Tensor:
    """topk_ids_TK: distinct experts per token (as top-k gives), -1 where dropped."""
    g = torch.Generator().manual_seed(seed)
    T, K, E = case.T, case.K, case.E
    if case.layout == "one_expert":
        ids = torch.full((T, K), 1, dtype=torch.int64)
    else:
        pool = E - 1 if case.layout == "skip_expert" else E  # expert E-1 then gets no token
        ids = torch.rand(T, pool, generator=g).argsort(dim=1)[:, :K] if T else torch.zeros(0, K, dtype=torch.int64)
    dropped = torch.rand(T, K, generator=g) < case.drop
    if case.layout == "all_dropped":
        dropped[:] = True
    return ids.masked_fill(dropped, -1).to(device)


def rand(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


def check_permute(ext, case: Case, dtype, device="cpu"):
    x = rand((case.T, case.D), dtype, device, 1)
    ids = make_ids(case, device)
    got = ext.permute(x, ids, case.E)
    want = reference.permute(x, ids, case.E)
    for g, w, name in zip(got, want, ("x_ND", "counts_E", "row_map_TK")):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name  # a permutation of rows is exact


def combine_inputs(case: Case, dtype, device="cpu"):
    ids = make_ids(case, device)
    _, _, row_map = reference.permute(torch.zeros(case.T, 1, device=device), ids, case.E)
    n = int((row_map >= 0).sum())
    y = rand((n, case.D), dtype, device, 2)
    weights = rand((case.T, case.K), torch.float32, device, 3).softmax(-1)
    grad = rand((case.T, case.D), dtype, device, 4)
    return y, row_map, weights, grad


def check_combine(ext, case: Case, dtype, device="cpu", weighted=True):
    y, row_map, weights, grad = combine_inputs(case, dtype, device)
    w = weights.to(dtype) if weighted else None
    torch.testing.assert_close(ext.unpermute_combine(y, row_map, w), reference.unpermute_combine(y, row_map, w))
    got_y, got_w = ext.unpermute_combine_backward(grad, y, row_map, w)
    want_y, want_w = reference.unpermute_combine_backward(grad, y, row_map, w)
    torch.testing.assert_close(got_y, want_y)
    if weighted:
        torch.testing.assert_close(got_w, want_w)
    else:
        assert got_w is None


def bucket_tensors(device="cpu"):
    """Mixed shapes, dtypes and empties, as a gradient bucket holds."""
    shapes = [(3, 5), (0,), (70000,), (1,), (2, 0, 3), (33, 31)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float64, torch.float32, torch.bfloat16]
    return [rand(s, dt, device, i) for i, (s, dt) in enumerate(zip(shapes, dtypes))]


def offsets_of(tensors, gap=3):
    offsets, at = [], gap
    for t in tensors:
        offsets.append(at)
        at += t.numel() + gap
    return offsets, at


def check_flatten(ext, flat_dtype, scale, accumulate, device="cpu"):
    tensors = bucket_tensors(device)
    offsets, size = offsets_of(tensors)
    start = rand((size,), flat_dtype, device, 9)
    got, want = start.clone(), start.clone()
    ext.flatten_into(got, tensors, offsets, scale, accumulate)
    reference.flatten_into(want, tensors, offsets, scale, accumulate)
    # the kernel scales before its single rounding; the reference may round twice in bf16
    tol = {"rtol": 1e-2, "atol": 1e-2} if flat_dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got, want, **tol)


def check_sum_of_squares(ext, tensors):
    got, want = ext.sum_of_squares(tensors), reference.sum_of_squares(tensors)
    assert got.dtype == want.dtype and got.shape == want.shape == ()
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-6)


_RAISE_EACH = r"""
for needle, call in cases.items():
    try:
        call()
    except RuntimeError as exc:
        assert needle in str(exc), (needle, str(exc))
    else:
        raise AssertionError(f"no error for {needle}")
print("ok")
"""


def assert_each_case_raises(cases_source: str) -> None:
    """Run `cases_source` (it defines `cases`: {message needle: call}) in a child process and check that every call
    raises a RuntimeError naming its needle: a kernel that crashes on bad input fails this test, not the run."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", cases_source + _RAISE_EACH], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
