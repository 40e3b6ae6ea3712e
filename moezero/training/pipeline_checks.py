"""What a pretraining run at --pipeline-model-parallel-size > 1 is refused at start (pure: parse + checks).

    notice = resolve_pipeline_zero_stage(cfg)   # without --zero-stage at pp > 1: Megatron's stage 0 (or 1)
    plan = check_pipeline_run(cfg)   # Megatron's rules on the pipeline flags (any pp), then, at pp > 1, what the
                                     # pipeline execution does not run yet: one line each, naming the flag
    parse_configs(argv, ..., refusals=refused_at_launch)  # the latter at parse, with the other refused values

What runs at pp > 1 (moezero/training/pipeline_run.py): 1F1B (all forwards first when the micro-batches are fewer
than the stages), or the interleaved 1F1B with virtual stages, over tied or untied stages at ZeRO stages 0, 1 and 2,
the even, first/last and layout splits, dense and MoE layers (expert, context or tensor parallel within a stage:
--context-parallel-size or --tensor-model-parallel-size in Megatron's rank order), recompute, Adam, SGD
or Muon, clipping and the gradient norm over every stage, evaluation (forward only), checkpoints (a pp's resumes at
any other), upcycling (each stage its own layers), QAT (the recipe's plug-in, on each stage's weights). The rest is
refused here until the execution has it.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

from moezero.config import ConfigError
from moezero.pipeline import PipelinePlan
from moezero.training.context_parallel_checks import context_parallel_refusals

PP = "--pipeline-model-parallel-size"


def pipeline_plan(cfg) -> PipelinePlan:
    """Megatron's layer-to-stage plan of the run's flags; ConfigError (one line naming the flags) for what Megatron
    refuses."""
    p, model = cfg.parallel, cfg.model
    return PipelinePlan(
        num_layers=model.num_layers,
        mtp_num_layers=model.mtp_num_layers,
        pipeline_model_parallel_size=p.pipeline_parallel_size,
        num_layers_per_virtual_pipeline_stage=p.num_layers_per_virtual_pipeline_stage,
        num_virtual_stages_per_pipeline_rank=p.num_virtual_stages_per_pipeline_rank,
        decoder_first_pipeline_num_layers=p.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=p.decoder_last_pipeline_num_layers,
        pipeline_model_parallel_layout=p.pipeline_model_parallel_layout,
        account_for_embedding_in_pipeline_split=p.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=p.account_for_loss_in_pipeline_split,
        overlap_p2p_comm=not p.no_overlap_p2p_communication,
        microbatch_group_size_per_virtual_pipeline_stage=p.microbatch_group_size_per_virtual_pipeline_stage,
    )


def _unsupported(cfg) -> List[Tuple[bool, str]]:
    """(refused, its line) of what the pipeline execution does not run yet."""
    t, z = cfg.train, cfg.zero
    return [
        (
            z.stage == 3,
            "--zero-stage=3: not supported with pipeline stages yet: its parameter gathers are not yet exact under "
            "the schedule's micro-batches in flight (several forwards before their backwards); --zero-stage 2 "
            "shards the gradients and optimizer states there",
        ),
        (
            t.overlap_moe_expert_parallel_comm,
            "--overlap-moe-expert-parallel-comm: not supported with pipeline "
            "stages yet (its micro-batch pairs are a schedule of their own)",
        ),
    ]


def resolve_pipeline_zero_stage(cfg) -> Optional[str]:
    """At pp > 1 without --zero-stage typed: Megatron's stage (0, or 1 with --use-distributed-optimizer) in
    `cfg.zero.stage`; returns the notice line, None where nothing changed."""
    typed = getattr(cfg.checkpoint, "given_fields", ())
    return cfg.zero.resolve_pipeline_stage(cfg.parallel.pipeline_parallel_size, typed)


def pipeline_refusals(cfg) -> List[str]:
    """At pp > 1, every line of what the pipeline execution does not run yet that the run asks for (each naming
    its flag and the pipeline size); none at pp 1."""
    pp = cfg.parallel.pipeline_parallel_size
    if pp == 1:
        return []
    return [f"{line} ({PP}={pp})" for refused, line in _unsupported(cfg) if refused]


def refused_at_launch(sections: Dict[str, Any]) -> List[str]:
    """parse_configs' `refusals`: pipeline_refusals and context_parallel_refusals of the parsed sections, with the
    ZeRO stage a pp > 1 run gets where --zero-stage was not typed (resolved on a copy: the run resolves it, and says
    so, at start), so one launch lists them with the values the sections refuse."""
    zero = copy.copy(sections["zero"])
    zero.resolve_pipeline_stage(sections["parallel"].pipeline_parallel_size, sections["checkpoint"].given_fields)
    cfg = SimpleNamespace(**{**sections, "zero": zero})
    return pipeline_refusals(cfg) + context_parallel_refusals(cfg)


def check_pipeline_run(cfg) -> PipelinePlan:
    """The run's plan (Megatron's rules at any pp); at pp > 1 also what is not supported yet (one line each,
    naming the flag)."""
    plan = pipeline_plan(cfg)
    if plan.pp == 1:
        return plan
    plan.check_supported()
    problems = pipeline_refusals(cfg)
    if problems:
        raise ConfigError("\n".join(problems))
    return plan
