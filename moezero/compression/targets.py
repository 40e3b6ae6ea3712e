"""Which weights of a GPT-MoE model each QAT module group covers, and their canonical names.

    attention      attention.qkv, attention.proj; with MLA its q/kv    (nn.Linear weights)
                   down/up projections and proj
    mlp            fc1, fc2 of the dense MLP layers                  (nn.Linear weights)
    experts        experts.w1, experts.w2 of the MoE layers          (stacked local experts)
    shared_expert  shared_expert.fc1, shared_expert.fc2              (nn.Linear weights)
    router         router.wg                                         (the gate)
    embedding      the token and learned position embedding tables   (with tied weights this is
                                                                      also the output layer's weight; at pp > 1
                                                                      the last stage's copy too, apply_qat)
    output         the untied output layer

Biases and norm weights are never quantized. A canonical name is the parameter's name without
torch's parametrization wrapping ("qkv.parametrizations.weight.original" -> "qkv.weight"): it keys
stochastic rounding, the quantization-error scalars and the exported file, whether or not the
model carries the fake-quant parametrizations.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence

from torch import nn

from moezero.config import ConfigError
from moezero.models.attention import CausalSelfAttention
from moezero.models.gpt import GPTModel, TransformerLayer
from moezero.models.mla import MultiLatentAttention
from moezero.moe import MoELayer
from moezero.moe.experts import DenseMLP
from moezero.pipeline.stage_model import StageModel
from moezero.parallel.expert_marker import ExpertShard, expert_shard_of
from moezero.parallel.tensor_marker import TensorShard, tensor_shard_of

_PARAMETRIZED = re.compile(r"(^|\.)parametrizations\.([^.]+)\.original$")


def canonical_name(name: str) -> str:
    """A parameter's name with the `parametrizations.<attr>.original` wrapping undone."""
    return _PARAMETRIZED.sub(r"\1\2", name)


@dataclass(frozen=True)
class QuantTarget:
    """One quantized weight: `module.<attr>`, in module group `group`."""

    group: str
    name: str  # canonical name, e.g. "layers.0.mlp.experts.w1"
    module: nn.Module
    attr: str
    shard: Optional[ExpertShard]  # set for stacked routed-expert weights

    @property
    def units(self) -> int:
        """Quantization units: each local expert of a stacked expert tensor, else the whole tensor."""
        return self.shard.num_local_experts if self.shard is not None else 1

    @property
    def tensor_shard(self) -> Optional[TensorShard]:
        """The weight's tensor-parallel shard (over tp; an expert stack's over etp), None when whole here."""
        return tensor_shard_of(self.parameter())

    def numel(self) -> int:
        """Elements of the weight (the rank's experts of an expert stack) whole, over its tensor-parallel shards."""
        shard = self.tensor_shard
        return self.parameter().numel() if shard is None else math.prod(shard.global_shape)

    def parameter(self) -> nn.Parameter:
        """The trainable Parameter itself (under a parametrization: its `original`)."""
        if hasattr(self.module, "parametrizations") and self.attr in self.module.parametrizations:
            return self.module.parametrizations[self.attr].original
        return getattr(self.module, self.attr)


def _candidates(model: nn.Module):
    """(group, module qualified name, module, attr) of every quantizable weight in the model."""
    for qual, m in model.named_modules():
        prefix = qual + "." if qual else ""
        if isinstance(m, CausalSelfAttention):
            yield "attention", prefix + "qkv", m.qkv, "weight"
            yield "attention", prefix + "proj", m.proj, "weight"
        elif isinstance(m, MultiLatentAttention):
            for name, linear in m.projections():
                yield "attention", prefix + name, linear, "weight"
        elif isinstance(m, TransformerLayer) and isinstance(m.mlp, DenseMLP):
            yield "mlp", prefix + "mlp.fc1", m.mlp.fc1, "weight"
            yield "mlp", prefix + "mlp.fc2", m.mlp.fc2, "weight"
        elif isinstance(m, MoELayer):
            yield "experts", prefix + "experts", m.experts, "w1"
            yield "experts", prefix + "experts", m.experts, "w2"
            yield "router", prefix + "router.wg", m.router.wg, "weight"
            if m.shared_expert is not None:
                yield "shared_expert", prefix + "shared_expert.fc1", m.shared_expert.fc1, "weight"
                yield "shared_expert", prefix + "shared_expert.fc2", m.shared_expert.fc2, "weight"
        elif isinstance(m, (GPTModel, StageModel)):  # a pipeline stage holds what of these is on its stages
            if m.embedding is not None:
                yield "embedding", prefix + "embedding", m.embedding, "weight"
            if m.position_embedding is not None:
                yield "embedding", prefix + "position_embedding", m.position_embedding, "weight"
            if m.output is not None:
                yield "output", prefix + "output", m.output, "weight"


def quant_targets(model: nn.Module, module_groups: Sequence[str]) -> List[QuantTarget]:
    """The weights of `model` in the selected module groups, in model order.

    Raises ConfigError when "output" is selected but the output layer is tied to the embedding
    (one tensor cannot be quantized for one use and not the other).
    """
    if (
        "output" in module_groups
        and "embedding" not in module_groups
        and any(
            isinstance(m, (GPTModel, StageModel)) and not m.config.untie_embeddings_and_output_weights
            for m in model.modules()
        )
    ):
        raise ConfigError(
            "--qat-modules=output: the output layer shares its weight with the embedding "
            "(tied); select embedding too, or use --untie-embeddings-and-output-weights"
        )
    targets = []
    for group, qual, module, attr in _candidates(model):
        if group in module_groups:
            param = getattr(module, attr)
            targets.append(QuantTarget(group, f"{qual}.{attr}", module, attr, expert_shard_of(param)))
    return targets


def check_groups_divide(targets: Sequence[QuantTarget], groups: int) -> None:
    """Every unit (tensor, or expert) of every target must split into `groups` equal groups."""
    for t in targets:
        numel = t.numel() // t.units
        if numel % groups:
            unit = " per expert" if t.shard is not None else ""
            raise ConfigError(
                f"--qat-groups={groups}: does not divide {t.name} ({numel} elements{unit}); "
                "use a divisor of every quantized tensor's size"
            )
