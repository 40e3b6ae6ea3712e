"""The tag of a parameter whose values are not in memory yet (a checkpoint reader defers them).

`defer_values(param, read)` leaves the param on the meta device (shape and dtype only) with `read(lo, hi)`
returning its flattened elements [lo, hi). The ZeRO optimizer stores such a param without ever holding it
whole: at stage 3 it reads only this rank's slices; at stages 0-2 it materializes it first. Nothing can run
the model before that.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

_ATTR = "_moezero_values_source"
ReadRange = Callable[[int, int], torch.Tensor]  # (lo, hi) -> 1-D tensor of the flattened elements [lo, hi)


def defer_values(param: torch.nn.Parameter, read: ReadRange) -> None:
    param.data = torch.empty(param.shape, dtype=param.dtype, device="meta")
    setattr(param, _ATTR, read)


def values_source(param: torch.Tensor) -> Optional[ReadRange]:
    return getattr(param, _ATTR, None)


def read_values(param: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of the flattened param: from its source while deferred, else from its data."""
    source = values_source(param)
    if source is None:
        return param.detach().reshape(-1)[lo:hi]
    return source(lo, hi).to(param.dtype)


def values_arrived(param: torch.Tensor) -> None:
    """The param's values now live in real storage: forget the source."""
    if hasattr(param, _ATTR):
        delattr(param, _ATTR)


def materialize(param: torch.nn.Parameter, device: torch.device = torch.device("cpu")) -> None:
    """Read a deferred param whole into memory of its own (no-op for a param that is not deferred)."""
    if values_source(param) is None:
        return
    values = read_values(param, 0, param.numel()).to(device)
    allocate(param, device)
    with torch.no_grad():
        param.copy_(values.view(param.shape))
    values_arrived(param)


def allocate(tensor: torch.Tensor, device: torch.device = torch.device("cpu"), empty: bool = False) -> None:
    """Give a meta-device tensor (param or buffer) real, uninitialized storage in place: the same Python
    object, its attributes (the expert tag) kept. `empty`: no elements yet (its `.data` is set next)."""
    fresh = torch.empty((0,) if empty else tensor.shape, dtype=tensor.dtype, device=device)
    if isinstance(tensor, torch.nn.Parameter):
        fresh = torch.nn.Parameter(fresh, requires_grad=tensor.requires_grad)
    attributes = dict(tensor.__dict__)
    torch.utils.swap_tensors(tensor, fresh)  # swaps the __dict__s too
    tensor.__dict__.update(attributes)
