"""Load models for inference on any number of ranks and any ep: the quantized export, or a checkpoint.

    groups = ParallelGroups.build(expert_parallel_size=ep)   # after init_process_group; or a world of one
    model, spec = load_quantized_model("model.mzq", groups)    # dequantized weights, this rank's experts
    logits, _ = model(tokens)

Only the model description is read: no batch sizes, world size or training schedule is looked at,
so any world size whose ep divides the experts works. Each rank unpacks only its local experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from moezero.compression.config import QATConfig
from moezero.compression.description import ModelDescription
from moezero.compression.export import FORMAT, dequantize_entry, spec_from_dict
from moezero.compression.fake_quant import QATState
from moezero.compression.qat import add_activation_quant, apply_qat
from moezero.compression.source import CheckpointModel
from moezero.compression.targets import quant_targets
from moezero.config import ConfigError, check_experts_divide
from moezero.models import GPTModel
from moezero.parallel import ParallelGroups, expert_shard_of


def read_exported(path: str) -> Dict[str, Any]:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except Exception as exc:  # torch.load's unpickling errors have no common base class
        raise ConfigError(f"{path}: not a moezero quantized model ({type(exc).__name__})") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise ConfigError(f"{path}: not a moezero quantized model (expected format {FORMAT})")
    return blob


def _check_ep(description: ModelDescription, groups: ParallelGroups) -> None:
    check_experts_divide((description.moe or {}).get("num_experts", 1), groups.ep_size)


def _expert_shards(model: nn.Module) -> Dict[str, Any]:
    return {name: expert_shard_of(p) for name, p in model.named_parameters()}


def _local(tensor: torch.Tensor, shard) -> torch.Tensor:
    """This rank's experts of a globally stacked tensor (the tensor itself when not an expert stack)."""
    if shard is None:
        return tensor
    return tensor[shard.first_global_expert : shard.first_global_expert + shard.num_local_experts]


def load_quantized_model(source: Any, groups: Optional[ParallelGroups] = None) -> Tuple[GPTModel, QATConfig]:
    """The exported model (a path or the dict `export_quantized` made), dequantized, in eval mode.

    Returns the model and its quantization (a QATConfig fixed at the exported bits).
    """
    blob = read_exported(source) if isinstance(source, str) else source
    groups = groups or ParallelGroups.single()
    description = ModelDescription.from_dict(blob["description"])
    spec = spec_from_dict(blob["quantization"])
    _check_ep(description, groups)
    model = description.build(groups)
    shards = _expert_shards(model)
    local = {}
    for name, ref in model.state_dict().items():
        shard = shards.get(name)
        if name in blob["quantized"]:
            first = shard.first_global_expert if shard is not None else 0
            units = shard.num_local_experts if shard is not None else None
            value = dequantize_entry(blob["quantized"][name], spec, first, units)
        elif name in blob["tensors"]:
            value = _local(blob["tensors"][name], shard)
        else:
            raise ConfigError(f"the quantized model lacks '{name}' (exported from a different model?)")
        local[name] = value.to(ref.dtype)
    model.load_state_dict(local)
    if spec.activation_bits is not None:
        # the QAT forward quantized these activations too; inference must do the same
        add_activation_quant(
            quant_targets(model, spec.module_groups), spec.activation_bits, QATState(bits=spec.weight_bits)
        )
    return model.eval(), spec


def load_checkpoint_weights(
    source: CheckpointModel, groups: Optional[ParallelGroups] = None, fake_quant: Optional[QATConfig] = None
) -> GPTModel:
    """The checkpoint's fp model (the fp32 masters in the params' dtype), in eval mode; with
    `fake_quant`, fake-quantized at `fake_quant.weight_bits` exactly as the QAT forward does."""
    groups = groups or ParallelGroups.single()
    _check_ep(source.description, groups)
    model = source.description.build(groups)
    known = set(model.state_dict()) | {name for name, _ in model.named_buffers()}  # an old import's buffers too
    unused = sorted(set(source.state) - known)
    if unused:  # weights this model has no place for: another model than the one trained
        raise ConfigError(
            f"{source.path}: holds weights this model has no place for ({', '.join(unused[:3])}"
            f"{', ...' if len(unused) > 3 else ''}); it was saved by a moezero that built this model "
            "otherwise"
        )
    shards = _expert_shards(model)
    local = {
        name: _local(source.state[name], shards.get(name)).to(ref.dtype) for name, ref in model.state_dict().items()
    }
    model.load_state_dict(local)
    if fake_quant is not None:  # fixed at the target bits: no offset, no start bits
        apply_qat(model, dataclasses.replace(fake_quant, start_bits=None, schedule_offset=0), groups)
    return model.eval()
