"""A pretraining run's pipeline rank at --pipeline-model-parallel-size > 1: its groups, its stage model, optimizer
and step driver, built from the flags (what is refused at start: pipeline_checks.py).

    run = PipelineRun.build(cfg)                          # groups (collective over the world)
    model = run.build_model(cfg, gpt_config, dtype, device)   # the rank's StageModel
    opt = run.optimizer(cfg); trainer = run.trainer(opt, cfg)
"""

from __future__ import annotations

import contextlib
import datetime
from typing import List, Optional, Set

import torch
import torch.distributed as dist

from moezero.config import ConfigError
from moezero.context_parallel import ContextParallel
from moezero.deferred_values import allocate
from moezero.hf import CheckpointMismatch, UnsupportedModel, load_hub_weights
from moezero.moe import expert_parallel
from moezero.pipeline import PipelinePlan
from moezero.pipeline.optimizer import PipelineZeroOptimizer
from moezero.pipeline.stage_groups import PipelineGroups
from moezero.pipeline.stage_model import StageModel
from moezero.training.builders import optimizer_class, optimizer_param_groups, place_on
from moezero.training.pipeline_checks import pipeline_plan
from moezero.training.pipeline_step import PipelineTrainer
from moezero.training.tensor_parallel import apply_tensor_parallel_to_stage


class PipelineRun:
    """A pipeline rank's part of a run: its groups and plan, then its stage model (`build_model`)."""

    def __init__(self, groups: PipelineGroups, plan: PipelinePlan):
        self.groups, self.plan = groups, plan
        self.model: Optional[StageModel] = None

    @classmethod
    def build(cls, cfg) -> "PipelineRun":
        """The groups, in Megatron's rank order (a collective over the world)."""
        p = cfg.parallel
        groups = PipelineGroups.build(
            p.pipeline_parallel_size,
            p.expert_parallel_size,
            p.use_tp_pp_dp_mapping,
            timeout=datetime.timedelta(minutes=cfg.train.dist_timeout_minutes),
            context_parallel_size=p.context_parallel_size,
            tensor_parallel_size=p.tensor_parallel_size,
            expert_tensor_parallel_size=p.expert_tensor_parallel if cfg.moe.num_experts is not None else 1,
        )
        return cls(groups, pipeline_plan(cfg))

    def build_model(
        self, cfg, gpt_config, dtype: torch.dtype, device: Optional[torch.device], hub_dir: Optional[str] = None
    ) -> StageModel:
        """This rank's stages of the GPT (`gpt_config`: the run's, its vocabulary padded), expert, context and
        tensor parallel within the stage, in the params' dtype and on `device`; with `hub_dir` (--load-hf) its
        weights are that Hugging Face folder's tensors of these stages only, read lazily (the optimizer reads them; a
        tied output layer's copy takes the first stage's when the optimizer is built)."""
        moe = cfg.moe if cfg.moe.num_experts is not None else None
        with torch.device("meta") if hub_dir else contextlib.nullcontext():
            model = StageModel(
                gpt_config,
                moe,
                cfg.train.seed,
                self.plan,
                self.groups.pp_rank,
                moe_layer=expert_parallel(self.groups.stage),
                context_parallel=ContextParallel(self.groups.stage.cp, cfg.parallel.cp_comm_type),
            )
        model = model.to(dtype)
        # the stage's modules swapped for the tensor-parallel ones (their slices of its keyed init; --load-hf: on the
        # meta device too, as build_model's, the slices unread: moving a slice there would drop its shard's mark)
        with torch.device("meta") if hub_dir else contextlib.nullcontext():
            model = apply_tensor_parallel_to_stage(model, self.groups.stage.tp, cfg.implementation.sequence_parallel)
        if hub_dir:
            if model.embedding_copy is not None:  # not a param: the first stage's loaded values reach it (tied.py)
                allocate(model.embedding_copy.weight)
            try:
                load_hub_weights(model, hub_dir, whole=False)
            except (CheckpointMismatch, UnsupportedModel) as exc:  # the files do not hold the configs' model
                raise ConfigError(f"--load-hf={hub_dir}: {exc}") from None
        self.model = place_on(model, device) if device is not None else model
        return self.model

    def other_stages_params(self) -> Set[str]:
        """The names of the params the other stages hold (a collective over the world)."""
        mine = [name for name, _ in self.model.named_parameters()]
        every: List[List[str]] = [[] for _ in range(self.groups.world_size)]
        dist.all_gather_object(every, mine, group=self.groups.world_control)
        return {name for names in every for name in names} - set(mine)

    @property
    def log_rank(self) -> int:
        """The rank that logs: Megatron's last rank of the world (a last stage: it holds the loss)."""
        return self.groups.world_size - 1

    def optimizer(self, cfg) -> PipelineZeroOptimizer:
        """The stage's ZeRO optimizer (build_optimizer's class, groups and settings), its norm over every stage."""
        cls, kwargs = optimizer_class(cfg)
        return PipelineZeroOptimizer.from_config(
            self.model,
            cls,
            self.groups,
            cfg.zero,
            param_groups=optimizer_param_groups(self.model, cfg.train),
            fp16=cfg.train.fp16,
            lr=cfg.train.lr,
            **kwargs,
        )

    def trainer(self, opt: PipelineZeroOptimizer, cfg) -> PipelineTrainer:
        t = cfg.train
        return PipelineTrainer(
            self.model, opt, self.groups, t.micro_batch_size, cfg.model.seq_length, t.calculate_per_token_loss
        )
