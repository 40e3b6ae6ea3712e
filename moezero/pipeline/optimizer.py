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

import contextlib
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from moezero.pipeline.stage_groups import PipelineGroups
from moezero.pipeline.tied import tied_embedding
from moezero.zero import ZeroOptimizer


class PipelineZeroOptimizer(ZeroOptimizer):
    """ZeroOptimizer(model, optimizer_cls, groups.stage, ...) whose gradient norm counts every stage's params once.

    Args: as ZeroOptimizer, with the rank's PipelineGroups for `groups` (stages 0 and 1 for now)."""

    def __init__(self, model: nn.Module, optimizer_cls: type, groups: PipelineGroups, **kwargs: Any):
        stage = kwargs.get("stage", 2)
        if stage not in (0, 1):
            raise ValueError(f"ZeRO stage {stage} with pipeline stages is not supported yet (0 and 1 are)")
        self.pipeline_groups = groups
        self.tied = None
        super().__init__(model, optimizer_cls, groups.stage, **kwargs)
        self.tied = tied_embedding(model, groups)  # None: no copy (untied without MTP), or a middle stage

    @contextlib.contextmanager
    def scaled_backwards(self) -> Iterator[None]:
        """The backwards the pipeline schedule runs inside are of a loss its loss function multiplied by the fp16 loss
        scale (the schedule's `loss_fn`, where ZeroOptimizer.backward would multiply)."""
        with self.engine.scaled_backward():
            yield

    def backward_of_scaled(self, loss: torch.Tensor) -> None:
        """loss.backward() of a loss whose gradient already carries the fp16 loss scale (the tied copy's gradient,
        from the last stage's scaled backwards): ZeroOptimizer.backward without its multiplication."""
        self._check_live()
        with self.engine.scaled_backward():
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
