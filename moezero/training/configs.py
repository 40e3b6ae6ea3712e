"""The configs of a pretraining run and the checks across them.

Each section is a config dataclass of `moezero.config` whose fields declare their flags; a recipe
that plugs more features in extends `Configs` with their sections (see `moezero.recipe`).
"""
from __future__ import annotations

from dataclasses import dataclass

from moezero.config import (ConfigError, DataConfig, GPTConfig, MoEConfig, ParallelConfig, TrainConfig, ZeroConfig,
                            check_experts_divide)
from moezero.data import num_micro_steps
from moezero.parallel import rank_layout

CONFIG_CLASSES = (ParallelConfig, GPTConfig, MoEConfig, ZeroConfig, TrainConfig, DataConfig)
DESCRIPTION = "Pretrain a GPT Mixture-of-Experts model with ZeRO and expert parallelism (Megatron flag names)."


@dataclass
class Configs:
    parallel: ParallelConfig
    model: GPTConfig
    moe: MoEConfig
    zero: ZeroConfig
    train: TrainConfig
    data: DataConfig


def validate(cfg: Configs, world_size: int) -> int:
    """Checks across configs; returns micro-steps per optimizer step. Raises ConfigError naming the flags."""
    ep = cfg.parallel.expert_parallel_size
    try:
        rank_layout(world_size, ep)
    except ValueError:
        raise ConfigError(f"--expert-model-parallel-size={ep}: must divide the number of processes ({world_size})")
    check_experts_divide(cfg.moe.num_experts, ep)
    if cfg.model.moe_layer_freq > cfg.model.num_layers:
        raise ConfigError(f"--moe-layer-freq={cfg.model.moe_layer_freq}: larger than --num-layers "
                          f"({cfg.model.num_layers}) is fine in Megatron's pattern only if >= 1 layer is MoE; "
                          "layer 0 always is, so use a value <= --num-layers")
    if cfg.train.eval_interval > 0 and cfg.data.split_weights[1] == 0:
        raise ConfigError(f"--eval-interval={cfg.train.eval_interval}: needs a validation split, but --split="
                          f"{cfg.data.split} gives it weight 0 (use --eval-interval 0 or a split like 969,30,1)")
    return num_micro_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
