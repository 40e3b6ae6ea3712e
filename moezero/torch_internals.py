"""The private torch APIs moezero relies on (the ZeRO optimizer; a router that sees its recompute), in one place
(tested with torch 2.13.0; setup.py allows 2.6 <= torch < 3). If a torch release moves one of them, this is the
file to change.

  current_backward()       which autograd backward is running (torch._C._current_graph_task_id, -1: none):
                           hooks of one backward recognise each other, a nested one is detected
  queue_end_of_backward()  run a callback when the running backward ends (the execution engine's queue)
  backward_accumulates()   whether the running backward adds into leaves' .grad (backward()) or only returns
                           gradients (torch.autograd.grad: torch._C._will_engine_execute_node refuses a leaf there)
  storage_key()            the identity of a tensor's storage, stable across a stage-3 free/regather resize
  parse_to_arguments()     what Tensor.to(...) was asked for (device, dtype, memory format), without running it
  no_subclass_dispatch()   run torch ops on a tensor subclass as on plain tensors (its own __torch_function__)
  functorch_transforms_active()  inside torch.func.vmap / grad / jvp (torch._C._are_functorch_transforms_active):
                           the CPU kernels' autograd.Functions have no rules for them, torch's ops run instead
  all_gather_single, reduce_scatter_single   the flat-tensor collectives (renamed in torch 2.11; older names before)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def current_backward() -> int:
    """The running backward's task id, -1 outside a backward."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    return current_backward() != -1


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Call `callback` when the running backward has finished (must be called inside a backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def backward_accumulates(leaf: torch.Tensor) -> bool:
    """Inside a backward that reached `leaf`: whether it accumulates into `.grad` (False in torch.autograd.grad)."""
    try:
        return bool(torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(leaf).node))
    except RuntimeError:  # "A leaf node was passed to _will_engine_execute_node but we are currently running
        return False  # autograd.grad()": a backward that accumulates nothing


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def parse_to_arguments(*args: Any, **kwargs: Any):
    """(device, dtype, non_blocking, memory_format) of Tensor.to's arguments (after the tensor)."""
    return torch._C._nn._parse_to(*args, **kwargs)


def no_subclass_dispatch():
    return torch._C.DisableTorchFunctionSubclass()


def functorch_transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, ...) is running."""
    return torch._C._are_functorch_transforms_active()
