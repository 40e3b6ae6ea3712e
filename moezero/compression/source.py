"""A training checkpoint as a model: consolidated weights under canonical names, plus its description.

Uses `moezero.training.checkpoint.consolidate_checkpoint` (fp32 masters, experts stacked over the
global experts) and the configs the run stored in its train state. Works on one process without a
process group; under torchrun each rank may call it independently.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from moezero.compression.config import QATConfig
from moezero.compression.description import ModelDescription
from moezero.compression.targets import canonical_name
from moezero.config import ConfigError, GPTConfig, MoEConfig
from moezero.training import checkpoint


@dataclass(frozen=True)
class CheckpointModel:
    """Weights of a checkpoint (canonical names, fp32 masters) and what describes the model."""

    path: str
    state: Dict[str, torch.Tensor]
    description: ModelDescription
    qat: Optional[QATConfig]        # the run's QAT settings (None: trained without QAT)
    qat_step: Optional[int]         # where its bit schedule stood
    iteration: int


def resolve_checkpoint(path: str) -> str:
    """An `iter_N` folder, or a --save root whose pointer file names the latest one."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    iteration = checkpoint.latest_iteration(path) if os.path.isdir(path) else None
    if iteration is None:
        raise ConfigError(f"--load={path}: not a checkpoint (no .metadata) and no {checkpoint.POINTER} in it")
    return checkpoint.iteration_dir(path, iteration)


@contextlib.contextmanager
def _quiet():
    """DCP warns that it reads "in a single process" without a process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_train_state(path: str) -> Dict[str, Any]:
    """The train state a run saved in checkpoint `path` (iteration, configs, qat, ...)."""
    request: Dict[str, Any] = {"train_state": b""}
    with _quiet():
        dcp.load(request, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    blob = request["train_state"]
    return pickle.loads(blob) if isinstance(blob, (bytes, bytearray)) else blob


def load_checkpoint_model(path: str) -> CheckpointModel:
    """Consolidate checkpoint `path` (an iter folder or a --save root) for export or evaluation."""
    path = resolve_checkpoint(path)
    train_state = read_train_state(path)
    configs = train_state["configs"]
    with _quiet():
        state = {canonical_name(k): v for k, v in checkpoint.consolidate_checkpoint(path).items()}
    vocab = state["embedding.weight"].shape[0]
    gpt = GPTConfig(**dict(configs["model"], vocab_size=vocab))
    moe = MoEConfig(**configs["moe"]) if configs.get("moe") else None
    train = configs.get("train", {})
    # the params' dtype only (fake quantization saw the masters rounded to it); no batch settings are read
    dtype = torch.bfloat16 if train.get("bf16") else torch.float16 if train.get("fp16") else torch.float32
    qat_cfg = QATConfig(**configs["qat"]) if configs.get("qat") and configs["qat"].get("weight_bits") else None
    qat_state = train_state.get("qat") or {}
    return CheckpointModel(path, state, ModelDescription.from_configs(gpt, moe, dtype), qat_cfg,
                           qat_state.get("step"), int(train_state["iteration"]))
