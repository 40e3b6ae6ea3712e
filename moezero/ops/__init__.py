"""Public kernels used by the MoE dispatcher and the ZeRO reducer.

Each op is a `torch.library` custom op (`torch.ops.moezero.*`, see `_library.py`): it works with
autograd, FakeTensors and `torch.compile`, and runs the compiled extension where that is loaded
and faster, otherwise its pure-PyTorch reference (`moezero.ops.reference`). In eager mode, on plain
tensors, the same kernels are called without the custom op's dispatch (`eager.py`). MOEZERO_DISABLE_EXT=1
forces the reference; MOEZERO_REQUIRE_EXT=1 makes a missing extension an error (`_loader.py`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from moezero.ops import _library, eager


def permute_tokens(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, num_experts: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_ND sorted by expert, counts_E, row_map_TK); see `reference.permute`. Differentiable in x."""
    op = eager.permute if eager.applies(x_TD, topk_ids_TK) else _library.permute
    return op(x_TD.contiguous(), topk_ids_TK.contiguous(), num_experts)


def unpermute_combine(y_ND: torch.Tensor, row_map_TK: torch.Tensor, weights_TK: Optional[torch.Tensor]) -> torch.Tensor:
    """Weighted top-k sum back in token order (weights None: plain sum); differentiable in y and the weights."""
    weights_TK = None if weights_TK is None else weights_TK.contiguous()
    op = eager.unpermute_combine if eager.applies(y_ND, row_map_TK, weights_TK) else _library.unpermute_combine
    return op(y_ND.contiguous(), row_map_TK.contiguous(), weights_TK)


def flatten_into(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int],
    scale: float = 1.0,
    accumulate: bool = False,
) -> None:
    """Copy (or add) a list of tensors, scaled and cast, into slices of a flat buffer."""
    if len(tensors):
        op = eager.flatten_into if eager.applies(flat, *tensors) else _library.flatten_into
        op(flat, list(tensors), [int(o) for o in offsets], float(scale), bool(accumulate))


def sum_of_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm over a list of tensors, as one fp32 (or fp64) scalar."""
    if not any(t.numel() for t in tensors):
        fp64 = any(t.dtype == torch.float64 for t in tensors)
        device = tensors[0].device if len(tensors) else torch.device("cpu")
        return torch.zeros((), dtype=torch.float64 if fp64 else torch.float32, device=device)
    op = eager.sum_of_squares if eager.applies(*tensors) else _library.sum_of_squares
    return op(list(tensors))
