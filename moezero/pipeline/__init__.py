"""Pipeline parallelism: which layers each stage holds (layout.py, Megatron's flags and rules). Pure: no processes,
no torch."""
from moezero.pipeline.layout import PipelinePlan, StagePiece

__all__ = ["PipelinePlan", "StagePiece"]
