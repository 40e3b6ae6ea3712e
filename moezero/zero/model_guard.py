"""What must hold around every forward of a model that a ZeroOptimizer trains.

Root-module forward hooks call back into the engine (`engine.py`; held weakly, so a discarded
optimizer does not stay alive through its model). While the engine is detached (inside
`opt.modify_model()`) there are no hooks, so the model runs plain:
  before the forward: a backward that raised half-way is cleaned up (collectively), and a
      trainable param the optimizer does not know (a module swapped in by hand), a param whose
      storage was replaced (a `.data` swap, `module.float()`) or a param frozen at adoption and
      unfrozen by hand is an error naming it, before the model runs on it;
  after the forward: a trainable `nn.Parameter` created during forward is an error naming it.
"""

from __future__ import annotations

from torch import nn

from moezero.zero.hooks import WeakHook


class ParameterSetChanged(RuntimeError):
    """The model's trainable parameters are not the ones the optimizer was built for."""


class ModelGuard:
    def __init__(self, model: nn.Module, owner):
        self._handles = [
            model.register_forward_pre_hook(WeakHook(owner, "before_forward")),
            model.register_forward_hook(WeakHook(owner, "after_forward", pass_last=True)),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def unknown_param_error(name: str, during_forward: bool) -> ParameterSetChanged:
    if during_forward:
        return ParameterSetChanged(
            f"parameter '{name}' was created during forward as a trainable nn.Parameter; the optimizer cannot "
            "train a parameter that is made anew in forward. Create it once in __init__, or give it "
            "requires_grad=False if it is a table rebuilt in forward."
        )
    return ParameterSetChanged(
        f"parameter '{name}' is trainable but the optimizer was not built with it (a module swapped in by hand?); "
        "make the change inside `with opt.modify_model():`, so the optimizer adopts it"
    )


def unfrozen_by_hand_error(name: str) -> ParameterSetChanged:
    return ParameterSetChanged(
        f"parameter '{name}' was frozen when the optimizer adopted it and was unfrozen by hand; its gradient would "
        "not be reduced. Unfreeze it inside `with opt.modify_model():`, so the optimizer trains it again"
    )


def storage_replaced_message(name: str) -> str:
    """The one wording of it, for the forward check here and the gradient hooks' (reducer.py)."""
    return (
        f"parameter '{name}' no longer lives in the optimizer's buffer: its storage was replaced (module.float()"
        "/.to() or a .data swap after ZeroOptimizer was built). Cast inside the op instead (e.g. x.float() @ "
        "w.float().t()), or make the change inside `with opt.modify_model():`"
    )


def storage_replaced_error(name: str) -> ParameterSetChanged:
    return ParameterSetChanged(storage_replaced_message(name))
