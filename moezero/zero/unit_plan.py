"""Stage 3 gather units: which params are gathered together (the plan; `units.py` gathers them).

A unit is a module (or a run of modules) whose params are full only around its own forward and backward:
  - every routed-expert stack (a module that directly owns expert-tagged params),
  - every block: a module held in an nn.ModuleList or nn.Sequential; with `min_unit_params`, a run of
    consecutive blocks whose params reach it (from the forward of the first of them that runs to the last
    one's, or until the schedule passes the run where a rank skipped its last block),
  - the root: every other param (embeddings, final norm, an output head, small branches). The
    root is gathered from the start of the forward to the end of the following backward, so a
    param used outside its own module's forward (a tied output head using the embedding weight
    in the root's forward) is always full when it is used. So is the unit the backward starts
    with (the last block), which would otherwise be freed and gathered again at once.
A param registered under two units belongs to the root. Units nest (an expert stack inside a
block): a unit's params are those of its subtree outside nested units.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Set, Tuple

import torch
from torch import nn

from moezero.parallel import is_expert_parallel


@dataclass
class UnitPlan:
    modules: List[nn.Module]  # a unit's first module; [0] is the root
    names: List[str]
    unit_of: Dict[int, int]  # id(param) -> unit
    forward_order: List[int] = field(default_factory=list)  # units but the root, module pre-order
    backward_order: List[int] = field(default_factory=list)  # reverse post-order
    last_modules: List[nn.Module] = field(default_factory=list)  # a unit's last module (its forward ends it)
    members: List[List[nn.Module]] = field(default_factory=list)  # a unit's modules (a run's blocks), in order
    parent: Dict[int, int] = field(default_factory=dict)  # a nested unit -> the unit it sits in


def plan_units(model: nn.Module, params: Sequence[torch.Tensor], min_unit_params: int = 0) -> UnitPlan:
    """The units of `model` for the managed `params`. Consecutive blocks of one container share a unit until
    their params (their expert stacks' aside) reach `min_unit_params`; a last group short of it joins the group
    before it, and blocks that all together fall short of it stay in their parent's unit: gathering a few bytes
    alone costs a collective and an agreement record all the same (DeepSpeed's prefetch buckets and
    stage3_param_persistence_threshold, FSDP's size-based wrap policy)."""
    managed = {id(p) for p in params}
    modules, last_modules, members, names, pre, post = [model], [model], [[model]], [""], [], []
    parent: Dict[int, int] = {}
    owner: Dict[int, int] = {}  # id(param) -> unit, 0 when registered under two units
    seen: Set[int] = set()

    def new_unit(run: List[nn.Module], name: str, inside: int) -> int:
        modules.append(run[0])
        last_modules.append(run[-1])
        members.append(run)
        names.append(name)
        pre.append(len(modules) - 1)
        parent[len(modules) - 1] = inside
        return len(modules) - 1

    def walk(module: nn.Module, name: str, unit: int) -> None:
        for p in module.parameters(recurse=False):
            if id(p) in managed:
                owner[id(p)] = unit if owner.get(id(p), unit) == unit else 0
        children = []
        for child_name, child in module.named_children():
            if id(child) not in seen:
                seen.add(id(child))
                children.append((f"{name}.{child_name}" if name else child_name, child))
        groups = (
            _block_groups(children, managed, min_unit_params)
            if isinstance(module, (nn.ModuleList, nn.Sequential))
            else []
        )
        first_of = {id(group[0][1]): group for group in groups}
        group_unit, group_last = unit, None
        for full, child in children:
            group = first_of.get(id(child))
            if group is not None:
                group_unit, group_last = new_unit([m for _, m in group], _group_name(group), unit), group[-1][1]
            if _owns_experts(child, managed):
                own = new_unit([child], full, group_unit)
                walk(child, full, own)
                post.append(own)
            else:
                walk(child, full, group_unit)
            if child is group_last:
                post.append(group_unit)
                group_unit, group_last = unit, None

    walk(model, "", 0)
    used = set(owner.values())  # units left without params of their own (pure containers) are not gathered
    return UnitPlan(
        modules,
        names,
        owner,
        [u for u in pre if u in used],
        [u for u in reversed(post) if u in used],
        last_modules,
        members,
        parent,
    )


def _owns_experts(module: nn.Module, managed: Set[int]) -> bool:
    """A routed-expert stack: a unit of its own wherever it sits."""
    return any(is_expert_parallel(p) and id(p) in managed for p in module.parameters(recurse=False))


def _dense_params(module: nn.Module, managed: Set[int]) -> int:
    return sum(p.numel() for p in module.parameters() if id(p) in managed and not is_expert_parallel(p))


def _block_groups(
    children: List[Tuple[str, nn.Module]], managed: Set[int], min_params: int
) -> List[List[Tuple[str, nn.Module]]]:
    """A container's blocks (children holding managed params) in consecutive groups of >= min_params."""
    blocks = [
        (name, child)
        for name, child in children
        if any(id(p) in managed for p in child.parameters()) and not _owns_experts(child, managed)
    ]
    groups: List[List[Tuple[str, nn.Module]]] = []
    current: List[Tuple[str, nn.Module]] = []
    size = 0
    for name, block in blocks:
        current.append((name, block))
        size += _dense_params(block, managed)
        if size >= min_params:
            groups.append(current)
            current, size = [], 0
    if current and groups:
        groups[-1].extend(current)  # a short tail joins the group before it
    return groups


def _group_name(group: List[Tuple[str, nn.Module]]) -> str:
    """`layers.3` for one block, `layers.0..3` for blocks 0 to 3."""
    first, last = group[0][0], group[-1][0]
    return first if len(group) == 1 else f"{first}..{last.rsplit('.', 1)[-1]}"
