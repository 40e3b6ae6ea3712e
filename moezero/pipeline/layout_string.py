"""Megatron's --pipeline-model-parallel-layout string: parsed into one list of layer kinds per stage, and checked
with the rules of megatron-core's PipelineParallelLayerLayout (re-implemented; megatron-core is a test oracle).

The string lists the stages in stage order (stage s = virtual stage s // pp of pipeline rank s % pp), split by
'|'; in a stage, 'E' is the word embedding, 't' a decoder layer, 'm' an MTP depth, 'L' the loss (output head).
'(..)*n' repeats a group, 'x*n' a character; commas are cosmetic. DeepSeek-V3's recipe (PP 8 x VPP 4):
"Et|(tt|)*30mL" -> [E t] [t t] x 30 [m L].
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Tuple

from moezero.config.options import ConfigError

FLAG = "--pipeline-model-parallel-layout"
KINDS = "EtmL"  # embedding, decoder layer, MTP depth, loss
# megatron-core's parse_str_to_list (pipeline_parallel_layer_layout.py:283): groups first, then single characters,
# each pass once over the string, so nested groups are not unrolled (and fail as unknown characters)
_REPEATS = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))


@dataclass(frozen=True)
class StageKinds:
    """One stage of a layout: its layer kinds in order ("Ett", "", "mL")."""

    kinds: str

    def count(self, kind: str) -> int:
        return self.kinds.count(kind)


def parse_layout(layout: str) -> Tuple[StageKinds, ...]:
    """The stages of a layout string, in stage order; a character outside E, t, m, L raises one line."""
    text = layout.replace(",", "")
    for pattern in _REPEATS:
        text = pattern.sub(lambda match: match.group(1) * int(match.group(2)), text)
    stages = tuple(StageKinds(stage) for stage in text.split("|"))
    for stage in stages:
        unknown = sorted(set(stage.kinds) - set(KINDS))
        if unknown:
            raise ConfigError(
                f"{FLAG}={layout!r}: unknown layer character {unknown[0]!r} in stage {stage.kinds!r} "
                "(E embedding, t decoder layer, m MTP depth, L loss; '|' between stages, "
                "'(..)*n' and 'x*n' repeat)"
            )
    return stages


def check_layout(
    layout: str, stages: Tuple[StageKinds, ...], pipeline_parallel_size: int, num_layers: int, mtp_num_layers: int
) -> None:
    """megatron-core's rules for a layout (PipelineParallelLayerLayout.__init__ and validate_layer_layout,
    pipeline_parallel_layer_layout.py:85), each refused in one line naming the flags."""
    pp = pipeline_parallel_size
    if len(stages) % pp:
        # also Megatron-LM's validate_args (megatron/training/arguments.py:520 at core_v0.16.1)
        raise ConfigError(
            f"{FLAG}={layout!r}: its {len(stages)} stages must be divisible by "
            f"--pipeline-model-parallel-size ({pp}) (each rank holds len/pp virtual stages)"
        )
    flat = "".join(stage.kinds for stage in stages)
    if not flat.startswith("E") or flat.count("E") != 1:
        raise ConfigError(f"{FLAG}={layout!r}: the embedding 'E' must come first and exactly once")
    if not flat.endswith("L") or flat.count("L") != 1:
        raise ConfigError(f"{FLAG}={layout!r}: the loss 'L' must come last and exactly once")
    if flat.count("t") != num_layers:
        raise ConfigError(
            f"{FLAG}={layout!r}: it holds {flat.count('t')} decoder layers ('t'), --num-layers is {num_layers}"
        )
    if flat.count("m") != mtp_num_layers:
        raise ConfigError(
            f"{FLAG}={layout!r}: it holds {flat.count('m')} MTP depths ('m'), "
            f"--mtp-num-layers is {mtp_num_layers or None}"
        )
    if "m" in flat and "t" in flat[flat.index("m") :]:
        raise ConfigError(f"{FLAG}={layout!r}: every decoder layer 't' must come before the MTP depths 'm'")
    virtual = len(stages) // pp
    for index, stage in enumerate(stages):
        if stage.count("m") and index // pp != virtual - 1:
            raise ConfigError(
                f"{FLAG}={layout!r}: the MTP depths must be in their rank's last virtual stage "
                f"(stage {index} is virtual stage {index // pp} of {virtual} on rank {index % pp})"
            )
        if stage.count("m") and stage.count("m") != mtp_num_layers:
            raise ConfigError(
                f"{FLAG}={layout!r}: all {mtp_num_layers} MTP depths must be in one stage "
                f"(stage {index} holds {stage.count('m')})"
            )
