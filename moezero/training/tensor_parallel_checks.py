"""Megatron's rules for a run at --tensor-model-parallel-size > 1, and what moezero does not run there yet (pure: one
line each, naming the flags).

What runs at tp > 1 (training/tensor_parallel.py): pipeline and context-parallel size 1, any ZeRO stage, dense GPTs
(MHA/GQA, RoPE or learned positions, per-head q/k norms, sinks, windows, keyed dropout, untied or tied output, MTP)
with or without --sequence-parallel, and MoE layers with it (expert parallelism folded over the same ranks,
expert-tensor-parallel size 1); checkpoints at global coordinates (a tp's resumes at any other).
"""

from __future__ import annotations

import dataclasses
from typing import List

from moezero.config import ConfigError
from moezero.training.tensor_parallel import refusals

TP = "--tensor-model-parallel-size"


def tensor_parallel_refusals(cfg, world_size: int) -> List[str]:
    """At tp > 1, a line for each flag or value of the run that tensor parallelism does not run (none at tp 1)."""
    p = cfg.parallel
    tp = p.tensor_parallel_size
    if tp == 1:
        return []
    problems = []  # with pipeline or context parallelism: refused by ParallelConfig
    if world_size % tp:
        problems.append(f"{TP}={tp}: must divide the number of processes ({world_size})")
    moe = cfg.moe if cfg.moe.num_experts is not None else None
    if moe is not None and p.expert_tensor_parallel_size != 1:
        given = p.expert_tensor_parallel_size
        problems.append(
            f"--expert-tensor-parallel-size={tp if given is None else given}"
            f"{' (Megatron default: ' + TP + ')' if given is None else ''}: only 1 runs here, pass "
            "--expert-tensor-parallel-size 1 (the experts split over --expert-model-parallel-size instead)"
        )
    if cfg.checkpoint.save_hf:  # (--load-hf runs: each rank reads its slices, moezero/hf/shard_reads.py)
        problems.append(
            f"--save-hf: not supported with {TP} > 1 yet ({TP}={tp}): save the run's checkpoint (--save; it holds "
            "global coordinates) and write the Hub folder with `tools/hf_checkpoint.py export CHECKPOINT_DIR HF_DIR`"
        )
    unsupported = (
        ("--moe-use-upcycling", cfg.moe.use_upcycling),
        ("--optimizer muon", cfg.train.optimizer == "muon"),  # it orthogonalises whole matrices
    )
    problems += [f"{flag}: not supported with {TP} > 1 yet ({TP}={tp})" for flag, given in unsupported if given]
    # the model's vocabulary is the tokenizer's padded to a multiple of tp (builders.padded_vocab_size): no refusal
    model = dataclasses.replace(cfg.model, vocab_size=None)
    problems += [f"{TP}={tp}: {line}" for line in refusals(model, moe, tp, cfg.implementation.sequence_parallel)]
    return problems


def check_tensor_parallel_run(cfg, world_size: int) -> None:
    """The refusals above, one ConfigError listing them all."""
    problems = tensor_parallel_refusals(cfg, world_size)
    if problems:
        raise ConfigError("\n".join(problems))


def sequence_parallel_notice(cfg) -> List[str]:
    """Megatron's warning where --sequence-parallel is given at tp 1: it is turned off."""
    if cfg.parallel.tensor_parallel_size == 1 and cfg.implementation.sequence_parallel:
        return [f" --sequence-parallel: off at {TP} 1 (Megatron's: it needs tensor parallelism)"]
    return []
