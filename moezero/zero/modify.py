"""`opt.modify_model()`: change the model under a live optimizer, at any stage.

On entry every param is full and plain (stage 3 gathers them; no param lives in an optimizer
buffer), so the user may read, write in place, replace modules or params, freeze or unfreeze.
On exit the optimizer adopts the model's current trainable set:
  - a param still present keeps its optimizer state, and its values as written: an element that
    still equals what the optimizer published keeps its wider master value (a bf16 model does not
    lose its fp32 masters), a written element takes the new value;
  - a new param starts with fresh state, in the group of the param it replaced (same name), or else
    in a new group with the optimizer's defaults (torch's add_param_group);
  - a param that is gone (or frozen) is dropped.
Collective: every rank must make the same change. The state of every param is consolidated on
every rank for the duration (all_gather_object), which is the price of a layout that changes.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from moezero.zero.families import global_placement
from moezero.zero.state import consolidate


@contextlib.contextmanager
def modify_model(opt) -> Iterator[None]:
    full = _consolidated_state(opt)
    before = {id(p): (opt.param_name(p), g) for g, group in enumerate(opt.param_groups) for p in group["params"]}
    opt.engine.detach()
    opt._modifying = True
    try:
        yield
    finally:
        opt._modifying = False
        _adopt(opt, full, before)


def _consolidated_state(opt) -> Dict[str, Any]:
    shard = opt.state_dict()
    control = opt.groups.control
    if control is None:
        return consolidate([shard])
    shards: List[Any] = [None] * dist.get_world_size(control)
    dist.all_gather_object(shards, shard, group=control)
    return consolidate(shards)


def _adopt(opt, full: Dict[str, Any], before: Dict[int, Tuple[str, int]]) -> None:
    current = [(n, p) for n, p in opt.model.named_parameters() if p.requires_grad and id(p) not in opt._outside]
    removed_groups = {name: g for pid, (name, g) in before.items() if pid not in {id(p) for _, p in current}}
    groups = [dict(g, params=[]) for g in opt.param_groups]
    fresh_group = None
    pieces: Dict[str, list] = {}
    for name, p in current:
        if id(p) in before:
            g = before[id(p)][1]
        elif name in removed_groups:
            g = removed_groups[name]
        else:
            if fresh_group is None:
                fresh_group = len(groups)
                groups.append(dict({k: v for k, v in opt.defaults.items()}, params=[]))
            g = fresh_group
        groups[g]["params"].append(p)
        pieces[name] = [_piece(p, full, before.get(id(p), (None,))[0])]
    opt.rebuild(groups)
    opt.load_state_dict({"pieces": pieces, **{k: full[k] for k in ("loss_scaler", "skipped_steps",
                                                                      "consecutive_skips")},
                         "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]})


def _piece(p: nn.Parameter, full: Dict[str, Any], old_name) -> Dict[str, Any]:
    """This rank's part of `p` in global coordinates: merged master values and kept optimizer state."""
    shape, offset = global_placement(p)
    value = p.detach().reshape(-1)
    lo, hi = offset, offset + value.numel()
    master_dtype = torch.promote_types(p.dtype, torch.float32)
    old = full["params"].get(old_name) if old_name is not None else None
    if old is None or tuple(old.shape) != tuple(shape):
        return {"range": (lo, hi), "master": value.to(master_dtype), "state": {}}
    kept = old.reshape(-1)[lo:hi]
    master = torch.where(value == kept.to(value.dtype), kept, value.to(kept.dtype))
    numel = old.numel()
    state = {k: (v.reshape(-1)[lo:hi] if torch.is_tensor(v) and v.numel() == numel and v.dim() > 0 else v)
             for k, v in full["state"].get(old_name, {}).items()}
    return {"range": (lo, hi), "master": master, "state": state}
