"""What an inference process needs to rebuild a GPT-MoE model: its GPT and MoE configs and dtype.

Deliberately nothing else: no batch sizes, no world size, no optimizer or schedule settings, so
loading a model never validates (or fails on) how it was trained - the field failure was an
inference init that checked "train batch 8 // micro 4 // world 4" and found 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from moezero.config import GPTConfig, MoEConfig, upgrade_stored_configs
from moezero.models import GPTModel
from moezero.moe import expert_parallel
from moezero.parallel import ParallelGroups

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass(frozen=True)
class ModelDescription:
    """GPT and MoE configs (vocab size filled in) and the dtype of the model's parameters."""

    model: Dict[str, Any]
    moe: Optional[Dict[str, Any]]
    dtype: str = "float32"

    @classmethod
    def from_configs(cls, gpt: GPTConfig, moe: Optional[MoEConfig], dtype: torch.dtype) -> "ModelDescription":
        name = next(k for k, v in DTYPES.items() if v == dtype)
        return cls(dataclasses.asdict(gpt), dataclasses.asdict(moe) if moe is not None else None, name)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ModelDescription":
        configs = upgrade_stored_configs({"model": d["model"], "moe": d.get("moe")})
        return cls(
            dict(configs["model"]), dict(configs["moe"]) if configs.get("moe") else None, d.get("dtype", "float32")
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(**self.model)

    def moe_config(self) -> Optional[MoEConfig]:
        return MoEConfig(**self.moe) if self.moe is not None else None

    def build(self, groups: Optional[ParallelGroups] = None) -> GPTModel:
        """The model with this rank's experts (weights still from the init; load them next)."""
        model = GPTModel(
            self.gpt_config(), self.moe_config(), moe_layer=expert_parallel(groups or ParallelGroups.single())
        )
        return model.to(self.torch_dtype)
