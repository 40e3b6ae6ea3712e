"""Sharded optimizer state: save this rank's pieces, consolidate all ranks', load into any layout.

Every piece is addressed in *global* coordinates: a param's name and a range of the flat elements
of its global tensor. Routed-expert tensors are stacked over the global experts (the local stack
of ep rank r holds experts [r * L, (r + 1) * L)), so a piece names its experts by global index and
a checkpoint written with one dp/ep layout loads into another.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from moezero.parallel import expert_shard_of

FORMAT = "moezero-zero-shard-v1"
Piece = Dict[str, Any]   # {"range": (lo, hi), "master": 1-D tensor, "state": {key: tensor or scalar}}


def global_placement(param: torch.Tensor) -> Tuple[Tuple[int, ...], int]:
    """(global shape, flat offset of this rank's tensor inside it)."""
    shard = expert_shard_of(param)
    if shard is None:
        return tuple(param.shape), 0
    per_expert = param.numel() // shard.num_local_experts
    return (shard.num_global_experts,) + tuple(param.shape[1:]), shard.first_global_expert * per_expert


def _owned_parts(opt):
    """(view, slice of the view, global range, name) for the part of each view this rank owns."""
    for view in opt.master.views:
        family = opt.families[view.family]
        param = family.params[view.index]
        base_in_bucket = opt.strategies[view.family].optimizer_range(view.bucket)[0] + view.offset
        n = view.param_range[1] - view.param_range[0]
        own_lo, own_hi = family.own_range(view.bucket)
        lo, hi = max(base_in_bucket, own_lo), min(base_in_bucket + n, own_hi)
        if lo >= hi:
            continue
        _, offset = global_placement(param)
        start = view.param_range[0] + lo - base_in_bucket
        yield view, slice(lo - base_in_bucket, hi - base_in_bucket), (offset + start, offset + start + hi - lo), \
            family.names[view.index]


def _is_elementwise(value: Any, n: int) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == n


def shard_state_dict(opt) -> Dict[str, Any]:
    """This rank's owned master weights and optimizer state, in global coordinates."""
    pieces: Dict[str, List[Piece]] = {}
    for view, part, global_range, name in _owned_parts(opt):
        n = view.master.numel()
        state = {k: (v[part].clone() if _is_elementwise(v, n) else (v.clone() if torch.is_tensor(v) else v))
                 for k, v in opt.inner.state.get(view.master, {}).items()}
        pieces.setdefault(name, []).append({"range": global_range, "master": view.master[part].clone(),
                                            "state": state})
    shapes = {name: global_placement(p)[0] for f in opt.families for name, p in zip(f.names, f.params)}
    return {
        "format": FORMAT, "stage": opt.stage, "rank": opt.groups.rank, "world_size": opt.groups.world_size,
        "ep_size": opt.groups.ep_size, "pieces": pieces, "shapes": shapes,
        "param_groups": opt.user_group_hyperparams(),
        "loss_scaler": opt.loss_scaler.state_dict() if opt.loss_scaler is not None else None,
        "skipped_steps": opt.skipped_steps, "consecutive_skips": opt.consecutive_skips,
    }


def consolidate(shards: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Merge every rank's shard into full fp32 tensors: {"params": {name: tensor}, "state": {...}, ...}.

    Raises ValueError if the shards do not cover every element exactly once.
    """
    first = shards[0]
    pieces: Dict[str, List[Piece]] = {}
    for shard in shards:
        for name, owned in shard["pieces"].items():
            pieces.setdefault(name, []).extend(owned)
    params, state = {}, {}
    for name, shape in first["shapes"].items():
        numel = int(torch.Size(shape).numel())
        _check_covered_once(pieces.get(name, []), name, numel)
        master, merged = _gather_range(pieces, name, 0, numel)
        params[name] = master.view(shape)
        state[name] = {k: (v.view(shape) if _is_elementwise(v, numel) else v) for k, v in merged.items()}
    return {
        "format": FORMAT + "-consolidated", "params": params, "state": state,
        "param_groups": [next((s["param_groups"][i] for s in shards if s["param_groups"][i] is not None), None)
                         for i in range(len(first["param_groups"]))],
        "loss_scaler": first["loss_scaler"],
        "skipped_steps": first["skipped_steps"], "consecutive_skips": first["consecutive_skips"],
    }


def _check_covered_once(pieces: List[Piece], name: str, numel: int) -> None:
    count = torch.zeros(numel, dtype=torch.int32)
    for piece in pieces:
        lo, hi = piece["range"]
        count[lo:hi] += 1
    if not bool((count == 1).all()):
        raise ValueError(f"the shards cover parameter '{name}' {int(count.min())}..{int(count.max())} times; "
                         "pass the shards of every rank of one checkpoint")


def load_into(opt, source: Dict[str, Any]) -> None:
    """Load a shard of the same layout, or a consolidated state, then publish the params."""
    pieces = _pieces_by_name(source)
    for view in opt.master.views:
        family = opt.families[view.family]
        name = family.names[view.index]
        _, offset = global_placement(family.params[view.index])
        lo, hi = offset + view.param_range[0], offset + view.param_range[1]
        master, state = _gather_range(pieces, name, lo, hi)
        with torch.no_grad():
            view.master.copy_(master)
        if state:
            opt.inner.state[view.master] = {k: (v.to(view.master.dtype) if _is_elementwise(v, hi - lo) and
                                                 v.is_floating_point() else v) for k, v in state.items()}
        else:
            opt.inner.state.pop(view.master, None)
    opt.set_user_group_hyperparams(source["param_groups"])
    if opt.loss_scaler is not None and source.get("loss_scaler"):
        opt.loss_scaler.load_state_dict(source["loss_scaler"])
    opt.skipped_steps = source.get("skipped_steps", 0)
    opt.consecutive_skips = source.get("consecutive_skips", 0)
    opt.master.publish()


def _pieces_by_name(source: Dict[str, Any]) -> Dict[str, List[Piece]]:
    if "pieces" in source:
        return source["pieces"]
    out = {}
    for name, tensor in source["params"].items():
        flat = tensor.reshape(-1)
        state = {k: (v.reshape(-1) if torch.is_tensor(v) and v.shape == tensor.shape and v.dim() > 0 else v)
                 for k, v in source["state"].get(name, {}).items()}
        out[name] = [{"range": (0, flat.numel()), "master": flat, "state": state}]
    return out


def _gather_range(pieces: Dict[str, List[Piece]], name: str, lo: int, hi: int):
    """Master values and optimizer state for global elements [lo, hi) of `name`, from covering pieces."""
    if name not in pieces:
        raise KeyError(f"the checkpoint has no optimizer state for parameter '{name}'")
    master = torch.empty(hi - lo, dtype=pieces[name][0]["master"].dtype if pieces[name] else torch.float32)
    state: Dict[str, Any] = {}
    filled = 0
    for piece in pieces[name]:
        p_lo, p_hi = piece["range"]
        a, b = max(lo, p_lo), min(hi, p_hi)
        if a >= b:
            continue
        master[a - lo:b - lo] = piece["master"][a - p_lo:b - p_lo]
        filled += b - a
        n = p_hi - p_lo
        for key, value in piece["state"].items():
            if _is_elementwise(value, n):
                if key not in state:
                    state[key] = torch.empty(hi - lo, dtype=value.dtype)
                state[key][a - lo:b - lo] = value[a - p_lo:b - p_lo]
            else:
                state.setdefault(key, value.clone() if torch.is_tensor(value) else value)
    if filled != hi - lo:
        raise ValueError(f"the checkpoint does not cover elements {lo}..{hi} of parameter '{name}' "
                         "(a shard from another layout? consolidate the checkpoint first)")
    return master, state


def owned_gradient_pieces(opt) -> Dict[str, List[Tuple[Tuple[int, int], torch.Tensor]]]:
    """Averaged gradients of the elements this rank owns, in global coordinates.

    Valid after `opt.reduce_gradients()` and before `opt.step()` (which clips them in place).
    """
    out: Dict[str, List[Tuple[Tuple[int, int], torch.Tensor]]] = {}
    for view, part, global_range, name in _owned_parts(opt):
        reduced = opt.strategies[view.family].reduced_grad(view.bucket)
        n = view.master.numel()
        grad = reduced[view.offset:view.offset + n][part].clone()
        out.setdefault(name, []).append((global_range, grad))
    return out
