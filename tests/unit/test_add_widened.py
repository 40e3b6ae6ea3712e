"""comm.add_widened_, the fp32 sum of the bf16 (fp16) reduce-scatter pieces: the bits of out.add_(term) for sizes
on both sides of its chunk, so the chunked path changes no number of the reduction."""

import pytest
import torch

from moezero.parallel import comm

CHUNK = comm._WIDEN_CHUNK


@pytest.mark.parametrize("n", [5, CHUNK, CHUNK + 1, 3 * CHUNK + 7])
@pytest.mark.parametrize(
    "narrow,wide",
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float64)],
    ids=str,
)
def test_same_bits_as_add(n, narrow, wide):
    g = torch.Generator().manual_seed(n)
    out = torch.randn(n, generator=g, dtype=wide) * 1e3
    term = torch.randn(n, generator=g, dtype=torch.float32).to(narrow)
    expected = out.clone().add_(term)
    comm.add_widened_(out, term)
    assert torch.equal(out, expected)


def test_same_dtype_is_a_plain_add():
    out, term = torch.ones(CHUNK + 3), torch.full((CHUNK + 3,), 2.0)
    comm.add_widened_(out, term)
    assert torch.equal(out, torch.full((CHUNK + 3,), 3.0))
