"""GPT-MoE pretraining as `examples_moe/pretrain_gpt_moe.py` runs it: the training layer with
quantization-aware training plugged in from above (training never imports compression).

    sys.exit(main())                            # parse the flags of every section, train
    run = pretraining(cfg); run.train()         # in-process (tests)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from torch import nn

from moezero.compression import PLUGIN_NAME, QATConfig, QATController, apply_qat
from moezero.config import ConfigError
from moezero.parallel import ParallelGroups
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


def attach_qat(model: nn.Module, groups: ParallelGroups, cfg: RecipeConfigs) -> Optional[QATController]:
    """Fake quantization in the model's forward when --qat-weight-bits is set (refused with pipeline stages until
    tested there: one line at start, before the optimizer)."""
    if not cfg.qat.enabled:
        return None
    if cfg.parallel.pipeline_parallel_size > 1:
        raise ConfigError(
            f"--qat-weight-bits={cfg.qat.weight_bits}: quantization-aware training with "
            f"--pipeline-model-parallel-size={cfg.parallel.pipeline_parallel_size} is not supported yet"
        )
    return apply_qat(model, cfg.qat, groups, cfg.train.seed)


PLUGINS = {PLUGIN_NAME: attach_qat}


def parse(argv: Optional[List[str]] = None) -> RecipeConfigs:
    return RecipeConfigs(**parse_configs(argv, CONFIG_CLASSES, DESCRIPTION, refusals=refused_at_launch))


def pretraining(cfg: RecipeConfigs) -> Pretraining:
    return Pretraining(cfg, PLUGINS)


def main(argv: Optional[List[str]] = None) -> int:
    """The example script's entry point; returns the process exit code."""
    return run(parse(argv), PLUGINS)
