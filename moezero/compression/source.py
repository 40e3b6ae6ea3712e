"""A training checkpoint as a model: consolidated weights under canonical names, plus its description.

Reads through `moezero.checkpoint` (fp32 masters, experts stacked over the global experts; the configs
the run stored in its train state). Works on one process without a process group; under torchrun
each rank may call it independently.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from moezero import checkpoint
from moezero.compression.config import QATConfig
from moezero.compression.description import ModelDescription
from moezero.compression.qat import PLUGIN_NAME
from moezero.compression.targets import canonical_name
from moezero.config import GPTConfig, MoEConfig


@dataclass(frozen=True)
class CheckpointModel:
    """Weights of a checkpoint (canonical names, fp32 masters) and what describes the model."""

    path: str
    state: Dict[str, torch.Tensor]
    description: ModelDescription
    qat: Optional[QATConfig]        # the run's QAT settings (None: trained without QAT)
    qat_step: Optional[int]         # where its bit schedule stood
    iteration: int


def load_checkpoint_model(path: str) -> CheckpointModel:
    """Consolidate checkpoint `path` (an iter folder or a --save root) for export or evaluation."""
    path = checkpoint.resolve_checkpoint(path)
    train_state = checkpoint.read_train_state(path)
    configs = train_state["configs"]
    state = {canonical_name(k): v for k, v in checkpoint.consolidate_checkpoint(path).items()}
    vocab = state["embedding.weight"].shape[0]
    gpt = GPTConfig(**dict(configs["model"], vocab_size=vocab))
    moe = MoEConfig(**configs["moe"]) if configs.get("moe") else None
    train = configs.get("train", {})
    # the params' dtype only (fake quantization saw the masters rounded to it); no batch settings are read
    dtype = torch.bfloat16 if train.get("bf16") else torch.float16 if train.get("fp16") else torch.float32
    qat_cfg = QATConfig(**configs["qat"]) if configs.get("qat") and configs["qat"].get("weight_bits") else None
    qat_state = train_state["plugins"].get(PLUGIN_NAME) or {}
    return CheckpointModel(path, state, ModelDescription.from_configs(gpt, moe, dtype), qat_cfg,
                           qat_state.get("step"), int(train_state["iteration"]))
