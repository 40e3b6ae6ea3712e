"""Pipeline parallelism: which layers each stage holds (layout.py, Megatron's flags and rules) and Megatron's rank
order with a pipeline dimension (ranks.py), exported here (pure: no processes, no torch). The execution on
torch.distributed.pipelining is imported from its own modules: stage_groups.py (PipelineGroups), stage_model.py
(StageModel), optimizer.py (PipelineZeroOptimizer); the step driver is the training layer's
moezero/training/pipeline_step.py (PipelineTrainer)."""

from moezero.pipeline.layout import PipelinePlan, StagePiece
from moezero.pipeline.ranks import PipelineRankLayout, pipeline_rank_layout

__all__ = ["PipelinePlan", "PipelineRankLayout", "StagePiece", "pipeline_rank_layout"]
