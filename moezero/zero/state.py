"""Sharded optimizer state in global coordinates: save a rank's pieces, consolidate all ranks', load anywhere.

Every piece is addressed by a param's name and a range of the flat elements of its *global*
tensor (routed experts stacked over the global experts: the local stack of ep rank r holds
experts [r * L, (r + 1) * L)), so a state saved with one dp/ep/stage layout loads into another. A
tensor-parallel shard's part may lie in several global ranges (fused row blocks; a dim-1 split: one per row):
one piece each (`ZeroParam.global_ranges`); a param replicated over tp is owned on tp rank 0, a replica elsewhere.

A shard (`shard_state`) holds the pieces this rank *owns* (every element is owned by exactly one
rank, so the shards of all ranks tile every param) and, at stage 0 where each rank holds
everything, the rest as `replicas` so one rank's shard reloads on that rank alone. `consolidate`
is the one merge of shards into full tensors; it checks the coverage.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from moezero.parallel import comm

FORMAT = "moezero-zero-shard-v2"
CONSOLIDATED = FORMAT + "-consolidated"
Piece = Dict[str, Any]  # {"range": (lo, hi), "master": 1-D tensor, "state": {key: tensor or scalar}}


def _is_elementwise(value: Any, n: int) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == n


def _full_precision(inner, leaf: torch.Tensor):
    """(master values, optimizer state) of one leaf: an optimizer that keeps its own masters in narrow dtypes
    gives them, and its state, in fp32 (so a checkpoint loads into any optimizer and layout)."""
    if hasattr(inner, "full_precision_state"):
        return inner.full_precision_state(leaf)
    return leaf.detach(), inner.state.get(leaf, {})


def _pieces(master_piece, part: slice, inner) -> List[Piece]:
    """The pieces of a part of a master piece: one, or one per global range a tensor-parallel shard's part maps
    to (ZeroParam.global_ranges)."""
    master, inner_state = _full_precision(inner, master_piece.master)
    n = master.numel()
    out, start = [], part.start
    for lo, hi in master_piece.global_ranges(part):
        sub, start = slice(start, start + hi - lo), start + hi - lo
        state = {
            k: (v[sub].clone() if _is_elementwise(v, n) else (v.clone() if torch.is_tensor(v) else v))
            for k, v in inner_state.items()
        }
        out.append({"range": (lo, hi), "master": master[sub].clone(), "state": state})
    return out


def shard_state(opt) -> Dict[str, Any]:
    """This rank's master weights and optimizer state, in global coordinates (see the module docstring)."""
    engine = opt.engine
    pieces: Dict[str, List[Piece]] = {}
    replicas: Dict[str, List[Piece]] = {}
    for master_piece in engine.master_pieces():
        name, owned = master_piece.param.name, master_piece.owned
        if master_piece.param.family.replicated_over_tp and opt.groups.tp_rank != 0:
            owned = slice(0, 0)  # tp rank 0 owns the replicas over tp: every rank's shards tile every param
        if owned.stop > owned.start:
            pieces.setdefault(name, []).extend(_pieces(master_piece, owned, opt.inner))
        for part in _unowned_parts(master_piece.numel, owned):
            replicas.setdefault(name, []).extend(_pieces(master_piece, part, opt.inner))
    return {
        "format": FORMAT,
        "stage": opt.settings.stage,
        "rank": opt.groups.rank,
        "world_size": opt.groups.world_size,
        "ep_size": opt.groups.ep_size,
        "pieces": pieces,
        "replicas": replicas,
        "shapes": engine.global_shapes(),
        **opt.scalar_state(),
    }


def _unowned_parts(n: int, owned: slice) -> List[slice]:
    """The parts of a piece of n elements outside its owned slice (stage 0 holds replicas of whole buckets)."""
    if owned.stop <= owned.start:
        return [slice(0, n)] if n else []
    return [s for s in (slice(0, owned.start), slice(owned.stop, n)) if s.stop > s.start]


def consolidate(shards: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Merge every rank's shard into full tensors: {"params": {name: tensor}, "state": {...}, ...}.

    Raises ValueError if the shards do not cover every element of every param exactly once.
    """
    first = shards[0]
    pieces: Dict[str, List[Piece]] = {}
    for shard in shards:
        for name, owned in shard["pieces"].items():
            pieces.setdefault(name, []).extend(owned)
    params, state = {}, {}
    for name, shape in first["shapes"].items():
        numel = int(torch.Size(shape).numel())
        check_covered_once(pieces.get(name, []), name, numel)
        master, merged = gather_range(pieces, name, 0, numel)
        params[name] = master.view(shape)
        state[name] = {k: (v.view(shape) if _is_elementwise(v, numel) else v) for k, v in merged.items()}
    scalars = {k: first[k] for k in ("param_groups", "loss_scaler", "skipped_steps", "consecutive_skips") if k in first}
    return {"format": CONSOLIDATED, "params": params, "state": state, **scalars}


def check_covered_once(pieces: List[Piece], name: str, numel: int) -> None:
    count = torch.zeros(numel, dtype=torch.int32)
    for piece in pieces:
        lo, hi = piece["range"]
        count[lo:hi] += 1
    if numel and not bool((count == 1).all()):
        raise ValueError(
            f"the shards cover parameter '{name}' {int(count.min())}..{int(count.max())} times; "
            "pass the shards of every rank of one checkpoint"
        )


def load_state(opt, source: Dict[str, Any]) -> None:
    """Collective: load a shard (this rank's, any stage) or a consolidated state (any layout), then publish. A
    state that does not hold what some rank needs (another layout's shard) is refused on every rank, before
    anything is loaded."""
    engine = opt.engine
    pieces = pieces_by_name(source)
    step_on_device = bool(opt.inner.defaults.get("fused") or opt.inner.defaults.get("capturable"))
    loaded, problem = [], None
    for master_piece in engine.master_pieces():
        ranges = master_piece.param.global_ranges(master_piece.param_range)
        try:
            parts = [gather_range(pieces, master_piece.param.name, lo, hi) for lo, hi in ranges]
            loaded.append((master_piece.master, master_piece.numel, *_joined(parts, ranges)))
        except ValueError as error:
            problem = _not_loadable(opt, source, error)
            break
    if not comm.all_true(problem is None, opt.groups.control):
        raise ValueError(
            problem
            or "another rank's optimizer state does not fit this optimizer's layout (that rank "
            "says which; a shard loads only on the layout that saved it): nothing was loaded"
        )
    with torch.no_grad():
        for leaf, n, master, state in loaded:
            if hasattr(opt.inner, "load_full_precision_state"):
                opt.inner.load_full_precision_state(leaf, master, state)
                continue
            leaf.copy_(master)
            if state:
                opt.inner.state[leaf] = {k: _placed(leaf, k, v, n, step_on_device) for k, v in state.items()}
            else:
                opt.inner.state.pop(leaf, None)
    opt.load_scalar_state(source)
    engine.publish()


def _joined(parts: List[Tuple[torch.Tensor, Dict[str, Any]]], ranges: List[Tuple[int, int]]):
    """(master, state) of consecutive global ranges as one: elementwise values concatenated, others the first's."""
    if len(parts) == 1:
        return parts[0]
    master = torch.cat([m for m, _ in parts])
    state: Dict[str, Any] = {}
    for key, value in parts[0][1].items():
        if _is_elementwise(value, ranges[0][1] - ranges[0][0]):
            value = torch.cat([s[key] for _, s in parts])
        state[key] = value
    return master, state


def _placed(leaf: torch.Tensor, key: str, value: Any, n: int, step_on_device: bool) -> Any:
    """A loaded state value where torch's Optimizer.load_state_dict puts it: on the leaf's device (a checkpoint
    is read on the CPU), elementwise floats in the leaf's dtype, and `step` on the device only for the fused and
    capturable kernels, which read it there."""
    if not torch.is_tensor(value):
        return value
    if key == "step":
        return value.to(device=leaf.device, dtype=torch.float32) if step_on_device else value
    if _is_elementwise(value, n) and value.is_floating_point():
        return value.to(device=leaf.device, dtype=leaf.dtype)
    return value.to(leaf.device)


def _layout(stage: Any, world: Any, ep: Any) -> str:
    return f"stage {stage} on {world} ranks, ep {ep}"


def _not_loadable(opt, source: Dict[str, Any], why: BaseException) -> str:
    """One line: what the state is, what it lacks, and the way (a shard loads on its own layout only)."""
    here = _layout(opt.settings.stage, opt.groups.world_size, opt.groups.ep_size)
    if "pieces" not in source:
        return f"the consolidated optimizer state cannot load into this optimizer (at {here}): {why}"
    saved = _layout(source.get("stage"), source.get("world_size"), source.get("ep_size"))
    what = f"rank {source.get('rank')}'s shard of an optimizer at {saved}"
    return (
        f"the optimizer state is {what}, which holds that rank's part only: {why}, which this rank needs (this "
        f"optimizer: {here}). Load "
        "each rank's own shard on the layout that saved it, or consolidate every rank's shard first "
        "(moezero.zero.consolidate(shards); tools/consolidate_checkpoint.py for a checkpoint) and load the "
        "result on any layout"
    )


def pieces_by_name(source: Dict[str, Any]) -> Dict[str, List[Piece]]:
    """The pieces of a shard (owned and replicas) or of a consolidated state."""
    if "pieces" in source:
        out: Dict[str, List[Piece]] = {}
        for key in ("pieces", "replicas"):
            for name, owned in source.get(key, {}).items():
                out.setdefault(name, []).extend(owned)
        return out
    out = {}
    for name, tensor in source["params"].items():
        flat = tensor.reshape(-1)
        state = {
            k: (v.reshape(-1) if torch.is_tensor(v) and v.shape == tensor.shape and v.dim() > 0 else v)
            for k, v in source["state"].get(name, {}).items()
        }
        out[name] = [{"range": (0, flat.numel()), "master": flat, "state": state}]
    return out


def gather_range(pieces: Dict[str, List[Piece]], name: str, lo: int, hi: int):
    """Master values and optimizer state for global elements [lo, hi) of `name`, from covering pieces."""
    if name not in pieces:
        raise ValueError(f"it has no optimizer state for parameter '{name}'")
    master = torch.empty(hi - lo, dtype=pieces[name][0]["master"].dtype if pieces[name] else torch.float32)
    state: Dict[str, Any] = {}
    filled = torch.zeros(hi - lo, dtype=torch.bool)
    for piece in pieces[name]:
        p_lo, p_hi = piece["range"]
        a, b = max(lo, p_lo), min(hi, p_hi)
        if a >= b:
            continue
        master[a - lo : b - lo] = piece["master"][a - p_lo : b - p_lo]
        filled[a - lo : b - lo] = True
        n = p_hi - p_lo
        for key, value in piece["state"].items():
            if _is_elementwise(value, n):
                if key not in state:
                    state[key] = torch.empty(hi - lo, dtype=value.dtype)
                state[key][a - lo : b - lo] = value[a - p_lo : b - p_lo]
            else:
                state.setdefault(key, value.clone() if torch.is_tensor(value) else value)
    if not bool(filled.all()):
        missing = int((~filled).nonzero()[0]) + lo
        raise ValueError(
            f"it does not cover element {missing} of parameter '{name}' (elements {lo}..{hi} are needed here)"
        )
    return master, state
