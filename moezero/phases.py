"""Forwards in phases: a forward written as a generator that yields right after launching a collective, so
that another micro-batch's compute can run while the collective travels (Megatron's
--overlap-moe-expert-parallel-comm).

    forward_steps(...) yields None after each launch and returns its result (StopIteration's value).
    run(steps)           drives one to the end: the ordinary, one-micro-batch forward.
    module_steps(m, ...) what m(...) runs (its forward hooks around it), as m.forward_steps(...) in phases.
    run_interleaved(ss)  drives several round-robin, one phase of each in turn.

Both ways run every micro-batch's ops in the same order, so the numbers are the same. Every rank drives the
same generators in the same order, so their collectives pair up as in the ordinary forward.

The backward mirrors the forward's interleaving by itself: torch's autograd engine runs a graph's ready nodes
latest-created first (it orders a device's ready queue by sequence number), so a collective launched in one
micro-batch's forward phase has its gradient's collective launched and waited with the other micro-batch's
backward work in between (see PendingAllToAll).
"""

from __future__ import annotations

from typing import Any, Generator, List, Sequence

from torch import nn
from torch.nn.modules import module as torch_module

Steps = Generator[None, None, Any]


def run(steps: Steps) -> Any:
    """Drive `steps` to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def run_interleaved(all_steps: Sequence[Steps]) -> List[Any]:
    """Drive every generator, one phase of each in turn, until all have ended; their return values in order."""
    results: List[Any] = [None] * len(all_steps)
    running = list(range(len(all_steps)))
    while running:
        still = []
        for i in running:
            try:
                next(all_steps[i])
                still.append(i)
            except StopIteration as done:
                results[i] = done.value
        running = still
    return results


def module_steps(module: nn.Module, *args, **kwargs) -> Steps:
    """`module(*args, **kwargs)` in phases: its forward pre-hooks, `module.forward_steps(*args, **kwargs)`, its
    forward hooks, as nn.Module.__call__ runs them. A module that __call__ runs otherwise (compiled, or with hooks
    of another kind: with kwargs, backward hooks, global ones) runs whole, through __call__: the same numbers, no
    overlap there."""
    if not (_runs_its_forward(module) and _plain_hooks_only(module)):
        return module(*args, **kwargs)
    for hook in tuple(module._forward_pre_hooks.values()):
        changed = hook(module, args)
        if changed is not None:
            args = changed if isinstance(changed, tuple) else (changed,)
    output = yield from module.forward_steps(*args, **kwargs)
    for hook in tuple(module._forward_hooks.values()):
        changed = hook(module, args, output)
        if changed is not None:
            output = changed
    return output


def _runs_its_forward(module: nn.Module) -> bool:
    """Its class has forward_steps and __call__ would run its forward (not a torch.compile'd module)."""
    return hasattr(type(module), "forward_steps") and getattr(module, "_compiled_call_impl", None) is None


def _plain_hooks_only(module: nn.Module) -> bool:
    local = (
        module._forward_pre_hooks_with_kwargs
        or module._forward_hooks_with_kwargs
        or module._backward_hooks
        or module._backward_pre_hooks
    )
    global_hooks = (
        torch_module._global_forward_pre_hooks
        or torch_module._global_forward_hooks
        or torch_module._global_backward_hooks
        or torch_module._global_backward_pre_hooks
    )
    return not (local or global_hooks)
