"""Sharded optimizer state in global coordinates: save a rank's pieces, consolidate all ranks', load anywhere.

Every piece is addressed by a param's name and a range of the flat elements of its *global*
tensor (routed experts stacked over the global experts: the local stack of ep rank r holds
experts [r * L, (r + 1) * L)), so a state saved with one dp/ep/stage layout loads into another. A
tensor-parallel shard's part may lie in several global ranges (fused row blocks; a dim-1 split: one per row):
its pieces are strided ranges (`strided_ranges.Span`, a piece's "range" (lo, hi, count, stride)), at most three
per block (`ZeroParam.global_spans`); a param replicated over tp is owned on tp rank 0, a replica elsewhere. A
piece's values are its elements run-major; loading intersects any saved spans with any held ones.

A shard (`shard_state`) holds the pieces this rank *owns* (every element is owned by exactly one
rank, so the shards of all ranks tile every param) and, at stage 0 where each rank holds
everything, the rest as `replicas` so one rank's shard reloads on that rank alone. `consolidate`
is the one merge of shards into full tensors; it checks the coverage.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from moezero.parallel import comm
from moezero.zero.strided_ranges import Span, overlap, strided_view

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
    """The pieces of a part of a master piece: one, or one per global span a tensor-parallel shard's part maps
    to (ZeroParam.global_spans)."""
    master, inner_state = _full_precision(inner, master_piece.master)
    first = master_piece.param_range[0]
    start = first + part.start
    pairs = master_piece.param.global_spans((start, start + part.stop - part.start))
    return span_pieces([(local.shifted(-first), glob) for local, glob in pairs], master, inner_state)


def span_pieces(pairs: List[Tuple[Span, Span]], master: torch.Tensor, state: Dict[str, Any]) -> List[Piece]:
    """One piece per (span of `master`'s elements, global span holding them): the values taken run by run,
    elementwise state alike, other state copied."""
    n = master.numel()
    out = []
    for local, glob in pairs:

        def take(values: torch.Tensor) -> torch.Tensor:
            return strided_view(values, local).reshape(-1).clone()

        kept = {
            k: (take(v) if _is_elementwise(v, n) else (v.clone() if torch.is_tensor(v) else v))
            for k, v in state.items()
        }
        out.append({"range": glob.as_range(), "master": take(master), "state": kept})
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
        master, merged = gather_span(pieces, name, Span(0, numel))
        params[name] = master.view(shape)
        state[name] = {k: (v.view(shape) if _is_elementwise(v, numel) else v) for k, v in merged.items()}
    scalars = {k: first[k] for k in ("param_groups", "loss_scaler", "skipped_steps", "consecutive_skips") if k in first}
    return {"format": CONSOLIDATED, "params": params, "state": state, **scalars}


def check_covered_once(pieces: List[Piece], name: str, numel: int) -> None:
    count = torch.zeros(numel, dtype=torch.int32)
    for piece in pieces:
        span = Span.of(piece["range"])
        if span.plain:
            count[span.lo : span.hi] += 1
        else:
            count[span.indices()] += 1  # a span's elements are distinct
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
        try:
            loaded.append((master_piece.master, master_piece.numel, *_assembled(pieces, master_piece)))
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


def _assembled(pieces: Dict[str, List[Piece]], master_piece) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """(master, state) of a master piece from the pieces (`assemble` over its global spans)."""
    first = master_piece.param_range[0]
    pairs = master_piece.param.global_spans(master_piece.param_range)
    shifted = [(local.shifted(-first), glob) for local, glob in pairs]
    return assemble(pieces, master_piece.param.name, shifted, master_piece.numel)


def assemble(
    pieces: Dict[str, List[Piece]], name: str, pairs: List[Tuple[Span, Span]], n: int
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """(master, state) of `n` elements of `name` from the pieces: for each (span of the n, global span holding
    them), the global span gathered (`gather_span`) and put in place; elementwise values so assembled, others
    the first span's. The inverse of `span_pieces`."""
    master, state = None, {}
    for local, glob in pairs:
        values, span_state = gather_span(pieces, name, glob)
        if master is None:
            master = torch.empty(n, dtype=values.dtype)
        strided_view(master, local).copy_(values.view(local.count, local.width))
        for key, value in span_state.items():
            if _is_elementwise(value, glob.numel):
                if key not in state:
                    state[key] = torch.empty(n, dtype=value.dtype)
                strided_view(state[key], local).copy_(value.view(local.count, local.width))
            else:
                state.setdefault(key, value)
    return (master if master is not None else torch.empty(0)), state


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


def gather_span(pieces: Dict[str, List[Piece]], name: str, span: Span):
    """Master values and optimizer state for the global elements `span` of `name` (run-major), from the pieces
    that hold them (plain or strided)."""
    if name not in pieces:
        raise ValueError(f"it has no optimizer state for parameter '{name}'")
    n = span.numel
    master = torch.empty(n, dtype=pieces[name][0]["master"].dtype if pieces[name] else torch.float32)
    state: Dict[str, Any] = {}
    filled = torch.zeros(n, dtype=torch.bool)
    for piece in pieces[name]:
        saved = Span.of(piece["range"])
        common = overlap(saved, span)
        if common is None:
            continue
        here, there = common
        master[here] = piece["master"][there].to(master.dtype)  # index tensors do not cast as slices do
        filled[here] = True
        for key, value in piece["state"].items():
            if _is_elementwise(value, saved.numel):
                if key not in state:
                    state[key] = torch.empty(n, dtype=value.dtype)
                state[key][here] = value[there].to(state[key].dtype)
            else:
                state.setdefault(key, value.clone() if torch.is_tensor(value) else value)
    if not bool(filled.all()):
        missing = int(span.indices()[int((~filled).nonzero()[0])])
        raise ValueError(
            f"it does not cover element {missing} of parameter '{name}' (elements {_described(span)} are needed here)"
        )
    return master, state


def _described(span: Span) -> str:
    if span.plain:
        return f"{span.lo}..{span.hi}"
    return f"{span.lo}..{span.hi} and {span.count - 1} more runs of them every {span.stride}"
