"""Stage 3: a param autograd saved in forward is gathered again before backward reads it.

While the model's forward runs, every tensor autograd saves passes through a pack hook (torch's
saved-tensor hooks, pushed for the forward's duration): one that lives in the storage of a unit the
schedule holds gathered (the param itself, `w.t()`, `w.detach()`, `w.data`) is packed with its unit,
and unpacking it in backward gathers the unit first if it was freed meanwhile (a param used before
its module's own ops, whose gradient arrives first; a loss term kept outside the unit's outputs).
The cost is a dictionary lookup and a detach per saved tensor, not per op. Hooks pushed by the caller
around the forward (`save_on_cpu`, say) still run: they wrap ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch


@dataclass
class _Saved:
    packed: Any
    unit: Optional[int]  # the unit whose storage it lives in (None: not a param's)
    outer_unpack: Optional[Callable[[Any], torch.Tensor]]


class SavedParamHooks:
    """Args: `regather(unit)`: make the unit's values present again (called inside backward)."""

    def __init__(self, regather: Callable[[int], None]):
        self.regather = regather
        self.unit_of_storage: Dict[int, int] = {}  # data pointer of a gathered unit's storage -> unit
        self._outer = None
        self._pushed = False

    def push(self) -> None:
        """Around the model's forward (no-op where torch has saved-tensor hooks disabled)."""
        if self._pushed or not torch._C._autograd._saved_tensors_hooks_is_enabled():
            return
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
        self._pushed = True

    def pop(self) -> None:
        if self._pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._pushed = False
            self._outer = None

    def _pack(self, tensor: torch.Tensor) -> Any:
        unit = None
        if self.unit_of_storage:
            try:
                unit = self.unit_of_storage.get(tensor.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # a tensor without storage (a wrapper subclass)
                unit = None
        outer = self._outer
        if outer is None:  # detached: a saved output kept as itself would hold its own graph in a cycle
            return tensor.detach() if unit is None else _Saved(tensor.detach(), unit, None)
        return _Saved(outer[0](tensor), unit, outer[1])

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        if saved.unit is not None:
            self.regather(saved.unit)
        return saved.outer_unpack(saved.packed) if saved.outer_unpack is not None else saved.packed
