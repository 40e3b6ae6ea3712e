"""What the training script knows of Megatron-LM's command line besides the flags it honours.

ImplementationConfig  flags that pick one of Megatron's implementations of the same numbers (a fused
                      kernel, an attention backend, a dispatcher, Transformer Engine): accepted so launch
                      scripts run unchanged, recorded with the run's flags, and nothing to do (moezero has
                      one implementation of each, with the same numbers);
megatron_table()      every flag of Megatron's parser (assets/megatron_arguments.json, written by
                      tools/megatron_arguments.py from megatron-core 0.19.2), so a Megatron flag moezero
                      lacks is "not supported by moezero" in one line, not a misleading did-you-mean.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

from moezero.config import Validated, option

_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "megatron_arguments.json")
SAME_NUMBERS = "accepted: Megatron's choice of implementation, with the same numbers here"


@dataclass
class ImplementationConfig(Validated):
    """Megatron flags that choose an implementation of the same numbers (accepted; nothing to do here)."""

    section = "implementation"
    use_mcore_models: bool = option(False, SAME_NUMBERS, flag="--use-mcore-models")
    transformer_impl: str = option(
        "transformer_engine",
        SAME_NUMBERS,
        flag="--transformer-impl",
        choices=("local", "transformer_engine", "inference_optimized"),
    )
    attention_backend: str = option(
        "auto", SAME_NUMBERS, flag="--attention-backend", choices=("flash", "fused", "unfused", "local", "auto")
    )
    use_flash_attn: bool = option(False, SAME_NUMBERS, flag="--use-flash-attn")
    attention_softmax_in_fp32: bool = option(
        False, "accepted: the softmax runs in fp32 here anyway", flag="--attention-softmax-in-fp32"
    )
    no_masked_softmax_fusion: bool = option(False, SAME_NUMBERS, flag="--no-masked-softmax-fusion")
    no_bias_swiglu_fusion: bool = option(False, SAME_NUMBERS, flag="--no-bias-swiglu-fusion")
    no_bias_dropout_fusion: bool = option(False, SAME_NUMBERS, flag="--no-bias-dropout-fusion")
    no_rope_fusion: bool = option(False, SAME_NUMBERS, flag="--no-rope-fusion")
    no_persist_layer_norm: bool = option(False, SAME_NUMBERS, flag="--no-persist-layer-norm")
    no_gradient_accumulation_fusion: bool = option(False, SAME_NUMBERS, flag="--no-gradient-accumulation-fusion")
    moe_permute_fusion: bool = option(False, SAME_NUMBERS, flag="--moe-permute-fusion")
    moe_token_dispatcher_type: str = option(
        "allgather",
        "accepted: moezero's dispatcher is an all-to-all, with the same numbers as any",
        flag="--moe-token-dispatcher-type",
        choices=("allgather", "alltoall", "flex"),
    )
    moe_enable_deepep: bool = option(
        False,
        "accepted: Megatron's older spelling of the flex dispatcher's DeepEP backend (the same numbers)",
        flag="--moe-enable-deepep",
    )
    moe_router_fusion: bool = option(False, SAME_NUMBERS, flag="--moe-router-fusion")
    moe_upcycling_granularity: int = option(
        1,
        "with --moe-use-upcycling: each dense MLP becomes whole experts "
        "(Megatron's default; finer granularity is not supported)",
        flag="--moe-upcycling-granularity",
        choices=(1,),
    )
    moe_pad_expert_input_to_capacity: bool = option(
        False,
        "accepted with --moe-expert-capacity-factor: padding an expert's rows to its capacity changes no number",
        flag="--moe-pad-expert-input-to-capacity",
    )
    fine_grained_activation_offloading: bool = option(
        False,
        "accepted: activations stay in memory here (the same numbers)",
        flag="--fine-grained-activation-offloading",
    )
    offload_modules: List[str] = option(
        help="accepted: activations stay in memory here (the same numbers)",
        flag="--offload-modules",
        nargs="+",
        default_factory=list,
    )
    optimizer_cpu_offload: bool = option(
        False,
        "accepted: the optimizer's shard stays where the params are (the same numbers)",
        flag="--optimizer-cpu-offload",
    )
    num_distributed_optimizer_instances: int = option(
        1,
        "accepted: one optimizer instance over the data-parallel ranks (the same numbers)",
        flag="--num-distributed-optimizer-instances",
    )
    ddp_num_buckets: Optional[int] = option(
        None, "accepted: --ddp-bucket-size sizes the buckets", flag="--ddp-num-buckets"
    )
    ddp_average_in_collective: bool = option(
        False, "accepted: gradients are averaged over the ranks either way", flag="--ddp-average-in-collective"
    )
    overlap_param_gather_with_optimizer_step: bool = option(
        False,
        "accepted: the params are gathered after the step (the same numbers)",
        flag="--overlap-param-gather-with-optimizer-step",
    )
    disable_gloo_process_groups: bool = option(
        False, "accepted: moezero keeps the gloo groups it needs", flag="--disable-gloo-process-groups"
    )
    moe_shared_expert_overlap: bool = option(False, SAME_NUMBERS, flag="--moe-shared-expert-overlap")
    overlap_param_gather: bool = option(
        False, "accepted: stage 3 prefetches its gathers anyway", flag="--overlap-param-gather"
    )
    sequence_parallel: bool = option(
        False,
        "at --tensor-model-parallel-size > 1: norms, dropout and residuals on each rank's sequence shard (needed by "
        "MoE layers); at 1 it changes nothing (Megatron turns it off)",
        flag="--sequence-parallel",
    )
    use_dist_ckpt: bool = option(
        False, "accepted: checkpoints are torch.distributed.checkpoint's", flag="--use-dist-ckpt"
    )
    ckpt_format: str = option(
        "torch_dist",
        "accepted: checkpoints are torch.distributed.checkpoint's, "
        "Megatron's torch_dist (fsdp_dtensor: what Megatron requires with "
        "--use-megatron-fsdp)",
        flag="--ckpt-format",
        choices=("torch_dist", "fsdp_dtensor"),
    )
    timing_log_level: int = option(
        0, "accepted: moezero logs the iteration time", flag="--timing-log-level", choices=(0, 1, 2)
    )
    trust_remote_code: bool = option(
        False, "accepted: the tokenizers here read local files only", flag="--trust-remote-code"
    )
    timing_log_option: str = option(
        "minmax",
        "accepted: moezero logs the iteration time",
        flag="--timing-log-option",
        choices=("max", "minmax", "all"),
    )
    log_memory_interval: Optional[int] = option(
        None, "accepted: every console line carries the peak memory", flag="--log-memory-interval"
    )
    te_rng_tracker: bool = option(
        False, "accepted: dropout draws from moezero's keyed generator, the same on any layout", flag="--te-rng-tracker"
    )
    ckpt_fully_parallel_save: bool = option(
        False, "accepted: every rank writes its own shard (torch DCP)", flag="--ckpt-fully-parallel-save"
    )
    ckpt_fully_parallel_load: bool = option(
        False, "accepted: every rank reads its own shard (torch DCP)", flag="--ckpt-fully-parallel-load"
    )
    cross_entropy_fusion_impl: str = option(
        "native",
        "accepted: --cross-entropy-loss-fusion is moezero's fused kernel",
        flag="--cross-entropy-fusion-impl",
        choices=("native", "te"),
    )
    disable_bf16_reduced_precision_matmul: bool = option(
        False,
        "bf16 GEMMs on CUDA without reduced-precision reductions (megatron-core's: sets torch.backends.cuda."
        "matmul.allow_bf16_reduced_precision_reduction False); nothing on a CPU",
        flag="--disable-bf16-reduced-precision-matmul",
    )
    manual_gc: bool = option(False, "accepted: Python's garbage collector is left as it is", flag="--manual-gc")
    manual_gc_interval: int = option(
        0, "accepted: Python's garbage collector is left as it is", flag="--manual-gc-interval"
    )
    create_attention_mask_in_dataloader: bool = option(
        True, "accepted: the causal mask is built in the model", flag="--create-attention-mask-in-dataloader"
    )
    mmap_bin_files: bool = option(True, SAME_NUMBERS, flag="--mmap-bin-files")
    moe_flex_dispatcher_backend: str = option(
        "deepep", SAME_NUMBERS, flag="--moe-flex-dispatcher-backend", choices=("deepep", "hybridep", "ncclep")
    )
    nccl_ub: bool = option(False, SAME_NUMBERS, flag="--use-nccl-ub")
    fsdp_double_buffer: bool = option(False, SAME_NUMBERS, flag="--fsdp-double-buffer")
    init_model_with_meta_device: bool = option(
        False, "accepted: each rank builds only what it holds anyway", flag="--init-model-with-meta-device"
    )
    auto_detect_ckpt_format: bool = option(
        False, "accepted: checkpoints have one format here", flag="--auto-detect-ckpt-format"
    )
    dist_ckpt_strictness: str = option(
        "assume_ok_unexpected",
        "accepted: a checkpoint that does not fit the model is an error here",
        flag="--dist-ckpt-strictness",
        choices=(
            "assume_ok_unexpected",
            "log_unexpected",
            "log_all",
            "raise_unexpected",
            "raise_all",
            "return_unexpected",
            "return_all",
            "ignore_all",
        ),
    )
    check_for_nan_in_loss_and_grad: bool = option(
        True,
        "a non-finite loss or gradient (bf16/fp32) stops the run at "
        "that step, not taken, as Megatron's; --no-check-for-nan-in-"
        "loss-and-grad skips such steps instead (moezero's: up to "
        "--max-consecutive-skipped-steps in a row; Megatron would apply "
        "them). fp16's dynamic loss scaling skips overflows either way",
        flag="--check-for-nan-in-loss-and-grad",
    )
    enable_experimental: bool = option(
        False, "accepted: moezero has no experimental switches", flag="--enable-experimental"
    )
    logging_level: Optional[int] = option(
        None,
        "accepted: moezero's console lines are its own (Python's logging is left as it is)",
        flag="--logging-level",
    )
    empty_unused_memory_level: int = option(
        0, "accepted: the caching allocator is left as it is", flag="--empty-unused-memory-level", choices=(0, 1, 2)
    )
    # logging Megatron switches on by flag and moezero always does
    log_timers_to_tensorboard: bool = option(
        False, "accepted: iteration-time (and throughput) are always logged", flag="--log-timers-to-tensorboard"
    )
    log_validation_ppl_to_tensorboard: bool = option(
        False, "accepted: the validation ppl is always logged", flag="--log-validation-ppl-to-tensorboard"
    )
    log_memory_to_tensorboard: bool = option(
        False,
        "on a GPU, Megatron's mem-* tags (the caching allocator's "
        "statistics); memory/... (process RSS, what the optimizer holds) is "
        "always logged",
        flag="--log-memory-to-tensorboard",
    )
    megatron_fsdp_main_params_dtype: str = option(
        "fp32", "accepted: master weights are fp32 here", flag="--megatron-fsdp-main-params-dtype", choices=("fp32",)
    )
    megatron_fsdp_main_grads_dtype: str = option(
        "auto",
        "accepted: gradients are accumulated in the params' dtype and reduced in --grad-reduce-dtype",
        flag="--megatron-fsdp-main-grads-dtype",
        choices=("auto", "fp32", "bf16"),
    )

    # checkpointing and GPU execution choices of Megatron's: the same checkpoints and numbers
    use_persistent_ckpt_worker: bool = option(
        False,
        "accepted: --async-save writes in the background with or without "
        "it (Megatron 0.16.1 turns --async-save off without it)",
        flag="--use-persistent-ckpt-worker",
    )
    ckpt_assume_constant_structure: bool = option(
        False,
        "accepted: a saving shortcut of Megatron's (the same checkpoints)",
        flag="--ckpt-assume-constant-structure",
    )
    dist_ckpt_optim_fully_reshardable: bool = option(
        False,
        "accepted: the optimizer state resumes on any layout here anyway",
        flag="--dist-ckpt-optim-fully-reshardable",
    )
    async_strategy: str = option(
        "nvrx",
        "accepted: --async-save is torch DCP's background save here",
        flag="--async-strategy",
        choices=("nvrx", "mcore"),
    )
    async_ckpt_use_cpu_shm: bool = option(
        False, "accepted: --async-save stages in host memory here anyway", flag="--async-ckpt-use-cpu-shm"
    )
    tp_comm_overlap: bool = option(
        False,
        "Megatron's tensor-parallel communication overlap (Transformer Engine's userbuffers, GPUs only): refused "
        "(at --tensor-model-parallel-size 1 Megatron turns --sequence-parallel off and refuses it too)",
        flag="--tp-comm-overlap",
    )
    use_transformer_engine_op_fuser: bool = option(False, SAME_NUMBERS, flag="--use-transformer-engine-op-fuser")
    cuda_graph_impl: str = option(
        "none",
        "accepted: CUDA graphs replay the same kernels (none are captured here), with Megatron's rules",
        flag="--cuda-graph-impl",
        choices=("none", "local", "transformer_engine", "full_iteration"),
    )
    cuda_graph_modules: List[str] = option(
        help="accepted with --cuda-graph-impl: what CUDA graphs capture",
        flag="--cuda-graph-modules",
        nargs="+",
        default_factory=list,
    )
    deterministic_mode: bool = option(
        False,
        "torch's deterministic algorithms for the whole run "
        "(torch.use_deterministic_algorithms, as Megatron's); refused with "
        "--use-flash-attn and --cross-entropy-loss-fusion (Megatron's asserts) and, on "
        "CUDA, without CUBLAS_WORKSPACE_CONFIG (torch's condition) or, with nccl, "
        "NCCL_ALGO (Megatron's)",
        flag="--deterministic-mode",
    )

    def __post_init__(self):
        self._check_all_choices()


def megatron_table() -> Dict:
    """{"megatron_core": version, "flags": {flag: {"dest", "default", "action", "choices"}}} of Megatron's parser."""
    with open(_TABLE) as f:
        return json.load(f)
