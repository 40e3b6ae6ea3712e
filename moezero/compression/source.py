"""A training checkpoint as a model: consolidated weights under canonical names, plus its description.

Reads through `moezero.checkpoint` (fp32 masters, experts stacked over the global experts; the configs
the run stored in its train state). Works on one process without a process group; under torchrun
each rank may call it independently.

A consolidated file (`consolidated_file`, what tools/consolidate_checkpoint.py writes) holds the same:
the weights and the run's configs, so it rebuilds the model with no flag re-typed.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

from moezero import checkpoint
from moezero.checkpoint import CheckpointError
from moezero.compression.config import QATConfig
from moezero.compression.bits_schedule import bits_at
from moezero.compression.description import ModelDescription
from moezero.compression.qat import PLUGIN_NAME
from moezero.compression.targets import canonical_name
from moezero.config import GPTConfig, MoEConfig, upgrade_stored_configs

CONSOLIDATED_FORMAT = "moezero-consolidated-v1"


@dataclass(frozen=True)
class CheckpointModel:
    """Weights of a checkpoint (canonical names, fp32 masters) and what describes the model."""

    path: str
    state: Dict[str, torch.Tensor]
    description: ModelDescription
    qat: Optional[QATConfig]  # the run's QAT settings (None: trained without QAT)
    qat_step: Optional[int]  # where its bit schedule stood
    iteration: int
    configs: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # every section the run stored

    def qat_forward(self) -> Optional[QATConfig]:
        """The QAT settings of the run's next forward where its bit schedule stood (its bits then: the start
        bits or one of the drops towards the target); None without QAT or before --qat-schedule-offset (full
        precision)."""
        if self.qat is None or self.qat_step is None:  # no recorded step: the target bits, as before
            return self.qat
        c = self.qat
        bits = bits_at(self.qat_step, c.first_bits, c.weight_bits, c.bits_period, c.schedule_offset)
        return None if bits is None else dataclasses.replace(c, weight_bits=bits)


def load_checkpoint_model(path: str) -> CheckpointModel:
    """Consolidate checkpoint `path` (an iter folder or a --save root) for export or evaluation; or read
    a consolidated file."""
    if os.path.isfile(path):
        return _read_consolidated(path)
    path = checkpoint.resolve_checkpoint(path)
    train_state = checkpoint.read_train_state(path)
    state = {canonical_name(k): v for k, v in checkpoint.consolidate_checkpoint(path).items()}
    qat_state = train_state["plugins"].get(PLUGIN_NAME) or {}
    return _checkpoint_model(path, state, train_state["configs"], qat_state.get("step"), int(train_state["iteration"]))


def _checkpoint_model(
    path: str, state: Dict[str, torch.Tensor], configs: Dict[str, Any], qat_step: Optional[int], iteration: int
) -> CheckpointModel:
    configs = upgrade_stored_configs(configs)
    vocab = state["embedding.weight"].shape[0]
    gpt = GPTConfig(**dict(configs["model"], vocab_size=vocab))
    moe = MoEConfig(**configs["moe"]) if (configs.get("moe") or {}).get("num_experts") else None
    train = configs.get("train", {})
    # the params' dtype only (fake quantization saw the masters rounded to it); no batch settings are read
    dtype = (
        torch.bfloat16
        if train.get("bf16")
        else torch.float16
        if train.get("fp16")
        else torch.float64
        if train.get("fp64")
        else torch.float32
    )
    qat_cfg = QATConfig(**configs["qat"]) if configs.get("qat") and configs["qat"].get("weight_bits") else None
    return CheckpointModel(
        path, state, ModelDescription.from_configs(gpt, moe, dtype), qat_cfg, qat_step, iteration, configs
    )


def consolidated_file(source: CheckpointModel) -> Dict[str, Any]:
    """What tools/consolidate_checkpoint.py saves: {"format", "model": {name: tensor} (loads into a GPTModel
    built with ep = 1), "configs": the run's sections, "iteration", "qat_step"}."""
    return {
        "format": CONSOLIDATED_FORMAT,
        "model": source.state,
        "configs": source.configs,
        "iteration": source.iteration,
        "qat_step": source.qat_step,
    }


def _read_consolidated(path: str) -> CheckpointModel:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged or foreign file raises whatever its bytes decode to
        raise CheckpointError(f"{path}: not a readable consolidated checkpoint ({type(exc).__name__})") from None
    if not isinstance(blob, dict) or blob.get("format") != CONSOLIDATED_FORMAT:
        raise CheckpointError(
            f"{path}: not a consolidated moezero checkpoint with its configs (one written before "
            "they were stored? consolidate again with tools/consolidate_checkpoint.py)"
        )
    return _checkpoint_model(path, blob["model"], blob["configs"], blob.get("qat_step"), int(blob["iteration"]))
