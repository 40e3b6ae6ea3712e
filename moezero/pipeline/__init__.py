"""Pipeline parallelism: which layers each stage holds (layout.py, Megatron's flags and rules) and Megatron's rank
order with a pipeline dimension (ranks.py). Pure: no processes, no torch."""
from moezero.pipeline.layout import PipelinePlan, StagePiece
from moezero.pipeline.ranks import PipelineRankLayout, pipeline_rank_layout

__all__ = ["PipelinePlan", "PipelineRankLayout", "StagePiece", "pipeline_rank_layout"]
