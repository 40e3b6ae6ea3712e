"""Megatron's rules for a run at --context-parallel-size > 1, and what moezero does not run there yet (pure: one
line each, naming the flags).

What runs at cp > 1 (moezero/context_parallel.py): any ZeRO stage, dense and MoE layers (expert parallelism folded
over the same ranks), MHA/GQA attention with RoPE/YaRN or learned positions, multi-latent attention (under every
--cp-comm-type, as megatron-core 0.16.1 lets it: its shared RoPE key all-gathered once, or per head under a2a),
sliding windows, sinks, layer scaling, keyed dropout, MTP, --calculate-per-token-loss, checkpoints (a cp's resumes
at any other), pipeline stages (pp > 1, what the pipeline runs: each cp coordinate's pipeline sends its part of every
sequence; stage_model.py), and tensor parallelism (tp > 1, at pp 1: training/tensor_parallel.py; a2a then splits
each tp rank's heads over cp).
"""

from __future__ import annotations

from typing import List

from moezero.config import ConfigError

CP = "--context-parallel-size"


def context_parallel_refusals(cfg) -> List[str]:
    """At cp > 1, a line for each flag of the run that context parallelism does not run yet (none at cp 1): none
    at present, the seam where a model flag context parallelism does not run is named (pipeline_checks.py lists
    these with the pipeline's)."""
    return []


def check_context_parallel_run(cfg, world_size: int) -> None:
    """Megatron's rules (validate_args, TransformerConfig) and the refusals above, one ConfigError listing them."""
    p, model = cfg.parallel, cfg.model
    cp = p.context_parallel_size
    problems = context_parallel_refusals(cfg)
    if cp > 1:
        if world_size % (cp * p.pipeline_parallel_size):
            problems.append(f"{CP}={cp}: must divide the number of processes ({world_size})")
        if model.seq_length % (2 * cp):
            problems.append(f"--seq-length={model.seq_length}: must be divisible by 2 x {CP} = {2 * cp}")
        if "a2a" in p.cp_comm_type:  # a tensor-parallel rank's heads (tp's own checks: heads % tp)
            tp = p.tensor_parallel_size
            heads, groups = model.num_attention_heads // tp, model.query_groups // tp
            if heads % cp or groups % cp:
                of_rank = f" of a rank at --tensor-model-parallel-size={tp}" if tp > 1 else ""
                problems.append(
                    f"--cp-comm-type a2a: needs the attention heads ({heads}) and query groups ({groups}){of_rank} "
                    f"divisible by {CP}={cp} (Ulysses splits heads)"
                )
    if len(p.cp_comm_type) not in (1, model.num_layers):
        problems.append(
            f"--cp-comm-type={' '.join(p.cp_comm_type)}: one type for every layer or one per layer "
            f"(--num-layers={model.num_layers})"
        )
    if problems:
        raise ConfigError("\n".join(problems))


def comm_type_notice(cfg) -> List[str]:
    """The run's log line at cp > 1 with p2p asked for: it runs the all-gather."""
    if cfg.parallel.context_parallel_size == 1 or "p2p" not in cfg.parallel.cp_comm_type:
        return []
    return [
        " --cp-comm-type p2p: attention all-gathers the layer's keys and values over the cp group instead of "
        "passing them round a ring (the same numbers; the ring overlaps only on GPUs)"
    ]
