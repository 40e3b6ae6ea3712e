"""QATConfig: quantization-aware training settings (the `--qat-*` flags), checked up front.

The flags follow DeepSpeed MoQ's knobs (start bits, target bits, a period after which one bit is
dropped, a schedule offset, groups per tensor, symmetric or asymmetric, nearest or stochastic
rounding), with moezero's module groups. `--qat-weight-bits` unset means QAT is off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

from moezero.config import Validated, option

# The module groups QAT can quantize; each names a set of weight matrices of the GPT model.
MODULE_GROUPS = ("attention", "mlp", "experts", "shared_expert", "router", "embedding", "output")
# the groups whose modules are called with their input, which --qat-activation-bits quantizes (the output
# layer, router and embedding are not: the flag does nothing for them)
ACTIVATION_GROUPS = ("attention", "mlp", "shared_expert", "experts")
MIN_BITS, MAX_BITS = 2, 16


@dataclass
class QATConfig(Validated):
    """Quantization-aware training (fake-quantized weights in forward, fp32 masters in the optimizer)."""

    section = "qat"
    weight_bits: Optional[int] = option(
        None, "target bits of the quantized weights (unset = QAT off)", flag="--qat-weight-bits"
    )
    start_bits: Optional[int] = option(
        None,
        "bits when quantization starts; one bit is dropped every "
        "--qat-bits-period steps until --qat-weight-bits (default: the target)",
        flag="--qat-start-bits",
    )
    bits_period: int = option(50, "optimizer steps between two one-bit drops of the schedule", flag="--qat-bits-period")
    schedule_offset: int = option(
        0, "optimizer steps trained in full precision before quantization starts", flag="--qat-schedule-offset"
    )
    groups: int = option(
        1,
        "quantization groups per weight tensor (per global expert for expert weights); each group has its own scale",
        flag="--qat-groups",
    )
    symmetric: bool = option(
        True, "symmetric (scale only) or asymmetric (scale and zero point) quantization", flag="--qat-symmetric"
    )
    rounding: str = option(
        "nearest",
        "rounding of the fake-quantized weights in training (eval and export always round to nearest)",
        flag="--qat-rounding",
        choices=("nearest", "stochastic"),
    )
    modules: str = option(
        "attention,mlp,experts",
        "comma list of module groups to quantize, from " + ",".join(MODULE_GROUPS),
        flag="--qat-modules",
    )
    activation_bits: Optional[int] = option(
        None,
        "also fake-quantize the inputs of the quantized linear layers "
        "and experts (per token, symmetric) to this many bits",
        flag="--qat-activation-bits",
    )

    def __post_init__(self):
        self._check_all_choices()
        for name in ("weight_bits", "start_bits", "activation_bits"):
            value = getattr(self, name)
            if value is not None:
                self._require(MIN_BITS <= value <= MAX_BITS, name, f"must be between {MIN_BITS} and {MAX_BITS}")
        if self.weight_bits is None:  # QAT off: a --qat-* flag given would do nothing
            for f in dataclasses.fields(self):
                if f.name != "weight_bits" and getattr(self, f.name) != f.default:
                    self._fail(f.name, "needs --qat-weight-bits (QAT is off without it)")
        elif self.start_bits is not None:
            self._require(
                self.start_bits >= self.weight_bits,
                "start_bits",
                f"must be >= --qat-weight-bits ({self.weight_bits}); the schedule only lowers bits",
            )
        self._require(self.bits_period >= 1, "bits_period", "must be >= 1")
        self._require(self.schedule_offset >= 0, "schedule_offset", "must be >= 0")
        self._require(self.groups >= 1, "groups", "must be >= 1")
        names = [m.strip() for m in self.modules.split(",") if m.strip()]
        if self.activation_bits is not None:
            self._require(
                any(n in ACTIVATION_GROUPS for n in names),
                "activation_bits",
                f"quantizes the inputs of {', '.join(ACTIVATION_GROUPS)}; --qat-modules={self.modules} "
                "names none of them",
            )
        self._require(bool(names), "modules", f"must name at least one of {', '.join(MODULE_GROUPS)}")
        unknown = [m for m in names if m not in MODULE_GROUPS]
        self._require(
            not unknown, "modules", f"unknown module group(s) {', '.join(unknown)}; allowed: {', '.join(MODULE_GROUPS)}"
        )

    @property
    def enabled(self) -> bool:
        return self.weight_bits is not None

    @property
    def module_groups(self) -> Tuple[str, ...]:
        """The selected groups, in MODULE_GROUPS order, without duplicates."""
        names = {m.strip() for m in self.modules.split(",")}
        return tuple(m for m in MODULE_GROUPS if m in names)

    @property
    def first_bits(self) -> Optional[int]:
        return self.start_bits if self.start_bits is not None else self.weight_bits
