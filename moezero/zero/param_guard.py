"""What a stage-3 param is outside its unit's forward and backward: a guarded tensor, never a crash.

While the forward/backward schedule holds a param's unit gathered, the param has its own type
(`expose`): the model's ops on it cost nothing extra; the checks below apply to every other read.

A stage-3 param keeps its full shape over a storage that is resized to zero while its unit is
free (`sharded_params.py`), so a plain read there (`p.sum()`, `print(p)`, `copy.deepcopy(model)`,
`model.double()`) would read freed memory. The optimizer therefore gives each such param the type
`ShardedParameter` (a subclass of its own class) while it manages it; every torch operation on it
passes through `__torch_function__`, which

  - lets metadata through (shape, dtype, requires_grad, grad, hooks, ...);
  - lets a read through when the param's unit is gathered; gathers the unit on demand while the
    model's forward or a backward runs (every rank runs that code, and the gathers are checked
    across ranks); and otherwise raises `ParamNotGathered`, naming the param and
    `opt.full_parameters()`;
  - marks results that alias the param's storage (`p.t()`, `p.detach()`, `p.data`, a state dict)
    as `ShardedAlias`, guarded the same way, so an alias that outlives the gather raises too;
  - in grad mode, hooks each result so that its unit is gathered again before autograd reads the
    saved param in backward (a second backward over one forward, a loss term computed outside
    forward inside `full_parameters()`).

`copy.deepcopy` of a gathered param or alias gives a plain tensor; pickling one writes a plain tensor.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Dict

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from moezero.torch_internals import in_backward, no_subclass_dispatch, parse_to_arguments, storage_key

_NO_READ_METHODS = (
    frozenset(
        getattr(torch.Tensor, name)
        for name in (
            "size",
            "dim",
            "numel",
            "nelement",
            "element_size",
            "stride",
            "storage_offset",
            "is_contiguous",
            "is_floating_point",
            "is_complex",
            "is_signed",
            "untyped_storage",
            "data_ptr",
            "requires_grad_",
            "register_hook",
            "register_post_accumulate_grad_hook",
            "retain_grad",
            "__len__",
            "get_device",
            "_is_view",
            "is_shared",
            "__hash__",
            "__sizeof__",
            "__dir__",
        )
        if hasattr(torch.Tensor, name)
    )
    | frozenset(
        getattr(torch, name)
        for name in ("_has_compatible_shallow_copy_type", "is_floating_point", "is_complex", "numel")
        if hasattr(torch, name)
    )
    | frozenset((torch.autograd.grad, torch.autograd.backward))
)  # they name params as graph inputs, reading nothing
_ALIASING_ATTRIBUTES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})  # getters that make views
_CONVERSIONS = frozenset(
    {
        torch.Tensor.to,
        torch.Tensor.float,
        torch.Tensor.double,
        torch.Tensor.half,
        torch.Tensor.bfloat16,
        torch.Tensor.cpu,
        torch.Tensor.cuda,
        torch.Tensor.type,
    }
)


class ParamNotGathered(RuntimeError):
    """A stage-3 param (or an alias of it) was read where its values are not on this rank."""


COMPILE_REFUSED = (
    "torch.compile traced a read of a param the stage-3 ZeroOptimizer holds sharded, outside its "
    "module's forward and backward: compile the model or its blocks (their gathers run eagerly in "
    "their hooks), and read weights outside compiled code, inside `with opt.full_parameters():`"
)


@dataclass(frozen=True)
class ShardInfo:
    """Who a stage-3 param is: its name, its gather unit and the gatherer that holds the unit."""

    name: str
    unit: int
    gatherer: Callable[[], Any]  # a weakref to the UnitGatherer


def _reads_nothing(func) -> bool:
    if func in _NO_READ_METHODS:
        return True
    name = getattr(func, "__name__", "")
    if name == "__set__":
        return True
    return name == "__get__" and getattr(func.__self__, "__name__", "") not in _ALIASING_ATTRIBUTES


def _no_op_conversion(func, tensor: torch.Tensor, args, kwargs) -> bool:
    """`model.float()` on an fp32 model, `model.to(device)` where it already is: torch returns the
    tensor itself without reading it."""
    if func not in _CONVERSIONS:
        return False
    with no_subclass_dispatch():
        if func is torch.Tensor.to:
            if kwargs.get("copy"):  # torch's parser of .to's arguments takes no `copy`
                return False
            device, dtype, _, memory_format = parse_to_arguments(*args[1:], **kwargs)
            if memory_format not in (None, torch.preserve_format):
                return False
            return (device is None or device == tensor.device) and (dtype is None or dtype == tensor.dtype)
        wanted = {
            torch.Tensor.float: torch.float32,
            torch.Tensor.double: torch.float64,
            torch.Tensor.half: torch.float16,
            torch.Tensor.bfloat16: torch.bfloat16,
        }.get(func)
        if wanted is not None:
            return wanted == tensor.dtype and not (args[1:] or kwargs)
        if func is torch.Tensor.cpu:
            return tensor.device.type == "cpu"
        return False


def _only_aliases(func) -> bool:
    """`.data` and `.detach()` make an alias without touching the storage (the alias is guarded)."""
    return func is torch.Tensor.detach or (
        getattr(func, "__name__", "") == "__get__" and getattr(func.__self__, "__name__", "") == "data"
    )


def _names_the_type(func, args, kwargs) -> bool:
    """`p.type()` with no target returns the type's name: nothing is read."""
    return func is torch.Tensor.type and not (args[1:] or kwargs)


def not_gathered_error(info: ShardInfo, alias: bool, why: str = "") -> ParamNotGathered:
    what = f"an alias of parameter '{info.name}'" if alias else f"parameter '{info.name}'"
    if info.gatherer() is None:
        return ParamNotGathered(
            f"{what} was sharded by a stage-3 ZeroOptimizer that no longer exists, and its "
            "values went with it: keep the optimizer alive while the model is used"
        )
    return ParamNotGathered(
        f"{what} is sharded by the stage-3 ZeroOptimizer and its values are not on this rank outside its "
        f"module's forward and backward{why}: read it inside `with opt.full_parameters():` "
        "(collective: every rank enters it), or change it (a write, a dtype or device conversion) inside "
        "`with opt.modify_model():`"
    )


class _Guarded:
    """The behaviour shared by ShardedParameter and ShardedAlias (see the module docstring)."""

    _zero3: ShardInfo

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            raise RuntimeError(COMPILE_REFUSED)
        if _reads_nothing(func) or _names_the_type(func, args, kwargs):
            with no_subclass_dispatch():
                return func(*args, **kwargs)
        guarded = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, _Guarded)]
        if len(guarded) == 1 and args and args[0] is guarded[0] and _no_op_conversion(func, guarded[0], args, kwargs):
            return guarded[0]
        if not _only_aliases(func):
            for tensor in guarded:
                _make_readable(tensor)
        with no_subclass_dispatch():
            out = func(*args, **kwargs)
        _guard_results(out, guarded)
        return out

    def __deepcopy__(self, memo: Dict[int, Any]):
        if id(self) in memo:
            return memo[id(self)]
        if not _is_ready(self._zero3):
            raise not_gathered_error(self._zero3, not isinstance(self, nn.Parameter), " (copy.deepcopy reads them)")
        with no_subclass_dispatch():
            values = self.detach().clone(memory_format=torch.preserve_format)
            plain = nn.Parameter(values, self.requires_grad) if isinstance(self, nn.Parameter) else values
        for key, value in self.__dict__.items():  # the expert tag, say; not the shard info
            if key != "_zero3":
                setattr(plain, key, copy.deepcopy(value, memo))
        memo[id(self)] = plain
        return plain

    def __repr__(self, **kwargs) -> str:
        """What torch prints for the plain tensor (the values must be here)."""
        _make_readable(self)
        with no_subclass_dispatch():
            plain = self.detach().as_subclass(torch.Tensor).requires_grad_(self.requires_grad)
            body = torch.Tensor.__repr__(plain, **kwargs)
        return f"Parameter containing:\n{body}" if isinstance(self, nn.Parameter) else body

    def __reduce_ex__(self, protocol):
        """Pickled (torch.save) as a plain tensor with the values, when they are here."""
        if not _is_ready(self._zero3):
            raise not_gathered_error(self._zero3, not isinstance(self, nn.Parameter), " (pickling reads them)")
        with no_subclass_dispatch():
            plain = self.detach().as_subclass(torch.Tensor)
        return plain.__reduce_ex__(protocol)


class ShardedAlias(_Guarded, torch.Tensor):
    """A tensor sharing a stage-3 param's storage (a view, a detach, `.data`)."""


_PARAM_TYPES: Dict[type, type] = {}


def shard_param_type(param: nn.Parameter, info: ShardInfo) -> None:
    """Give a stage-3 param its guarded type (in place: the param keeps its identity)."""
    cls = type(param)
    if cls not in _PARAM_TYPES:
        if cls.__torch_function__ is not nn.Parameter.__torch_function__:
            raise TypeError(
                f"stage 3 cannot shard parameter '{info.name}' of type {cls.__name__}: it overrides __torch_function__"
            )
        _PARAM_TYPES[cls] = type(f"Sharded{cls.__name__}", (_Guarded, cls), {"_plain": cls})
    param.__class__ = _PARAM_TYPES[cls]
    param._zero3 = info


def unshard_param_type(param: nn.Parameter) -> None:
    """The param's own type back (the optimizer lets go of it)."""
    expose(param)
    if hasattr(param, "_zero3"):
        del param._zero3


def expose(param: nn.Parameter) -> None:
    """The param's own type while the forward/backward schedule holds its unit gathered: ops on it run
    as on any tensor, with no check (the unit's values are here; saved_params.py covers autograd)."""
    if isinstance(param, _Guarded):
        param.__class__ = type(param)._plain


def guard(param: nn.Parameter) -> None:
    """The guarded type again (its unit is about to be freed, or is held by full_parameters())."""
    if not isinstance(param, _Guarded):
        param.__class__ = _PARAM_TYPES[type(param)]


def _is_ready(info: ShardInfo) -> bool:
    gatherer = info.gatherer()
    return gatherer is not None and gatherer.is_ready(info.unit)


def _make_readable(tensor: _Guarded) -> None:
    info = tensor._zero3
    gatherer = info.gatherer()
    if gatherer is not None and gatherer.is_ready(info.unit):
        return
    if gatherer is not None and gatherer.may_gather_on_demand():
        gatherer.gather_on_demand(info.unit)
        return
    raise not_gathered_error(info, not isinstance(tensor, nn.Parameter))


def _guard_results(out: Any, guarded) -> None:
    """Mark aliases of the guarded inputs; in grad mode hook outputs to regather before backward."""
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        return
    with no_subclass_dispatch():
        by_storage = {storage_key(t): t._zero3 for t in guarded}
        for t in tensors:
            if type(t) is torch.Tensor:
                info = by_storage.get(storage_key(t))
                if info is not None:
                    t.__class__ = ShardedAlias
                    t._zero3 = info
    if torch.is_grad_enabled() and not in_backward() and any(g.requires_grad for g in guarded):
        units = {(g._zero3.gatherer, g._zero3.unit) for g in guarded}
        for t in tensors:
            if t.grad_fn is not None:
                t.register_hook(_regather_hook(units))


def _regather_hook(units):
    def hook(grad):
        for ref, unit in units:
            gatherer = ref()
            if gatherer is not None:
                gatherer.ensure_before_backward(unit)

    return hook
