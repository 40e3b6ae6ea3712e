"""`opt.modify_model()`: change the model under a live optimizer, at any stage.

On entry every param is full and plain (stage 3 gathers them; no param lives in an optimizer
buffer), so the user may read, write in place, replace modules or params, freeze or unfreeze.
On exit the optimizer adopts the model's current params (all of them but those the user left out
of every param group, as torch.optim would hold them):
  - a param still present keeps its group, its optimizer state, and its values as written: an
    element that still equals what the optimizer published keeps its wider master value (a bf16
    model does not lose its fp32 masters), a written element takes the new value;
  - a new param starts with fresh state, in the group of the param it replaced (same name), or else
    in a new group with the optimizer's defaults (torch's add_param_group);
  - a param that is gone is dropped; a frozen one stays (skipped while frozen, trained again once
    unfrozen here).
Collective: every rank must make the same change. Before adopting, the ranks compare what they
adopted (names, global shapes, dtypes, frozen or not, group, kept/replaced/new, and the values
over each replica group) and all raise `RanksDisagree` naming the first difference. The state of
every param is consolidated on every rank for the duration (all_gather_object), which is the
price of a layout that changes.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from moezero.parallel import expert_shard_of
from moezero.parallel.agreement import RanksDisagree
from moezero.parallel.tensor_marker import tensor_shard_of
from moezero.zero.rank_agreement import Activity
from moezero.zero.zero_param import global_placement, param_global_ranges
from moezero.zero.master import master_dtype_of
from moezero.zero.state import consolidate


class ModifiedDifferently(RanksDisagree):
    """The ranks adopted different params or values; the optimizer lets go of the model (nothing to adopt)."""

    def __init__(self, problem: str):
        super().__init__(
            f"opt.modify_model(): the ranks made different changes: {problem}. Every rank must make "
            "the same change (seed the random init of a new module the same way on every rank)"
        )
        self.problem = problem


class AdoptionFailed(RuntimeError):
    """Adopting the changed model raised; the optimizer lets go of the model (its engine is detached)."""

    def __init__(self, problem: str):
        super().__init__(f"opt.modify_model() could not adopt the changed model: {problem}")
        self.problem = problem


@contextlib.contextmanager
def modify_model(opt) -> Iterator[None]:
    opt.engine.check_agreement(Activity.MODIFY_MODEL)
    full = _consolidated_state(opt)
    before = {id(p): (opt.param_name(p), g) for g, group in enumerate(opt.param_groups) for p in group["params"]}
    left_out = {id(p) for p in opt.model.parameters() if opt.engine.left_out(p)}
    opt.engine.detach()  # no hooks inside: the model runs plain
    try:
        yield
    finally:
        try:
            _adopt(opt, full, before, left_out)
        except ModifiedDifferently:
            raise
        except Exception as error:  # a state that does not load, a param it cannot place: nothing adopted
            raise AdoptionFailed(f"{type(error).__name__}: {error}") from error


def _consolidated_state(opt) -> Dict[str, Any]:
    """Every rank's shard merged: over the optimizer's ranks, then over tp (the other shards of the model)."""
    shards = [opt.state_dict()]
    for group in (opt.groups.control, opt.groups.tp):
        if group is not None:
            every: List[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, shards, group=group)
            shards = [shard for some in every for shard in some]
    return consolidate(shards)


def _adopt(opt, full: Dict[str, Any], before: Dict[int, Tuple[str, int]], left_out: Set[int]) -> None:
    """Adopt the model's params but those the user left out of every param group (`left_out`: their ids)."""
    current = [(n, p) for n, p in opt.model.named_parameters() if id(p) not in left_out]
    removed_groups = {name: g for pid, (name, g) in before.items() if pid not in {id(p) for _, p in current}}
    groups = [dict(g, params=[]) for g in opt.param_groups]
    fresh_group = None
    pieces: Dict[str, list] = {}
    adopted: List[_Adopted] = []
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
        pieces[name] = _pieces(p, full, before.get(id(p), (None,))[0])
        origin = "kept" if id(p) in before else "replaced" if name in removed_groups else "new"
        adopted.append(_Adopted(name, p, g, origin))
    _check_every_rank_adopted_the_same(opt, adopted)
    opt.rebuild(groups)
    opt.load_state_dict(
        {
            "pieces": pieces,
            **{k: full[k] for k in ("loss_scaler", "skipped_steps", "consecutive_skips")},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        }
    )


class _Adopted:
    """What this rank adopts for one param: its description (which every rank must share) and a
    digest of its values (which every rank holding the same replica must share)."""

    def __init__(self, name: str, p: nn.Parameter, group: int, origin: str):
        shape, _ = global_placement(p)
        frozen = "" if p.requires_grad else ", frozen"
        dtype = str(p.dtype).removeprefix("torch.")
        self.description = f"'{name}' {tuple(shape)} {dtype}{frozen}, group {group}, {origin}"
        shard, tensor_shard = expert_shard_of(p), tensor_shard_of(p)
        # which replica it is: dense params one everywhere, experts one per ep rank, tp/etp slices one per slice
        self.replica = (-1 if shard is None else shard.ep_rank, None if tensor_shard is None else tensor_shard.blocks)
        self.name = name
        values = p.detach().contiguous().reshape(-1).cpu()
        self.digest = hashlib.blake2b(values.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()

    def summary(self) -> Tuple[str, str, Tuple[int, Any], str]:
        return self.name, self.description, self.replica, self.digest


def _check_every_rank_adopted_the_same(opt, adopted: List["_Adopted"]) -> None:
    """Collective: every rank raises RanksDisagree, naming the first difference, unless all adopted
    the same params (same descriptions in the same order) with the same values on every replica."""
    control = opt.groups.control
    if control is None:
        return
    every: List[Any] = [None] * dist.get_world_size(control)
    dist.all_gather_object(every, [a.summary() for a in adopted], group=control)
    problem = _first_difference(every)
    if problem is not None:
        raise ModifiedDifferently(problem)


def _first_difference(every: List[List[Tuple[str, str, Tuple[int, Any], str]]]) -> Optional[str]:
    first = every[0]
    for rank, summaries in enumerate(every[1:], start=1):
        for i in range(max(len(first), len(summaries))):
            a = first[i][1] if i < len(first) else "nothing more"
            b = summaries[i][1] if i < len(summaries) else "nothing more"
            if a != b:
                return f"rank 0 adopted {a} where rank {rank} adopted {b}"
    holder: Dict[Tuple[str, Tuple[int, Any]], Tuple[int, str]] = {}
    for rank, summaries in enumerate(every):
        for name, _, replica, digest in summaries:
            seen = holder.setdefault((name, replica), (rank, digest))
            if seen[1] != digest:
                return (
                    f"'{name}' holds different values on rank {seen[0]} and rank {rank}, which must hold the same "
                    "replica"
                )
    return None


def _pieces(p: nn.Parameter, full: Dict[str, Any], old_name) -> List[Dict[str, Any]]:
    """This rank's part of `p` in global coordinates (one piece per global range it maps to)."""
    value, start, out = p.detach().reshape(-1), 0, []
    for lo, hi in param_global_ranges(p):
        out.append(_piece(p, value[start : start + hi - lo], (lo, hi), full, old_name))
        start += hi - lo
    return out


def _piece(p: nn.Parameter, value: torch.Tensor, span, full: Dict[str, Any], old_name) -> Dict[str, Any]:
    """Global elements `span` of `p` (`value`, this rank's): merged master values and kept optimizer state."""
    shape, _ = global_placement(p)
    lo, hi = span
    master_dtype = master_dtype_of(p.dtype)
    old = full["params"].get(old_name) if old_name is not None else None
    if old is None or tuple(old.shape) != tuple(shape):
        return {"range": (lo, hi), "master": value.to(master_dtype), "state": {}}
    kept = old.reshape(-1)[lo:hi]
    master = torch.where(value == kept.to(value.dtype), kept, value.to(kept.dtype))
    numel = old.numel()
    state = {
        k: (v.reshape(-1)[lo:hi] if torch.is_tensor(v) and v.numel() == numel and v.dim() > 0 else v)
        for k, v in full["state"].get(old_name, {}).items()
    }
    return {"range": (lo, hi), "master": master, "state": state}
