"""Storage of quantized integer codes: two 4-bit codes per byte, one byte, or int16.

Codes are first made unsigned, c in [0, 2^b): symmetric q gets + 2^(b-1), asymmetric q already is.
Rows (see quantizer.py) are packed independently, so the rows of one expert can be read without
unpacking the others (a rank loads only its local experts).

    b <= 4:  uint8 (R, ceil(N / 2)), the even element in the low nibble (a padding nibble ends odd rows)
    b <= 8:  uint8 (R, N)
    b <= 16: int16 (R, N) holding c - 2^15
"""

from __future__ import annotations

import torch


def storage_kind(bits: int) -> str:
    return "int4" if bits <= 4 else ("int8" if bits <= 8 else "int16")


def code_offset(bits: int, symmetric: bool) -> int:
    """What is added to q to make it unsigned."""
    return 2 ** (bits - 1) if symmetric else 0


def pack_rows(q_RN: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """Pack integer-valued codes (fp32 or int) of shape (R, N)."""
    c = q_RN.to(torch.int32) + code_offset(bits, symmetric)
    if c.numel() and (c.min() < 0 or c.max() >= 2**bits):
        raise ValueError(f"codes outside [0, 2^{bits}) after the offset")
    kind = storage_kind(bits)
    if kind == "int16":
        return (c - 2**15).to(torch.int16)
    c = c.to(torch.uint8)
    if kind == "int8":
        return c
    if c.shape[1] % 2:
        c = torch.cat([c, torch.zeros_like(c[:, :1])], dim=1)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_rows(packed: torch.Tensor, bits: int, symmetric: bool, n: int) -> torch.Tensor:
    """Signed integer codes q (int32, shape (R, n)) from `pack_rows`' output."""
    kind = storage_kind(bits)
    if kind == "int16":
        c = packed.to(torch.int32) + 2**15
    elif kind == "int8":
        c = packed.to(torch.int32)
    else:
        low, high = (packed & 0x0F).to(torch.int32), (packed >> 4).to(torch.int32)
        c = torch.stack([low, high], dim=2).reshape(packed.shape[0], -1)[:, :n]
    return c - code_offset(bits, symmetric)
