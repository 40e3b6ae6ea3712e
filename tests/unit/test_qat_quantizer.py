"""QAT building blocks: group-wise quantization, straight-through fake quant, packing, the bit schedule."""

import pytest
import torch

from moezero.compression.packing import pack_rows, storage_kind, unpack_rows
from moezero.compression.quantizer import fake_quantize, fake_quantize_per_token, quantize_rows, to_rows
from moezero.compression.bits_schedule import bits_at


def _rows(seed=0, shape=(6, 50)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05 + 0.01


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_every_group_has_at_most_2_to_the_bits_values(bits, symmetric):
    w = _rows(shape=(4, 3, 64))  # 4 experts, 8 groups each
    noise = torch.rand(w.shape, generator=torch.Generator().manual_seed(1))
    for n in (None, noise):
        w_hat = fake_quantize(w, bits, units=4, groups=8, symmetric=symmetric, noise=n)
        rows = w_hat.reshape(32, -1)
        assert max(r.unique().numel() for r in rows) <= 2**bits
        assert w_hat.shape == w.shape and w_hat.dtype == w.dtype


def test_error_falls_with_bits_and_zero_stays_exact():
    w = _rows()
    w[0] = 0.0
    errors = []
    for bits in (2, 4, 8, 16):
        for symmetric in (True, False):
            w_hat = quantize_rows(w, bits, symmetric).dequantize()
            assert torch.all(w_hat[0] == 0)
            errors.append(((w_hat - w).norm() / w.norm()).item())
    assert errors[-1] < 1e-4 and errors[0] > errors[2] > errors[4] > errors[6]


def test_straight_through_gradient_and_exact_grid_values():
    w = _rows().requires_grad_(True)
    w_hat = fake_quantize(w, 4, units=1, groups=6, symmetric=True)
    rq = quantize_rows(to_rows(w.detach(), 1, 6), 4, True)
    assert torch.equal(w_hat, rq.dequantize().view_as(w))  # the forward uses grid values exactly
    (w_hat * torch.arange(w.numel()).view_as(w)).sum().backward()
    assert torch.equal(w.grad, torch.arange(w.numel(), dtype=w.dtype).view_as(w))


def test_stochastic_rounding_is_unbiased():
    w = _rows(shape=(1, 40))
    g = torch.Generator().manual_seed(3)
    mean = sum(quantize_rows(w, 3, True, torch.rand(w.shape, generator=g)).dequantize() for _ in range(4000)) / 4000
    nearest = quantize_rows(w, 3, True).dequantize()
    assert (mean - w).abs().max() < 0.25 * (nearest - w).abs().max()


def test_expert_groups_do_not_depend_on_how_experts_are_stacked():
    """ep 1 stacks 4 experts, ep 2 stacks 2 per rank: every expert is quantized the same way."""
    w = _rows(shape=(4, 8, 12))
    whole = fake_quantize(w, 3, units=4, groups=2, symmetric=False)
    halves = torch.cat([fake_quantize(w[:2], 3, 2, 2, False), fake_quantize(w[2:], 3, 2, 2, False)])
    assert torch.equal(whole, halves)


def test_per_token_activation_quantization():
    x = _rows(shape=(2, 5, 16)).requires_grad_(True)
    x_hat = fake_quantize_per_token(x, 4)
    assert max(r.unique().numel() for r in x_hat.reshape(10, 16)) <= 15
    assert torch.equal(fake_quantize_per_token(x[:, :2], 4), x_hat[:, :2])  # a token's scale is its own
    x_hat.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [2, 4, 5, 8, 12, 16])
def test_packing_round_trips(bits, symmetric):
    w = _rows(shape=(6, 7))  # odd rows: int4 pads one nibble per row
    rq = quantize_rows(w, bits, symmetric)
    packed = pack_rows(rq.q_RN, bits, symmetric)
    kind = storage_kind(bits)
    expected = {"int4": (torch.uint8, (6, 4)), "int8": (torch.uint8, (6, 7)), "int16": (torch.int16, (6, 7))}[kind]
    assert (packed.dtype, tuple(packed.shape)) == expected
    assert torch.equal(unpack_rows(packed, bits, symmetric, 7).float(), rq.q_RN)


def test_bit_schedule():
    got = [bits_at(s, start=8, target=4, period=3, offset=2) for s in range(20)]
    assert got[:2] == [None, None]
    assert got[2:5] == [8, 8, 8] and got[5] == 7 and got[14] == 4 and got[-1] == 4
    assert [bits_at(s, 4, 4, 1, 0) for s in range(3)] == [4, 4, 4]
