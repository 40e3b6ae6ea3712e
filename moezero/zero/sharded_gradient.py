"""What `p.grad` is where the reduced gradient has no full-size tensor on this rank: a placeholder, not None.

At stages 1-3 (and for low-precision params at stage 0, whose gradients are reduced in fp32) a gradient ends
up as this rank's part of a reduced buffer. With `.grad = None`, torch code that reads gradients would run
on nothing and say nothing: `torch.nn.utils.clip_grad_norm_(model.parameters(), c)` returns 0.0 and clips
nothing. So `.grad` is a `ShardedGradient`: its metadata (shape, dtype, device) are the param's and clearing
it works (`zero_()`, `model.zero_grad()`, `p.grad = None`), but any read of its values raises
`GradientIsSharded`, naming the param and the optimizer's own `clip_grad_norm_`.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

_CLEARING = frozenset({torch.ops.aten.zero_.default, torch.ops.aten.detach_.default, torch.ops.aten.detach.default})


class GradientIsSharded(RuntimeError):
    """A read of a gradient that exists only as the optimizer's shards."""


class ShardedGradient(torch.Tensor):
    """A storage-less stand-in for the gradient of param `name` (see the module docstring)."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    param_name: str
    zeroed: bool  # zero_() ran on it since it was shown (the optimizer then forgets what it stands for)

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str) -> "ShardedGradient":
        placeholder = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        placeholder.param_name = name
        placeholder.zeroed = False
        return placeholder

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        placeholder = next(a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, ShardedGradient))
        if func in _CLEARING:
            if func is torch.ops.aten.zero_.default:
                placeholder.zeroed = True
            return placeholder
        raise GradientIsSharded(
            f"the gradient of '{placeholder.param_name}' has no full-size tensor on this rank: the ZeroOptimizer "
            "reduced it into its shards (stages 1-3, or a low-precision param at stage 0), so `p.grad` holds no "
            f"values ({func.__name__} read them). torch.nn.utils.clip_grad_norm_ cannot see them: call "
            "opt.clip_grad_norm_(max_norm) (the global norm over every rank) or pass clip_grad= to the optimizer; "
            "opt.owned_gradients() reads this rank's part"
        )

    def __repr__(self, **kwargs) -> str:
        return (
            f"ShardedGradient('{self.param_name}', shape={tuple(self.shape)}, dtype={self.dtype}: held as the "
            "optimizer's shards)"
        )
