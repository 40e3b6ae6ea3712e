"""What a benchmark's figures ran on: the CPU's model name and its bf16 units (read from /proc/cpuinfo)."""

import os
import platform
from typing import List


def _cpuinfo_field(name: str) -> str:
    """The first value of `name` in /proc/cpuinfo ('' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == name), "")
    except OSError:
        return ""


def cpu_model() -> str:
    """The model name, with its family and model numbers (a VM's name can be as bare as "AMD EPYC")."""
    name = _cpuinfo_field("model name") or platform.processor() or "unknown CPU"
    family, model = _cpuinfo_field("cpu family"), _cpuinfo_field("model")
    return f"{name} (family {family} model {model})" if family and model else name


def bf16_units() -> List[str]:
    """The units that run bf16 GEMMs natively here (AVX-512 BF16, AMX); empty: bf16 is emulated."""
    flags = _cpuinfo_field("flags").split()
    return [name for name in ("avx512_bf16", "amx_bf16") if name in flags]


def describe() -> str:
    """One line naming the machine, printed above every benchmark's tables."""
    import torch

    return (
        f"{cpu_model()}, {os.cpu_count()} cores, bf16 units: {', '.join(bf16_units()) or 'none'}, "
        f"torch {torch.__version__}"
    )
