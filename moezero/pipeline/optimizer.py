"""The ZeroOptimizer of one pipeline stage: ZeRO over the stage's groups, the gradient norm over every stage.

Each stage's optimizer shards its own params over its dp (and edp) group; its StepTotals already count every element
of the stage once. Stages hold disjoint params (a tied embedding's copy on the last stage is not one of its params:
tied.py), so the model's sum of squares is the sum of the stages':
one float64 all-reduce over the pp group after the stage's own (on every rank, finite or not), and the clipping
coefficient, the non-finite skip and the loss scaler's update follow from the same number on every rank. The params
norm (Megatron's log) is summed the same way.

It overrides ZeroOptimizer's seam for that, `sum_over_model_parts`; the count of zero gradient elements
(--log-num-zeros-in-grad, each stage's over its own params) is summed over the pp group the same way after the step.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from moezero.pipeline.stage_groups import PipelineGroups
from moezero.pipeline.tied import tied_embedding
from moezero.zero import ZeroOptimizer


class PipelineZeroOptimizer(ZeroOptimizer):
    """ZeroOptimizer(model, optimizer_cls, groups.stage, ...) whose gradient norm counts every stage's params once.

    Args: as ZeroOptimizer, with the rank's PipelineGroups for `groups` (ZeRO stages 0-2: stage 2 reduces
    at every micro-batch's backward, the schedule's interleaving of forwards and backwards changes nothing there)."""

    def __init__(self, model: nn.Module, optimizer_cls: type, groups: PipelineGroups, **kwargs: Any):
        stage = kwargs.get("stage", 2)
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeRO stage {stage} with pipeline stages is not supported yet (0, 1 and 2 are)")
        self.pipeline_groups = groups
        self.tied = None
        super().__init__(model, optimizer_cls, groups.stage, **kwargs)
        self.tied = tied_embedding(model, groups)  # None: no copy (untied without MTP), or a middle stage
        if self.tied is not None:  # keyed alike, the copy is equal already, unless the weight was read (--load-hf)
            self.tied.refresh()

    def backward_of_scaled(self, loss: torch.Tensor) -> None:
        """loss.backward() of a loss whose gradient already carries the fp16 loss scale (the tied copy's gradient,
        from the last stage's scaled backwards): ZeroOptimizer.backward without its multiplication."""
        with self.scaled_backwards():
            loss.backward()

    def step(self, closure=None) -> bool:
        """ZeroOptimizer's step; where the last stage holds a copy of the word embedding (tied embedding and output
        weights, or MTP depths) the copy's gradient joins the first stage's before it, and the copy takes the stepped
        values after it (tied.py)."""
        if self.tied is not None:
            self.tied.sum_grads(self)
        stepped = super().step(closure)
        if stepped and self.count_zeros_in_grad:  # every rank alike: the norm was finite on every stage
            self.last_num_zeros_in_grad = int(self.sum_over_model_parts(float(self.last_num_zeros_in_grad)))
        if self.tied is not None:
            self.tied.refresh()
        return stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.tied is not None:
            self.tied.clear_grad()

    def load_state_dict(self, state: Dict) -> None:
        """ZeroOptimizer's; then the tied copy takes the loaded weight (a checkpoint stores it once)."""
        super().load_state_dict(state)
        if self.tied is not None:
            self.tied.refresh()

    def state_dict(self) -> Dict:
        """This rank's shard (ZeroOptimizer's), its "shapes" those of every stage's params: a checkpoint's train state
        records them (the global model's, which another layout checks its params against), and DCP keeps one rank's
        copy of it. A collective over the world (every rank saves)."""
        shard = super().state_dict()
        every: List[Dict] = [{}] * self.pipeline_groups.world_size
        if self.pipeline_groups.world_control is not None and self.pipeline_groups.world_size > 1:
            dist.all_gather_object(every, shard["shapes"], group=self.pipeline_groups.world_control)
        else:
            every = [shard["shapes"]]
        shard["shapes"] = {name: shape for shapes in every for name, shape in shapes.items()}
        return shard

    def scalar_state(self) -> Dict[str, Any]:
        """ZeroOptimizer's, its param groups those of the whole model: the stages hold different groups
        (--decoupled-lr's embedding and output groups live on the first and last stage only) and a checkpoint keeps
        one rank's copy, so every rank lists every stage's groups, one per kind, in the order one process's
        optimizer has them (Megatron's groups: decayed before not, each plain before decoupled). A collective over
        the world (every rank saves)."""
        state = super().scalar_state()
        every: List[List[Dict]] = [[] for _ in range(self.pipeline_groups.world_size)]
        dist.all_gather_object(every, state["param_groups"], group=self.pipeline_groups.world_control)
        kinds = [[_group_kind(group) for group in groups] for groups in every]
        if any(len(set(k)) != len(k) for k in kinds):  # groups of the user's own, alike on every stage
            return state
        merged = {kind: group for groups, k in zip(every, kinds) for kind, group in zip(k, groups)}
        state["param_groups"] = [merged[kind] for kind in sorted(merged)]
        return state

    def load_scalar_state(self, state: Dict[str, Any]) -> None:
        """ZeroOptimizer's, each of this stage's groups taking the saved group of its kind (a checkpoint lists the
        whole model's groups, whichever layout saved it)."""
        saved = state.get("param_groups") or []
        by_kind = {_group_kind(group): group for group in saved}
        mine = [_group_kind(group) for group in self.param_groups]
        if len(by_kind) == len(saved) and len(set(mine)) == len(mine) and all(kind in by_kind for kind in mine):
            state = dict(state, param_groups=[by_kind[kind] for kind in mine])
        super().load_scalar_state(state)

    def sum_over_model_parts(self, stage_total: float) -> float:
        """Collective over the pp group: the sum of every stage's total. torch's own all-reduce, not comm's: the pp
        group must stay free of anything that keeps a reference to it (PipelineGroups.close_pp)."""
        total = torch.tensor([stage_total], dtype=torch.float64)
        group = self._pp_group()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return float(total[0])

    def _pp_group(self) -> Optional[Any]:
        group = self.pipeline_groups.pp
        if group is None and self.pipeline_groups.pp_size > 1:
            raise RuntimeError("this rank's pipeline group was closed after a stage failed; the run cannot step")
        return group


def _group_kind(group: Dict[str, Any]) -> Tuple[float, bool, int, Tuple[int, ...]]:
    """A Megatron param group's kind, ordered as megatron_param_groups orders them: decayed (wd_mult 1) before not,
    plain before --decoupled-lr's (which carry max_lr); with Muon (muon_param_groups) each of those split into its
    Muon groups, a fused QKV's row split before the whole matrices (QKV is a layer's first matrix), then Adam's."""
    split = tuple(group.get("muon_split_rows") or ())
    muon_order = (0 if split else 1) if group.get("muon") else 2
    return -group.get("wd_mult", 1.0), "max_lr" in group, muon_order, split
