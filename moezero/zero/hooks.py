"""The hooks the optimizer puts on a model's modules, and its mark on the model.

Both hold the optimizer's parts weakly (a discarded optimizer does not stay alive through its
model), and both are inert in a copy: `copy.deepcopy(model)` (an EMA, a teacher) and
`torch.save(model)` carry hooks that do nothing and no owner, so a copy never drives, gathers for
or retires the original's optimizer.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch


def _do_nothing(*args) -> None:
    return None


class WeakHook:
    """Calls `owner.<method>(*bound)` (and the hook's last argument with `pass_last=True`: a forward
    hook's output) while the owner lives."""

    def __init__(self, owner: Any, method: str, *bound: Any, pass_last: bool = False):
        self._ref = weakref.ref(owner)
        self._method = method
        self._bound = bound
        self._pass_last = pass_last

    @torch.compiler.disable  # a compiled module runs its hooks eagerly: they gather, free and count
    def __call__(self, *args) -> None:
        owner = self._ref()
        if owner is not None:
            getattr(owner, self._method)(*self._bound, *args[-1:] if self._pass_last else ())

    def __deepcopy__(self, memo):
        return _do_nothing

    def __reduce__(self):
        return _do_nothing_factory, ()


def _do_nothing_factory():
    return _do_nothing


class OwnerMark:
    """The model's current optimizer (held weakly), so that a new one can retire it."""

    def __init__(self, owner: Any):
        self._ref = weakref.ref(owner)

    def __call__(self) -> Optional[Any]:
        return self._ref()

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return _no_owner, ()


def _no_owner():
    return None
