"""GPT-MoE pretraining as `examples_moe/pretrain_gpt_moe.py` runs it: the training layer with
quantization-aware training plugged in from above (training never imports compression).

    sys.exit(main())                            # parse the flags of every section, train
    run = pretraining(cfg); run.train()         # in-process (tests)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union

from torch import nn

from moezero.compression import PLUGIN_NAME, QATConfig, QATController, apply_qat
from moezero.config import ConfigError
from moezero.parallel import ParallelGroups
from moezero.pipeline.stage_groups import PipelineGroups
from moezero.training.args import parse_configs
from moezero.training.configs import CONFIG_CLASSES as TRAINING_CONFIG_CLASSES
from moezero.training.configs import DESCRIPTION, Configs
from moezero.training.job import run
from moezero.training.pipeline_checks import refused_at_launch
from moezero.training.pretrain import Pretraining

CONFIG_CLASSES = TRAINING_CONFIG_CLASSES + (QATConfig,)


@dataclass
class RecipeConfigs(Configs):
    qat: QATConfig = field(default_factory=QATConfig)


def attach_qat(
    model: nn.Module, groups: Union[ParallelGroups, PipelineGroups], cfg: RecipeConfigs
) -> Optional[QATController]:
    """Fake quantization in the model's forward when --qat-weight-bits is set; at pp > 1 (`groups`: the rank's
    PipelineGroups) on the rank's stages, its error summed over the pipeline."""
    if not cfg.qat.enabled:
        return None
    refuse_qat_on_shards(cfg)
    if isinstance(groups, PipelineGroups):
        return apply_qat(model, cfg.qat, groups.stage, cfg.train.seed, sum_over_stages=groups.sum_over_stages)
    return apply_qat(model, cfg.qat, groups, cfg.train.seed)


def refuse_qat_on_shards(cfg: RecipeConfigs) -> None:
    """Weights' scales are computed over their shards (compression/shard_quant.py); activations' are per token, and a
    row-parallel layer's input token is split over tp (an expert's second matmul's over etp): each rank would scale
    its own slice of the token, a different quantization from one process's, silently. One line until then."""
    p = cfg.parallel
    etp = p.expert_tensor_parallel if cfg.moe.num_experts else 1
    sizes = (("--tensor-model-parallel-size", p.tensor_parallel_size), ("--expert-tensor-parallel-size", etp))
    sharded = [f"{flag}={size}" for flag, size in sizes if size > 1]
    if sharded and cfg.qat.activation_bits is not None:
        raise ConfigError(
            f"--qat-activation-bits={cfg.qat.activation_bits}: not supported with {', '.join(sharded)} yet (a "
            "row-parallel layer's per-token scales would be each shard's slice of the token's)"
        )


PLUGINS = {PLUGIN_NAME: attach_qat}


def parse(argv: Optional[List[str]] = None) -> RecipeConfigs:
    return RecipeConfigs(**parse_configs(argv, CONFIG_CLASSES, DESCRIPTION, refusals=refused_at_launch))


def pretraining(cfg: RecipeConfigs) -> Pretraining:
    return Pretraining(cfg, PLUGINS)


def main(argv: Optional[List[str]] = None) -> int:
    """The example script's entry point; returns the process exit code."""
    return run(parse(argv), PLUGINS)
