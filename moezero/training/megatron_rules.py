"""Megatron's rules between flags moezero takes (megatron-core's TransformerConfig and Megatron-LM's
validate_args, core_v0.16.1): a combination Megatron refuses is refused here too, in one line, so a script that
runs here is a model Megatron would train. `validate` (configs.py) calls them on the run's configs; what
validate_args alone refuses of one section's flags is that config's `check_command_line`."""

from __future__ import annotations

import os

import torch

from moezero.config import ConfigError

NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")  # --deterministic-mode's (Megatron's)
CUBLAS_WORKSPACES = (":4096:8", ":16:8")  # torch's deterministic cuBLAS settings


def check_router(cfg) -> None:
    """megatron-core's TransformerConfig rules for the router: a softmax over the one selected logit is 1.0 for
    every token (the router's weight would get no gradient from the loss); the expert bias is for sigmoid scores;
    a group top-k needs the groups."""
    moe = cfg.moe
    if moe.num_experts is None:
        return
    if (
        moe.top_k == 1
        and moe.score_function == "softmax"
        and not moe.pre_softmax
        and moe.load_balancing_type != "sinkhorn"
    ):
        raise ConfigError(
            "--moe-router-topk 1: needs --moe-router-pre-softmax with the softmax score function (a "
            "softmax over the one selected logit is always 1: the router would get no gradient "
            "from the loss; Megatron's rule)"
        )
    if moe.enable_expert_bias and moe.score_function != "sigmoid":
        raise ConfigError(
            "--moe-router-enable-expert-bias: only with --moe-router-score-function sigmoid "
            "(Megatron's rule for aux-loss-free routing)"
        )
    if moe.group_topk and moe.num_groups is None:  # 0 is off, as in Megatron
        raise ConfigError(
            f"--moe-router-group-topk={moe.group_topk}: group-limited routing needs "
            "--moe-router-num-groups (Megatron's rule)"
        )


def check_megatron_combinations(cfg) -> None:
    """Combinations of flags moezero honours that megatron-core's TransformerConfig.__post_init__ or its
    DistributedDataParallel refuses (core_v0.16.1), refused here in one line, the first that applies. Megatron's
    dispatcher defaults to allgather and its grouped GEMM is off unless --moe-grouped-gemm is typed (moezero runs
    its grouped GEMM either way: the same numbers)."""
    model, moe, flags, train = cfg.model, cfg.moe, cfg.implementation, cfg.train
    dispatcher = flags.moe_token_dispatcher_type
    typed = set(getattr(cfg.checkpoint, "given_fields", ()))
    shared_overlap = flags.moe_shared_expert_overlap and moe.shared_expert_intermediate_size is not None
    overlap = train.overlap_moe_expert_parallel_comm
    rules = [
        (
            moe.capacity_factor is not None and moe.load_balancing_type == "sinkhorn",
            "--moe-expert-capacity-factor: only with --moe-router-load-balancing-type aux_loss, seq_aux_loss, "
            "global_aux_loss or none, not sinkhorn (Megatron's rule)",
        ),
        (
            shared_overlap and dispatcher != "alltoall",
            f"--moe-shared-expert-overlap: only with --moe-token-dispatcher-type alltoall, not {dispatcher} "
            "(Megatron's "
            "rule)",
        ),
        (
            model.recompute_granularity == "selective"
            and "moe_act" in (model.recompute_modules or [])
            and "moe.grouped_gemm" not in typed,
            "--recompute-modules moe_act: needs --moe-grouped-gemm (Megatron's rule; moezero's experts run one "
            "grouped GEMM anyway)",
        ),
        (
            model.moe_layer_recompute and model.recompute_granularity == "full",
            "--moe-layer-recompute: not with --recompute-granularity full (Megatron's rule)",
        ),
        (
            overlap and dispatcher not in ("alltoall", "flex"),
            f"--overlap-moe-expert-parallel-comm: needs --moe-token-dispatcher-type alltoall or flex, not {dispatcher} "
            "(Megatron's rule)",
        ),
        (
            overlap and flags.moe_shared_expert_overlap,
            "--overlap-moe-expert-parallel-comm: not with --moe-shared-expert-overlap (Megatron's rule)",
        ),
        (
            overlap and model.mtp_num_layers is not None,
            "--overlap-moe-expert-parallel-comm: not with --mtp-num-layers at --pipeline-model-parallel-size 1 "
            "(Megatron's rule: one MTP layer, on a pipeline of 2 stages or more)",
        ),
        (
            train.calculate_per_token_loss and flags.ddp_average_in_collective,
            "--calculate-per-token-loss: not with --ddp-average-in-collective (Megatron's DistributedDataParallel "
            "asserts it: the gradients are summed, then divided by the global batch's tokens)",
        ),
    ]
    problem = next((message for broken, message in rules if broken), None)
    if problem:
        raise ConfigError(problem)


def check_gpu_execution_flags(cfg) -> None:
    """Megatron's rules (core_v0.16.1's validate_args, TransformerConfig) for its GPU execution flags, which change
    no number here, and what --deterministic-mode cannot make deterministic."""
    flags, ep = cfg.implementation, cfg.parallel.expert_parallel_size
    graphs = set(flags.cuda_graph_modules)
    rules = [
        (
            flags.tp_comm_overlap,
            "--tp-comm-overlap: Transformer Engine's overlap of the tensor-parallel exchanges is not supported by "
            "moezero (at --tensor-model-parallel-size 1 Megatron turns --sequence-parallel off and refuses it too)",
        ),
        (
            flags.cuda_graph_impl == "local" and ep > 1,
            "--cuda-graph-impl local: with --expert-model-parallel-size > 1 Megatron needs "
            "--moe-pad-experts-for-cuda-graph-inference, which moezero does not have",
        ),
        (
            cfg.train.overlap_moe_expert_parallel_comm
            and flags.cuda_graph_impl != "none"
            and (flags.cuda_graph_impl != "transformer_engine" or graphs & {"moe", "mlp"}),
            f"--cuda-graph-impl {flags.cuda_graph_impl}: with --overlap-moe-expert-parallel-comm only "
            "transformer_engine, "
            "capturing neither moe nor mlp (Megatron's rule)",
        ),
    ]
    if flags.deterministic_mode:
        rules += _deterministic_mode_rules(cfg)
    problem = next((message for broken, message in rules if broken), None)
    if problem:
        raise ConfigError(problem)


def _deterministic_mode_rules(cfg):
    flags = cfg.implementation
    gpu = torch.cuda.is_available()
    nccl = gpu and cfg.parallel.distributed_backend == "nccl"
    return [
        (flags.use_flash_attn, "--deterministic-mode: not with --use-flash-attn (Megatron's rule)"),
        (
            cfg.model.cross_entropy_loss_fusion,
            "--deterministic-mode: not with --cross-entropy-loss-fusion (Megatron's rule)",
        ),
        (
            nccl and os.environ.get("NCCL_ALGO") not in NCCL_ALGOS,
            f"--deterministic-mode: needs NCCL_ALGO set to one of {', '.join(NCCL_ALGOS)} (Megatron's rule: NCCL's "
            "reductions otherwise pick their algorithm per call)",
        ),
        (
            gpu and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_WORKSPACES,
            f"--deterministic-mode: needs CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACES[0]} (or {CUBLAS_WORKSPACES[1]}) "
            "in "
            "the environment, torch's condition for deterministic cuBLAS",
        ),
    ]


def apply_deterministic_mode(cfg) -> None:
    """--deterministic-mode: torch's deterministic algorithms, process-wide (Megatron's validate_args sets them)."""
    if cfg.implementation.deterministic_mode:
        torch.use_deterministic_algorithms(True)


def check_accepted_megatron_flags(cfg) -> None:
    """Megatron's rules (core_v0.16.1's validate_args and TransformerConfig) for flags moezero accepts without a
    change of numbers, and moezero's for bf16 main grads."""
    flags = cfg.implementation
    rules = [
        (
            flags.moe_pad_expert_input_to_capacity and cfg.moe.capacity_factor is None,
            "--moe-pad-expert-input-to-capacity: needs --moe-expert-capacity-factor (Megatron's rule)",
        ),
        (
            flags.moe_enable_deepep and flags.moe_token_dispatcher_type != "flex",
            "--moe-enable-deepep: needs --moe-token-dispatcher-type flex (Megatron's rule)",
        ),
        (
            flags.moe_enable_deepep and flags.moe_flex_dispatcher_backend == "hybridep",
            "--moe-enable-deepep: is the deepep backend, not --moe-flex-dispatcher-backend hybridep (Megatron's rule)",
        ),
        (
            flags.moe_pad_expert_input_to_capacity
            and flags.moe_token_dispatcher_type == "flex"
            and (flags.moe_enable_deepep or flags.moe_flex_dispatcher_backend == "deepep"),
            "--moe-pad-expert-input-to-capacity: not with the flex dispatcher's deepep backend (Megatron's rule)",
        ),
        (
            flags.ckpt_format == "fsdp_dtensor" and not cfg.zero.use_megatron_fsdp,
            "--ckpt-format fsdp_dtensor: only with --use-megatron-fsdp (Megatron's rule)",
        ),
        (
            flags.optimizer_cpu_offload and not cfg.zero.use_precision_aware_optimizer,
            "--optimizer-cpu-offload: only with --use-precision-aware-optimizer (Megatron's rule)",
        ),
        (
            flags.overlap_param_gather_with_optimizer_step
            and not (cfg.zero.use_distributed_optimizer and flags.overlap_param_gather),
            "--overlap-param-gather-with-optimizer-step: needs --use-distributed-optimizer and --overlap-param-gather "
            "(Megatron's rule)",
        ),
        (
            flags.megatron_fsdp_main_grads_dtype == "bf16" and not cfg.train.bf16,
            "--megatron-fsdp-main-grads-dtype=bf16: needs --bf16 (the params' gradients are not bf16)",
        ),
    ]
    problem = next((message for broken, message in rules if broken), None)
    if problem:
        raise ConfigError(problem)
