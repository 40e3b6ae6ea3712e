"""Quantization-aware training (MoQ-style fake quantization under ZeRO) and quantized export.

from moezero.compression import QATConfig, apply_qat
qat = apply_qat(model, QATConfig(weight_bits=4, groups=64), groups, seed)   # before the optimizer
"""

from moezero.compression.config import MODULE_GROUPS, QATConfig
from moezero.compression.qat import PLUGIN_NAME, QATController, apply_qat

__all__ = ["MODULE_GROUPS", "PLUGIN_NAME", "QATConfig", "QATController", "apply_qat"]
