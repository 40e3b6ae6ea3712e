"""The configs of a pretraining run and the checks across them.

Each section is a config dataclass of `moezero.config` whose fields declare their flags; a recipe
that plugs more features in extends `Configs` with their sections (see `moezero.recipe`).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from moezero.config import (
    ConfigError,
    DataConfig,
    GPTConfig,
    MoEConfig,
    ParallelConfig,
    Validated,
    ZeroConfig,
    check_experts_divide,
    option,
)
from moezero.data import num_micro_steps
from moezero.config.model import RECOMPUTE_KEPT
from moezero.parallel import rank_layout
from moezero.pipeline import pipeline_rank_layout
from moezero.training.batch_schedule import BatchSchedule, parse_step_schedule
from moezero.training.megatron_flags import ImplementationConfig
from moezero.training.context_parallel_checks import check_context_parallel_run
from moezero.training.tensor_parallel_checks import check_tensor_parallel_run
from moezero.training.pipeline_checks import check_pipeline_run
from moezero.training.megatron_rules import (
    check_accepted_megatron_flags,
    check_gpu_execution_flags,
    check_megatron_combinations,
    check_router,
)
from moezero.training.profiling import ProfilingConfig, check_profiling
from moezero.training.lr_schedule import LearningRateSchedule


# --exit-signal's choices: Megatron's (signal.Signals) but for the two no handler can catch
CATCHABLE_SIGNALS = tuple(sorted(s.name for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)))


@dataclass
class TrainConfig(Validated):
    """Batching, schedule, precision, evaluation, logging and checkpoints."""

    section = "train"
    micro_batch_size: int = option(4, "samples per rank per micro-step", flag="--micro-batch-size")
    global_batch_size: Optional[int] = option(
        None,
        "samples per optimizer step, over all ranks (default "
        "--micro-batch-size x the number of processes, as Megatron's; with "
        "--step-batch-size-schedule its last size)",
        flag="--global-batch-size",
    )
    train_iters: Optional[int] = option(
        None, "optimizer steps (default 200, or --train-samples / --global-batch-size)", flag="--train-iters"
    )
    train_samples: Optional[int] = option(
        None,
        "samples to train on instead of --train-iters; the lr schedule "
        "then counts samples (Megatron's sample-based runs)",
        flag="--train-samples",
    )
    rampup_batch_size: Optional[List[int]] = option(
        None,
        "START INCREMENT SAMPLES: the global batch grows from START by INCREMENT up to --global-batch-size "
        "over SAMPLES consumed samples (Megatron's ramp-up)",
        flag="--rampup-batch-size",
        nargs=3,
        parse=int,
    )
    step_batch_size_schedule: Optional[str] = option(
        None,
        '"THRESHOLD:SIZE ...": from each threshold of consumed tokens on (K/M/B/T suffixes), that global '
        "batch size; the last is --global-batch-size",
        flag="--step-batch-size-schedule",
    )
    lr: float = option(2e-3, "peak learning rate", flag="--lr")
    min_lr: float = option(0.0, "learning rate at the end of the decay", flag="--min-lr")
    lr_warmup_iters: int = option(0, "linear warmup steps", flag="--lr-warmup-iters")
    lr_warmup_init: float = option(0.0, "the learning rate warmup starts from", flag="--lr-warmup-init")
    decoupled_lr: Optional[float] = option(
        None,
        "the peak learning rate of the embedding and output layer (their own schedule, otherwise --lr's)",
        flag="--decoupled-lr",
    )
    decoupled_min_lr: Optional[float] = option(
        None,
        "with --decoupled-lr: their learning rate at the end of the decay (default --min-lr)",
        flag="--decoupled-min-lr",
    )
    lr_warmup_fraction: Optional[float] = option(
        None, "warmup as a fraction of the decay length", flag="--lr-warmup-fraction"
    )
    lr_warmup_samples: int = option(0, "warmup samples (with --train-samples)", flag="--lr-warmup-samples")
    lr_decay_iters: Optional[int] = option(None, "decay length (default --train-iters)", flag="--lr-decay-iters")
    lr_decay_samples: Optional[int] = option(
        None, "decay length in samples (with --train-samples; default --train-samples)", flag="--lr-decay-samples"
    )
    lr_decay_style: str = option(
        "linear",
        "decay after warmup (WSD: constant, then the --lr-wsd-decay-style anneal "
        "over the last --lr-wsd-decay-iters / -samples)",
        flag="--lr-decay-style",
        choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    )
    lr_wsd_decay_style: str = option(
        "exponential",
        "WSD: the anneal's shape",
        flag="--lr-wsd-decay-style",
        choices=("exponential", "linear", "cosine", "minus_sqrt"),
    )
    lr_wsd_decay_iters: Optional[int] = option(None, "WSD: the anneal's iterations", flag="--lr-wsd-decay-iters")
    lr_wsd_decay_samples: Optional[int] = option(
        None, "WSD: the anneal's samples (with --train-samples)", flag="--lr-wsd-decay-samples"
    )
    override_opt_param_scheduler: bool = option(
        False,
        "on resume, run the command line's learning-rate schedule where it differs from the checkpoint's",
        flag="--override-opt_param-scheduler",
        aliases=("--override-opt-param-scheduler",),
    )
    use_checkpoint_opt_param_scheduler: bool = option(
        False,
        "on resume, keep the checkpoint's learning-rate schedule where the command line differs",
        flag="--use-checkpoint-opt_param-scheduler",
        aliases=("--use-checkpoint-opt-param-scheduler",),
    )
    optimizer: str = option(
        "adam",
        "adam = AdamW (decoupled weight decay), sgd = SGD with momentum, muon = Megatron's Muon for the 2-D "
        "weights and AdamW for embeddings, output layer, biases and norms (docs/zero.md)",
        flag="--optimizer",
        choices=("adam", "sgd", "muon"),
    )
    weight_decay: float = option(
        0.01, "weight decay (not applied to biases and norms: Megatron's rule)", flag="--weight-decay"
    )
    apply_wd_to_qk_layernorm: bool = option(
        False,
        "weight decay on the query and key norms too (their weights and "
        "biases; with multi-latent attention the query latent's norm, as "
        "megatron-core names them): Qwen3-Next's rule, Megatron's flag",
        flag="--apply-wd-to-qk-layernorm",
    )
    weight_decay_incr_style: str = option(
        "constant",
        "the weight decay over the run (Megatron's): constant "
        "--weight-decay, or linear / cosine from --start-weight-decay to "
        "--end-weight-decay over the run's samples",
        flag="--weight-decay-incr-style",
        choices=("constant", "linear", "cosine"),
    )
    start_weight_decay: Optional[float] = option(
        None, "the first step's weight decay (linear / cosine)", flag="--start-weight-decay"
    )
    end_weight_decay: Optional[float] = option(
        None, "the weight decay at the end of the run (linear / cosine)", flag="--end-weight-decay"
    )
    adam_beta1: float = option(0.9, "Adam beta1", flag="--adam-beta1")
    adam_beta2: float = option(0.999, "Adam beta2", flag="--adam-beta2")
    adam_eps: float = option(1e-8, "Adam epsilon", flag="--adam-eps")
    sgd_momentum: float = option(0.9, "SGD momentum", flag="--sgd-momentum")
    muon_momentum: float = option(0.9, "Muon's momentum (its buffer's EMA coefficient)", flag="--muon-momentum")
    muon_nesterov: bool = option(False, "Muon: Nesterov momentum", flag="--muon-nesterov")
    muon_no_split_qkv: bool = option(
        False,
        "Muon: orthogonalise the fused QKV weight whole, not per query, key and value",
        flag="--muon-no-split-qkv",
    )
    muon_scale_mode: str = option(
        "spectral",
        "Muon's update scale: spectral sqrt(max(out, in)), unit_rms_norm sqrt(out / in), shape_scaling "
        "sqrt(max(1, out / in))",
        flag="--muon-scale-mode",
        choices=("spectral", "unit_rms_norm", "shape_scaling"),
    )
    muon_extra_scale_factor: float = option(
        1.0, "Muon: the update's scale is multiplied by this", flag="--muon-extra-scale-factor"
    )
    muon_num_ns_steps: int = option(5, "Muon: Newton-Schulz iterations", flag="--muon-num-ns-steps")
    muon_coefficient_type: str = option(
        "quintic",
        "Muon: the Newton-Schulz coefficients (quintic, simple, polar_express, aol)",
        flag="--muon-coefficient-type",
    )
    muon_fp32_matmul_prec: str = option(
        "medium",
        "Muon: medium runs the Newton-Schulz iterations of fp32 masters in bf16, high in fp32 (TF32 on GPUs); low is "
        "refused (torch has no such precision)",
        flag="--muon-fp32-matmul-prec",
        choices=("low", "medium", "high"),
    )
    muon_tp_mode: str = option(
        "blockwise",
        "Muon at tensor parallelism: blockwise orthogonalises each rank's shard, duplicated the whole weight gathered "
        "over tp (experts over etp), distributed runs as duplicated; at tp 1 every mode is the whole matrix",
        flag="--muon-tp-mode",
        choices=("blockwise", "duplicated", "distributed"),
    )
    muon_scalar_optimizer: str = option(
        "adam",
        "Muon: the optimizer of the params Muon leaves (adam; lion is refused: moezero has no Lion)",
        flag="--muon-scalar-optimizer",
        choices=("adam", "lion"),
    )
    bf16: bool = option(False, "bf16 params and activations, fp32 master weights", flag="--bf16")
    fp16: bool = option(False, "fp16 params with dynamic loss scaling, fp32 master weights", flag="--fp16")
    fp64: bool = option(False, "float64 params and activations, for numerics checks (slow)", flag="--fp64")
    seed: int = option(1234, "seed for init, data order, dropout and jitter", flag="--seed")
    eval_interval: int = option(50, "evaluate every N steps (0 = never)", flag="--eval-interval")
    eval_iters: int = option(
        100, "global batches per evaluation (0: no validation or test evaluation)", flag="--eval-iters"
    )
    skip_train: bool = option(
        False,
        "no training (Megatron's): evaluate --load's weights on --eval-iters global "
        "batches of the validation and the test split, each from its start, and exit "
        "(nothing saved or written to TensorBoard)",
        flag="--skip-train",
    )
    log_interval: int = option(
        100, "the console line every N steps (and moezero's per-expert loads in TensorBoard)", flag="--log-interval"
    )
    tensorboard_dir: Optional[str] = option(None, "TensorBoard event directory", flag="--tensorboard-dir")
    tensorboard_log_interval: int = option(1, "TensorBoard scalars every N steps", flag="--tensorboard-log-interval")
    tensorboard_queue_size: int = option(
        1000,
        "TensorBoard events held before they are written (its writer's max_queue)",
        flag="--tensorboard-queue-size",
    )
    log_loss_scale_to_tensorboard: bool = option(
        True,
        "the loss-scale tag (--no-log-loss-scale-to-tensorboard: not written)",
        flag="--log-loss-scale-to-tensorboard",
    )
    log_world_size_to_tensorboard: bool = option(
        False, "the number of processes as the world-size tag", flag="--log-world-size-to-tensorboard"
    )
    wandb_project: Optional[str] = option(
        None,
        "Weights & Biases project: the TensorBoard scalars also go to a W&B "
        "run (WANDB_MODE=offline writes it to local files)",
        flag="--wandb-project",
    )
    wandb_exp_name: Optional[str] = option(None, "the W&B run's name", flag="--wandb-exp-name")
    wandb_save_dir: Optional[str] = option(
        None, "where the W&B run is written (default: <--save>/wandb)", flag="--wandb-save-dir"
    )
    wandb_entity: Optional[str] = option(None, "the W&B team or user", flag="--wandb-entity")
    log_throughput: bool = option(
        False, "TFLOP/s per rank (Megatron's count: the routed experts, attention, logits)", flag="--log-throughput"
    )
    log_params_norm: bool = option(False, "the L2 norm of the trainable weights", flag="--log-params-norm")
    log_num_zeros_in_grad: bool = option(
        False, "gradient elements that are exactly zero", flag="--log-num-zeros-in-grad"
    )
    moe_per_layer_logging: bool = option(
        False, "each MoE layer's load-balancing and z losses in TensorBoard", flag="--moe-per-layer-logging"
    )
    calculate_per_token_loss: bool = option(
        False,
        "the lm loss summed over the global batch's tokens and divided "
        "by their count, not averaged per micro-batch (Megatron's)",
        flag="--calculate-per-token-loss",
    )
    overlap_moe_expert_parallel_comm: bool = option(
        False,
        "micro-batches in pairs whose forwards run interleaved, one's expert-parallel exchanges travelling "
        "while the other computes, and whose backward is one, interleaved the same way (the same numbers)",
        flag="--overlap-moe-expert-parallel-comm",
    )
    exit_signal_handler: bool = option(
        False,
        "on --exit-signal or SIGINT, finish the iteration, save (with --save) "
        "and exit 0; ranks agree on it every iteration",
        flag="--exit-signal-handler",
    )
    exit_signal: str = option(
        "SIGTERM",
        "the signal --exit-signal-handler stops on (Megatron's; e.g. SIGUSR1 for Slurm's --signal=USR1@...)",
        flag="--exit-signal",
        choices=CATCHABLE_SIGNALS,
    )
    exit_duration_in_mins: Optional[float] = option(
        None, "save (with --save) and exit 0 once the run has taken this long", flag="--exit-duration-in-mins"
    )
    exit_interval: int = option(
        0,
        "stop (after saving, when --save is set) once the iteration is a multiple of N (0 = run to --train-iters)",
        flag="--exit-interval",
    )
    dist_timeout_minutes: float = option(
        10, "minutes a collective may wait before a dead peer fails the job", flag="--distributed-timeout-minutes"
    )
    host_heap_policy: bool = option(
        True,
        "the host heap policy (HeapTrimmer): glibc keeps freed tensors' memory "
        "for reuse instead of unmapping it, and the heap is trimmed after a step that "
        "ends well above its warmed-up size, so host memory stays flat over a long run; "
        "--no-host-heap-policy leaves glibc's defaults (as MOEZERO_KEEP_MALLOC=1 does; "
        "a MALLOC_* or GLIBC_TUNABLES variable keeps its own thresholds). moezero's own "
        "flag",
        flag="--host-heap-policy",
    )

    def __post_init__(self):
        self._check_all_choices()
        self._check_schedule_flags()
        for name in ("micro_batch_size", "log_interval", "tensorboard_log_interval", "tensorboard_queue_size"):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        self._require(
            self.global_batch_size is None or self.global_batch_size >= 1, "global_batch_size", "must be >= 1"
        )
        self._require(self.train_iters is None or self.train_iters >= 1, "train_iters", "must be >= 1")
        self._require(self.dist_timeout_minutes > 0, "dist_timeout_minutes", "must be > 0")
        for name in ("lr_warmup_iters", "lr_warmup_samples", "eval_interval", "eval_iters", "exit_interval"):
            self._require(getattr(self, name) >= 0, name, "must be >= 0")
        for name in ("lr_decay_iters", "lr_decay_samples"):
            self._require(getattr(self, name) is None or getattr(self, name) >= 1, name, "must be >= 1")
        if self.lr_warmup_fraction is not None:
            self._require(0.0 <= self.lr_warmup_fraction <= 1.0, "lr_warmup_fraction", "must be in [0, 1]")
        if self.exit_duration_in_mins is not None:
            self._require(self.exit_duration_in_mins > 0, "exit_duration_in_mins", "must be > 0")
        self._require(self.lr > 0, "lr", "must be > 0")
        self._require(0 <= self.min_lr <= self.lr, "min_lr", f"must be between 0 and --lr ({self.lr})")
        self._require(self.lr_warmup_init <= self.lr, "lr_warmup_init", f"must be <= --lr ({self.lr})")
        if self.decoupled_lr is not None:
            low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            self._require(
                0 <= low <= self.decoupled_lr and self.lr_warmup_init <= self.decoupled_lr,
                "decoupled_lr",
                "must be >= --decoupled-min-lr (or --min-lr) and --lr-warmup-init",
            )
        self._require(
            not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
            "override_opt_param_scheduler",
            "give it or --use-checkpoint-opt_param-scheduler, not both",
        )
        self._require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        self._check_weight_decay_increment()
        self._check_muon()
        self._require(not (self.bf16 and self.fp16), "fp16", "cannot be combined with --bf16")
        self._require(not (self.fp64 and (self.bf16 or self.fp16)), "fp64", "cannot be combined with --bf16/--fp16")
        if self.global_batch_size is not None:  # else once the number of processes is known
            self._check_batch_dependent()
        if self.wandb_project:
            self._require(self.wandb_exp_name != "", "wandb_exp_name", "give the W&B run a name (Megatron's rule)")

    def _check_muon(self) -> None:
        """Muon's values (Megatron's own checks are asserts or torch's errors deep in the first step)."""
        from moezero.zero import check_muon_settings  # the optimizer's checks, in the flags' words

        try:
            check_muon_settings(
                self.muon_momentum,
                self.muon_scale_mode,
                self.muon_num_ns_steps,
                self.muon_coefficient_type,
                self.muon_fp32_matmul_prec,
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if self.muon_scalar_optimizer != "adam":
            raise ConfigError(
                f"--muon-scalar-optimizer {self.muon_scalar_optimizer}: not supported (moezero has no Lion)"
            )

    def _check_weight_decay_increment(self) -> None:
        """Megatron's validate_args: a constant weight decay is --weight-decay's; an increment needs both ends."""
        given = [f for f in ("start_weight_decay", "end_weight_decay") if getattr(self, f) is not None]
        if self.weight_decay_incr_style == "constant":
            self._require(
                not given,
                given[0] if given else "start_weight_decay",
                "only with --weight-decay-incr-style linear or cosine (a constant one is --weight-decay)",
            )
            return
        for name in ("start_weight_decay", "end_weight_decay"):
            self._require(
                getattr(self, name) is not None and getattr(self, name) >= 0,
                name,
                f"a value >= 0 is needed with --weight-decay-incr-style {self.weight_decay_incr_style}",
            )
        self._require(
            self.end_weight_decay >= self.start_weight_decay,
            "end_weight_decay",
            f"must be >= --start-weight-decay ({self.start_weight_decay}): the weight decay increases "
            "(Megatron's scheduler asserts it)",
        )

    def resolve_global_batch_size(self, data_parallel_size: int) -> bool:
        """Megatron's default when --global-batch-size is not given (nor a step schedule): --micro-batch-size x
        the data-parallel size (the number of processes here); returns whether it was defaulted."""
        if self.global_batch_size is not None:
            return False
        self.global_batch_size = self.micro_batch_size * data_parallel_size
        self._check_batch_dependent()
        return True

    def _check_batch_dependent(self) -> None:
        self._check_ramp_sizes()
        self._check_sample_counts()
        self._check_lr_schedule()

    def _check_batch_ramps(self) -> None:
        """--global-batch-size: given, or a step schedule's last size (else resolve_global_batch_size)."""
        self._require(
            not (self.rampup_batch_size and self.step_batch_size_schedule),
            "rampup_batch_size",
            "give --rampup-batch-size or --step-batch-size-schedule, not both",
        )
        if self.step_batch_size_schedule:
            try:
                final = parse_step_schedule(self.step_batch_size_schedule, 1)[-1][1]
            except ValueError as exc:
                self._fail("step_batch_size_schedule", str(exc))
            self._require(
                self.global_batch_size in (None, final),
                "global_batch_size",
                f"the --step-batch-size-schedule ends at {final}: give that, or leave it out",
            )
            self.global_batch_size = final

    def _check_ramp_sizes(self) -> None:
        if self.rampup_batch_size:
            start, increment, samples = self.rampup_batch_size
            self._require(
                1 <= start <= self.global_batch_size and increment >= 1 and samples >= 0,
                "rampup_batch_size",
                "START (<= --global-batch-size) and INCREMENT must be >= 1, SAMPLES >= 0",
            )
            self._require(
                (self.global_batch_size - start) % increment == 0,
                "rampup_batch_size",
                f"INCREMENT must divide --global-batch-size - START ({self.global_batch_size - start})",
            )

    @property
    def evaluates(self) -> bool:
        """Whether validation runs (Megatron's do_valid: --eval-iters above 0, and --eval-interval too unless
        --skip-train)."""
        return self.eval_iters > 0 and (self.eval_interval > 0 or self.skip_train)

    @property
    def ramps_batch_size(self) -> bool:
        return bool(self.rampup_batch_size or self.step_batch_size_schedule)

    def _check_schedule_flags(self) -> None:
        """Megatron's rules: a run counts iterations or samples; one warmup flag; defaults filled in here."""
        self._check_batch_ramps()
        warmups = [n for n in ("lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction") if getattr(self, n)]
        self._require(
            len(warmups) <= 1,
            warmups[-1] if warmups else "lr_warmup_iters",
            "give one of --lr-warmup-iters, --lr-warmup-samples, --lr-warmup-fraction",
        )
        if self.train_samples is None:
            for name in ("lr_warmup_samples", "lr_decay_samples"):
                self._require(not getattr(self, name), name, "needs --train-samples (or use the *-iters flag)")
            self.train_iters = 200 if self.train_iters is None else self.train_iters
            return
        for name in ("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters"):
            self._require(
                not getattr(self, name),
                name,
                "counts iterations; with --train-samples use the *-samples flag or --lr-warmup-fraction",
            )

    def _check_sample_counts(self) -> None:
        """A --train-samples run: its --train-iters (without a ramp) from the global batch."""
        if self.train_samples is None:
            return
        self._require(
            self.train_samples >= self.global_batch_size,
            "train_samples",
            f"must be >= --global-batch-size ({self.global_batch_size})",
        )
        self._require(
            self.train_iters is None
            or not self.ramps_batch_size
            and self.train_iters == self.train_samples // self.global_batch_size,
            "train_iters",
            "give --train-iters or --train-samples",
        )
        if not self.ramps_batch_size:  # with a ramp, validate() counts the steps the samples take
            self.train_iters = self.train_samples // self.global_batch_size

    def _check_lr_schedule(self) -> None:
        """What Megatron's OptimizerParamScheduler asserts, as one line naming the flag."""
        schedule = LearningRateSchedule.from_config(self)
        warmup = next((n for n in ("lr_warmup_samples", "lr_warmup_fraction") if getattr(self, n)), "lr_warmup_iters")
        self._require(
            schedule.warmup < schedule.decay,
            warmup,
            f"the warmup ({schedule.warmup:g} samples) must end before the decay does ({schedule.decay:g}: "
            "--lr-decay-iters / --lr-decay-samples, else the run's length), as Megatron's scheduler asserts",
        )
        if self.lr_decay_style == "WSD":
            wsd = "lr_wsd_decay_samples" if self.train_samples is not None else "lr_wsd_decay_iters"
            self._require(
                schedule.wsd_decay is not None and schedule.wsd_decay > 0,
                wsd,
                "--lr-decay-style WSD needs the anneal's length (> 0)",
            )


@dataclass
class CheckpointConfig(Validated):
    """Checkpoints: where to save and resume, what to load, how many to keep."""

    section = "checkpoint"
    save: Optional[str] = option(None, "checkpoint directory to save to", flag="--save")
    load: Optional[str] = option(
        None,
        "checkpoint directory (or one iter_N folder) to resume from; it must hold "
        "a checkpoint unless it is also --save (a first run)",
        flag="--load",
    )
    save_interval: int = option(
        0, "save every N steps (0 = only at the end when --save is set)", flag="--save-interval"
    )
    ckpt_step: Optional[int] = option(
        None, "resume from this iteration's checkpoint instead of the latest", flag="--ckpt-step"
    )
    no_load_optim: bool = option(
        False, "load the weights only: fresh optimizer state, loss scale and skip counts", flag="--no-load-optim"
    )
    no_load_rng: bool = option(False, "do not restore the saved random number generator states", flag="--no-load-rng")
    finetune: bool = option(
        False,
        "start a new run from the checkpoint's weights: iteration 0, fresh optimizer, no RNG states, no plug-in states",
        flag="--finetune",
    )
    use_checkpoint_args: bool = option(
        False,
        "take the model-defining flags (sizes, experts, tokenizer type) from "
        "the checkpoint instead of the command line",
        flag="--use-checkpoint-args",
    )
    exit_on_missing_checkpoint: bool = option(
        False,
        "with --load, a missing checkpoint is an error, even where --load is also --save (Megatron's)",
        flag="--exit-on-missing-checkpoint",
    )
    use_tokenizer_model_from_checkpoint_args: bool = option(
        True,
        "with --use-checkpoint-args, the checkpoint's tokenizer files where the command line gives none "
        "(--no-use-tokenizer-model-from-checkpoint-args: never)",
        flag="--use-tokenizer-model-from-checkpoint-args",
    )
    async_save: bool = option(
        False,
        "write checkpoints in the background while training goes on (torch DCP's "
        "async save); published as latest once every rank finished",
        flag="--async-save",
    )
    keep_last: int = option(
        0,
        "keep only the newest N checkpoints in --save (0 = keep all; Megatron has no such flag)",
        flag="--keep-last-checkpoints",
    )
    load_hf: Optional[str] = option(
        None,
        "a Hugging Face model folder to start from (Megatron-Bridge's --hf-model): the model flags, its "
        "training values (dropout, aux loss) and tokenizer as --use-checkpoint-args takes them from an imported "
        "checkpoint (flags typed win); each rank reads only its experts and what ZeRO keeps on it (at stage 3 its "
        "shard). A checkpoint of the run's own in --load is resumed instead (a requeued job goes on)",
        flag="--load-hf",
    )
    save_hf: Optional[str] = option(
        None,
        "write the model as Hugging Face folders DIR/iter_NNNNNNN at the end of "
        "a finished run (and every --save-hf-interval steps), each rank writing its "
        "share; a run stopped early (signal, --exit-*) spends its time on --save's "
        "checkpoint, which resumes it",
        flag="--save-hf",
    )
    save_hf_interval: int = option(
        0, "with --save-hf: also every N steps (0 = only at the end)", flag="--save-hf-interval"
    )
    given_fields: Tuple[str, ...] = option(
        (), "the 'section.field's the command line set (filled by the parser)", flag=None
    )

    def __post_init__(self):
        self._require(self.save_interval >= 0, "save_interval", "must be >= 0")
        self._require(self.keep_last >= 0, "keep_last", "must be >= 0")
        self._require(self.save_hf_interval >= 0, "save_hf_interval", "must be >= 0")
        if self.save_hf_interval:
            self._require(self.save_hf is not None, "save_hf_interval", "needs --save-hf")
        if self.ckpt_step is not None:
            self._require(self.ckpt_step >= 0, "ckpt_step", "must be >= 0")
        for name in ("ckpt_step", "finetune", "use_checkpoint_args"):  # --no-load-*: nothing to not load
            if getattr(self, name) not in (None, False):
                self._require(self.load is not None, name, "needs --load")


CONFIG_CLASSES = (
    ParallelConfig,
    GPTConfig,
    MoEConfig,
    ZeroConfig,
    TrainConfig,
    DataConfig,
    CheckpointConfig,
    ImplementationConfig,
    ProfilingConfig,
)
DESCRIPTION = "Pretrain a GPT Mixture-of-Experts model with ZeRO and expert parallelism (Megatron flag names)."


@dataclass
class Configs:
    parallel: ParallelConfig
    model: GPTConfig
    moe: MoEConfig
    zero: ZeroConfig
    train: TrainConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    implementation: ImplementationConfig = field(default_factory=ImplementationConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)


def _check_muon_run(cfg: Configs) -> None:
    """Megatron's get_megatron_muon_optimizer: no fp16 (no loss scale for Muon)."""
    if cfg.train.optimizer == "muon" and cfg.train.fp16:
        raise ConfigError("--optimizer muon: not with --fp16 (Megatron's Muon runs bf16 or fp32 only)")


def _check_precision_aware(cfg: Configs) -> None:
    """Megatron's: the precision-aware optimizer is Adam's; bf16 main grads are a bf16 run's."""
    if cfg.zero.use_precision_aware_optimizer and cfg.train.optimizer != "adam":
        raise ConfigError(f"--use-precision-aware-optimizer: only with --optimizer adam, not {cfg.train.optimizer}")
    if cfg.zero.main_grads_dtype == "bf16" and not cfg.train.bf16:
        raise ConfigError("--main-grads-dtype bf16: needs --bf16 (the params' gradients are not bf16)")


def _check_shared_expert_bias(cfg: Configs) -> None:
    """megatron-core's SharedExpertMLP asserts add_bias_linear is False: a command line giving a shared expert
    biases (no --disable-bias-linear) is refused as Megatron refuses it (an import says its biases itself)."""
    if cfg.moe.shared_expert_intermediate_size and cfg.moe.bias is None and not cfg.model.disable_bias_linear:
        raise ConfigError(
            f"--moe-shared-expert-intermediate-size={cfg.moe.shared_expert_intermediate_size}: "
            "Megatron's shared experts have no biases (SharedExpertMLP asserts it); give "
            "--disable-bias-linear"
        )


def _check_moe_comm_overlap(cfg: Configs, ep: int) -> None:
    """Megatron's: the overlap is of expert-parallel exchanges."""
    if cfg.moe.delay_wgrad_compute and not cfg.train.overlap_moe_expert_parallel_comm:
        raise ConfigError("--delay-wgrad-compute: needs --overlap-moe-expert-parallel-comm (Megatron's rule)")
    if cfg.train.overlap_moe_expert_parallel_comm and ep < 2:
        raise ConfigError(
            "--overlap-moe-expert-parallel-comm: needs --expert-model-parallel-size > 1 (it overlaps "
            "the expert-parallel exchanges; Megatron's rule)"
        )


def interleaves_micro_batches(cfg: Configs) -> bool:
    """Whether the training step runs micro-batches in interleaved pairs (--overlap-moe-expert-parallel-comm). Not
    at ZeRO stage 3, which gathers a layer's params around its forward, one forward at a time: there the pairs run
    one after the other (the same numbers), and the log says so."""
    return cfg.train.overlap_moe_expert_parallel_comm and cfg.zero.stage != 3


def recompute_notices(cfg: Configs) -> List[str]:
    """Lines for the run's log: the --recompute-modules parts moezero keeps in memory instead."""
    kept = [m for m in cfg.model.recompute_modules or [] if m in RECOMPUTE_KEPT]
    if not kept or cfg.model.recompute_granularity != "selective":
        return []
    return [f" --recompute-modules {' '.join(kept)}: kept in memory here, not recomputed (the numbers are the same)"]


def moe_comm_overlap_notices(cfg: Configs) -> List[str]:
    """Lines for the run's log: the layers whose exchanges the overlap leaves out (recomputed ones run whole)."""
    if not cfg.train.overlap_moe_expert_parallel_comm:
        return []
    if not interleaves_micro_batches(cfg):
        chosen_by = (
            "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
            if cfg.zero.use_megatron_fsdp
            else "--zero-stage 3"
        )
        return [
            f" --overlap-moe-expert-parallel-comm: with {chosen_by} (ZeRO stage 3, which gathers each layer's "
            "params around one forward at a time) the micro-batches run one after the other, their exchanges not "
            "overlapped (the same numbers)"
        ]
    recomputed = []
    if cfg.model.recompute_granularity == "full":
        recomputed.append(f"--recompute-granularity full (--recompute-method {cfg.model.recompute_method})")
    if cfg.model.moe_layer_recompute:
        recomputed.append("--moe-layer-recompute")
    elif cfg.model.recomputes("moe"):
        recomputed.append("--recompute-modules moe")
    return [
        f" --overlap-moe-expert-parallel-comm: the layers {flags} recomputes run whole, their exchanges not "
        "overlapped with the other micro-batch's compute"
        for flags in recomputed
    ]


def validate(
    cfg: Configs, world_size: int, start_iteration: int = 0, consumed_samples: int = 0, new_model: bool = True
) -> int:
    """Checks across configs for a run that starts at `start_iteration` having consumed `consumed_samples`
    (a resume); returns micro-steps per optimizer step. Raises ConfigError naming the flags. `new_model`: no
    checkpoint defines the model (what Megatron would not build is refused only then, so an older run resumes).

    A --train-samples run gets its --train-iters here: the steps from where it starts to the samples.
    With --pipeline-model-parallel-size (pp), --context-parallel-size (cp) and --tensor-model-parallel-size (tp) the
    data-parallel size is world_size / (pp cp tp): it deals the batch."""
    plan = check_pipeline_run(cfg)
    check_context_parallel_run(cfg, world_size)
    check_tensor_parallel_run(cfg, world_size)
    ep = cfg.parallel.expert_parallel_size
    if plan.pp > 1:  # Megatron's folding of the ranks: one line for sizes it refuses
        pipeline_rank_layout(
            world_size,
            ep,
            plan.pp,
            cfg.parallel.use_tp_pp_dp_mapping,
            cfg.parallel.context_parallel_size,
            cfg.parallel.tensor_parallel_size,
            cfg.parallel.expert_tensor_parallel if cfg.moe.num_experts is not None else 1,
        )
    # ranks reading distinct micro-batches
    dp_size = world_size // plan.pp // cfg.parallel.context_parallel_size // cfg.parallel.tensor_parallel_size
    cfg.train.resolve_global_batch_size(dp_size)
    try:
        rank_layout(world_size // plan.pp, ep)
    except ValueError:
        raise ConfigError(f"--expert-model-parallel-size={ep}: must divide the number of processes ({world_size})")
    if cfg.moe.num_experts is None:
        if ep > 1:
            raise ConfigError(
                f"--expert-model-parallel-size={ep}: needs --num-experts (without it the model is a dense GPT)"
            )
    else:
        check_experts_divide(cfg.moe.num_experts, ep)
    schedule = BatchSchedule.from_config(cfg.train, cfg.model.seq_length)
    for size in schedule.sizes_from(consumed_samples):  # each batch still to come splits into micro-steps
        try:
            plan.check_num_microbatches(num_micro_steps(size, cfg.train.micro_batch_size, dp_size))
        except ConfigError as exc:
            flag = "--global-batch-size" if schedule.is_constant else "the batch-size ramp"
            raise ConfigError(f"{flag}: a global batch of {size}: {exc}") from None
    if cfg.train.train_samples is not None:
        cfg.train.train_iters = start_iteration + schedule.iterations_between(consumed_samples, cfg.train.train_samples)
    check_router(cfg)
    check_accepted_megatron_flags(cfg)
    check_megatron_combinations(cfg)
    check_gpu_execution_flags(cfg)
    if new_model:
        _check_shared_expert_bias(cfg)
    _check_moe_comm_overlap(cfg, ep)
    if cfg.train.wandb_project and not (cfg.train.wandb_save_dir or cfg.checkpoint.save):
        raise ConfigError(
            f"--wandb-project={cfg.train.wandb_project}: needs --wandb-save-dir or --save (the run is "
            "written under <--save>/wandb by default, as Megatron's)"
        )
    _check_precision_aware(cfg)
    _check_muon_run(cfg)
    check_profiling(cfg.profiling, cfg.train.tensorboard_dir)
    if cfg.train.evaluates and cfg.data.split_weights[1] == 0:
        raise ConfigError(
            f"--eval-interval={cfg.train.eval_interval}: needs a validation split, but --split="
            f"{cfg.data.split} gives it weight 0 (use --eval-interval 0 or a split like 969,30,1)"
        )
    return num_micro_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, dp_size)
