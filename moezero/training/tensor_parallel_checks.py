"""Megatron's rules for a run at --tensor-model-parallel-size > 1, and what moezero does not run there yet (pure: one
line each, naming the flags).

What runs at tp > 1 (training/tensor_parallel.py): any ZeRO stage, dense GPTs
(MHA/GQA, RoPE or learned positions, per-head q/k norms, sinks, windows, keyed dropout, untied or tied output, MTP)
with or without --sequence-parallel, and MoE layers with it (expert parallelism folded over the same ranks); with
pipeline stages (each stage's modules swapped alike, MTP on the last stage) all of it, with context parallelism and
with both; checkpoints at global coordinates (a tp's resumes at any other); --load-hf reads each rank's slices of
the Hub files (moezero/hf/shard_reads.py, an expert stack's etp slices Link.assemble_slices), --save-hf writes the
tp 1 run's folder (moezero/hf/slice_gather.py; with pipeline stages each stage's tp and etp groups gather its
tensors); --moe-use-upcycling copies each rank's slices of the dense tensors (models/upcycling.py), with pipeline
stages too (each stage's).

Expert tensor parallelism (--expert-tensor-parallel-size, by default tp as Megatron's) splits each expert's ffn over
etp ranks (moe/experts.py, moe/dispatch.py) at any tp, Megatron's expert groups (parallel/groups.py; with pipeline
stages each stage's, pipeline/stage_groups.py), with context parallelism too; its expert slices are ZeRO params
and checkpoint pieces at global coordinates (an etp's checkpoint resumes at any other). Unlike Megatron it keeps the
experts' biases (--add-bias-linear): each etp rank adds its slice of the output bias, exact (tests/distributed/
test_moe_expert_tensor_parallel.py).
"""

from __future__ import annotations

import dataclasses
from typing import List

from moezero.config import ConfigError
from moezero.parallel.ranks import check_sizes
from moezero.training.tensor_parallel import refusals

TP = "--tensor-model-parallel-size"
ETP = "--expert-tensor-parallel-size"


def tensor_parallel_refusals(cfg, world_size: int) -> List[str]:
    """At tp > 1, a line for each flag or value of the run that tensor parallelism does not run (none at tp 1)."""
    p = cfg.parallel
    tp = p.tensor_parallel_size
    problems = expert_tensor_parallel_refusals(cfg, world_size)
    if tp == 1:
        return problems
    # with pipeline or context parallelism: refused by ParallelConfig
    if world_size % tp:
        problems.insert(0, f"{TP}={tp}: must divide the number of processes ({world_size})")
    moe = cfg.moe if cfg.moe.num_experts is not None else None
    # the model's vocabulary is the tokenizer's padded to a multiple of tp (builders.padded_vocab_size): no refusal
    model = dataclasses.replace(cfg.model, vocab_size=None)
    problems += [f"{TP}={tp}: {line}" for line in refusals(model, moe, tp, cfg.implementation.sequence_parallel)]
    return problems


def expert_tensor_parallel_refusals(cfg, world_size: int) -> List[str]:
    """At etp > 1, a line for each size that expert tensor parallelism does not run (none at etp 1)."""
    p, moe = cfg.parallel, cfg.moe
    etp, tp = p.expert_tensor_parallel, p.tensor_parallel_size
    if etp == 1:
        return []
    problems = []
    decoder_fits = world_size % (tp * p.context_parallel_size * p.pipeline_parallel_size) == 0
    if decoder_fits:  # the decoder's sizes are the tp and cp checks' lines
        try:
            check_sizes(world_size, tp, p.context_parallel_size, p.expert_parallel_size, etp, 1, False)
        except ConfigError as error:  # Megatron's world % (etp x ep x pp)
            problems.append(str(error))
    if moe.num_experts is None:  # a dense GPT: the experts' split has nothing to split (Megatron's too)
        return problems
    ffn, hidden = moe.ffn_hidden_size or cfg.model.ffn_hidden_size, cfg.model.hidden_size  # the experts' widths
    if ffn % etp or hidden % etp:  # each rank holds its columns of fc1 (GLU: of both halves), its rows of fc2
        problems.append(
            f"{ETP}={etp}: must divide the experts' ffn size ({ffn}, --moe-ffn-hidden-size) and --hidden-size "
            f"({hidden})"
        )
    return problems


def check_tensor_parallel_run(cfg, world_size: int) -> None:
    """The refusals above, one ConfigError listing them all."""
    problems = tensor_parallel_refusals(cfg, world_size)
    if problems:
        raise ConfigError("\n".join(problems))


def muon_tp_mode_notice(cfg) -> List[str]:
    """The run's log line where Muon's distributed tp mode is asked for at tp or etp > 1: it runs duplicated."""
    p, t = cfg.parallel, cfg.train
    if (
        t.optimizer != "muon"
        or t.muon_tp_mode != "distributed"
        or p.tensor_parallel_size * p.expert_tensor_parallel == 1
    ):
        return []
    return [
        " --muon-tp-mode distributed: each tp rank gathers a weight's update and orthogonalises it whole, as "
        "duplicated does (the same numbers; megatron-core splits the Newton-Schulz matmuls over the tp group)"
    ]


def sequence_parallel_notice(cfg) -> List[str]:
    """Megatron's warning where --sequence-parallel is given at tp 1: it is turned off."""
    if cfg.parallel.tensor_parallel_size == 1 and cfg.implementation.sequence_parallel:
        return [f" --sequence-parallel: off at {TP} 1 (Megatron's: it needs tensor parallelism)"]
    return []
