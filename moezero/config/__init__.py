"""Configuration dataclasses of the model, the MoE layers, the parallel layout, ZeRO and the data.

(The sections only a training run has, TrainConfig and CheckpointConfig, are in
`moezero.training.configs`; QAT's is in `moezero.compression.config`.)

Each field declares its command-line flag once, in its metadata (`option(...)`), with a
one-line help that doubles as the field's documentation. `moezero.training.args` builds
the argparse parser from these declarations: the argparse dest of a field is
"<section>.<field name>", so a parsed namespace turns into configs with no renaming.

Validation lives in `__post_init__` and raises `ConfigError` naming the offending flag,
its value and what is allowed.
"""

from moezero.config.moe import MoEConfig
from moezero.config.model import (
    GPTConfig,
    expert_ffn_size,
    is_moe_layer,
    is_window_layer,
    moe_layer_config,
    moe_layer_pattern,
    upgrade_stored_configs,
)
from moezero.config.options import ConfigError, Validated, check_experts_divide, flag_of, model_defining_fields, option
from moezero.config.run import (
    FSDP_STAGES,
    TOKENIZER_FIELDS,
    DataConfig,
    ParallelConfig,
    ZeroConfig,
    run_tokenizer_fields,
)

__all__ = [
    "ConfigError",
    "DataConfig",
    "FSDP_STAGES",
    "TOKENIZER_FIELDS",
    "GPTConfig",
    "MoEConfig",
    "ParallelConfig",
    "Validated",
    "ZeroConfig",
    "check_experts_divide",
    "expert_ffn_size",
    "flag_of",
    "is_moe_layer",
    "is_window_layer",
    "model_defining_fields",
    "moe_layer_config",
    "moe_layer_pattern",
    "option",
    "run_tokenizer_fields",
    "upgrade_stored_configs",
]
