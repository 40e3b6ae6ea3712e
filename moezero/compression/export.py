"""The quantized inference file: packed integer weights with per-group scales, fp tensors for the rest.

    {"format": "moezero-quantized-v1",
     "description": ModelDescription.to_dict()       # GPT/MoE configs and dtype, nothing about training
     "quantization": {weight_bits, groups, symmetric, modules, activation_bits},
     "quantized": {name: {"codes": packed (R, .), "scale": fp32 (R,), ["zero_point": (R,)],
                          "shape": [...], "units": U}},   # experts: U = global experts, rows per expert
     "tensors": {name: tensor},                          # biases, norms, unquantized weights, buffers
     "source": {"checkpoint": path, "iteration": N}}

Each weight is quantized exactly as the fake-quant forward did in training (same rows, same
rounding to nearest, from the fp32 master rounded to the params' dtype), so the dequantized
model reproduces the QAT model's forward. Names are canonical (no parametrization wrapping).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from moezero.compression.config import QATConfig
from moezero.compression.packing import pack_rows, unpack_rows
from moezero.compression.quantizer import quantize_rows, to_rows
from moezero.compression.source import CheckpointModel
from moezero.compression.targets import check_groups_divide, quant_targets

FORMAT = "moezero-quantized-v1"
_SPEC_FIELDS = ("weight_bits", "groups", "symmetric", "modules", "activation_bits")


def spec_to_dict(spec: QATConfig) -> Dict[str, Any]:
    return {k: getattr(spec, k) for k in _SPEC_FIELDS}


def spec_from_dict(d: Dict[str, Any]) -> QATConfig:
    """The quantization of an exported file as a QATConfig fixed at its target bits."""
    return QATConfig(**{k: d[k] for k in _SPEC_FIELDS})


def quantize_tensor(w: torch.Tensor, units: int, spec: QATConfig) -> Dict[str, Any]:
    """One weight's entry of the "quantized" table (nearest rounding)."""
    rq = quantize_rows(to_rows(w, units, spec.groups), spec.weight_bits, spec.symmetric)
    entry = {
        "codes": pack_rows(rq.q_RN, spec.weight_bits, spec.symmetric),
        "scale": rq.scale_R.contiguous(),
        "shape": list(w.shape),
        "units": units,
    }
    if not spec.symmetric:
        entry["zero_point"] = rq.zero_point_R.to(torch.uint8 if spec.weight_bits <= 8 else torch.int32)
    return entry


def dequantize_entry(
    entry: Dict[str, Any], spec: QATConfig, first_unit: int = 0, num_units: Optional[int] = None
) -> torch.Tensor:
    """fp32 weights of units [first_unit, first_unit + num_units) (default: all), shaped like the tensor
    with dim 0 cut to those units when the tensor is a stack of experts."""
    units = entry["units"]
    num_units = units if num_units is None else num_units
    rows_per_unit = entry["codes"].shape[0] // units
    rows = slice(first_unit * rows_per_unit, (first_unit + num_units) * rows_per_unit)
    shape = list(entry["shape"])
    n = int(torch.Size(shape).numel()) // entry["codes"].shape[0]
    q = unpack_rows(entry["codes"][rows], spec.weight_bits, spec.symmetric, n).float()
    zero = entry["zero_point"][rows].float() if "zero_point" in entry else torch.zeros_like(entry["scale"][rows])
    w = (q - zero[:, None]) * entry["scale"][rows][:, None]
    if units > 1:
        shape[0] = num_units
    return w.view(shape)


def export_quantized(source: CheckpointModel, spec: QATConfig) -> Dict[str, Any]:
    """Quantize the weights of `spec.module_groups` of a checkpoint to `spec.weight_bits` bits.

    Raises ConfigError when the groups do not divide a tensor; ValueError when the checkpoint
    lacks a tensor the model has.
    """
    model = source.description.build()  # one rank, every expert: only to find names, dtypes, units
    targets = quant_targets(model, spec.module_groups)
    check_groups_divide(targets, spec.groups)
    by_name = {t.name: t for t in targets}
    quantized, tensors = {}, {}
    for name, ref in model.state_dict().items():
        if name not in source.state:
            raise ValueError(f"checkpoint {source.path} lacks '{name}' (a different model?)")
        value = source.state[name].to(ref.dtype)
        if name in by_name:
            quantized[name] = quantize_tensor(value, by_name[name].units, spec)
        else:
            tensors[name] = value.clone()
    return {
        "format": FORMAT,
        "description": source.description.to_dict(),
        "quantization": spec_to_dict(spec),
        "quantized": quantized,
        "tensors": tensors,
        "source": {"checkpoint": source.path, "iteration": source.iteration},
    }


def packed_bytes(exported: Dict[str, Any]) -> Dict[str, int]:
    """Bytes of the quantized weights (codes + scales + zero points) and of the fp tensors."""
    q = sum(
        t.numel() * t.element_size() for e in exported["quantized"].values() for k, t in e.items() if torch.is_tensor(t)
    )
    fp = sum(t.numel() * t.element_size() for t in exported["tensors"].values())
    return {"quantized": q, "fp": fp}
