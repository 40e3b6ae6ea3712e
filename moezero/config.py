"""Configuration dataclasses.

Each field declares its command-line flag once, in its metadata (`option(...)`), with a
one-line help that doubles as the field's documentation. `moezero.training.args` builds
the argparse parser from these declarations: the argparse dest of a field is
"<section>.<field name>", so a parsed namespace turns into configs with no renaming.

Validation lives in `__post_init__` and raises `ConfigError` naming the offending flag,
its value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag and what is allowed."""


def option(default: Any = dataclasses.MISSING, help: str = "", *, flag: Optional[str] = "",
           choices: Optional[tuple] = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field with its command-line flag.

    flag="" derives the flag from the field name (`top_k` -> `--top-k`); flag=None keeps the
    field off the command line (it is filled in by code, e.g. MoEConfig.hidden_size).
    """
    metadata = {"flag": flag, "help": help, "choices": choices}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def flag_of(cls_or_obj: Any, name: str) -> str:
    """The command-line flag of field `name` (or the bare name when it has none)."""
    for f in dataclasses.fields(cls_or_obj):
        if f.name == name:
            flag = f.metadata.get("flag", "")
            if flag is None:
                return name
            return flag or "--" + name.replace("_", "-")
    raise KeyError(name)


def check_experts_divide(num_experts: int, expert_parallel_size: int) -> None:
    """Each ep rank holds num_experts / ep experts (the one check of it: training, MoELayer, inference)."""
    if num_experts % expert_parallel_size:
        raise ConfigError(f"--num-experts={num_experts}: must be divisible by "
                          f"--expert-model-parallel-size ({expert_parallel_size})")


class Validated:
    """Mixin: helpers for `__post_init__` checks whose messages name the flag."""

    def _fail(self, name: str, message: str) -> None:
        value = getattr(self, name)
        raise ConfigError(f"{flag_of(self, name)}={value!r}: {message}")

    def _require(self, condition: bool, name: str, message: str) -> None:
        if not condition:
            self._fail(name, message)

    def _check_choice(self, name: str) -> None:
        choices = next(f.metadata["choices"] for f in dataclasses.fields(self) if f.name == name)
        value = getattr(self, name)
        if value not in choices:
            self._fail(name, f"must be one of {', '.join(map(str, choices))}")

    def _check_all_choices(self) -> None:
        for f in dataclasses.fields(self):
            if f.metadata.get("choices") and getattr(self, f.name) is not None:
                self._check_choice(f.name)


@dataclass
class ParallelConfig(Validated):
    """How ranks are laid out."""

    section = "parallel"
    expert_parallel_size: int = option(1, "ranks that share one copy of the experts (all-to-all group)",
                                       flag="--expert-model-parallel-size")

    def __post_init__(self):
        self._require(self.expert_parallel_size >= 1, "expert_parallel_size", "must be >= 1")


@dataclass
class MoEConfig(Validated):
    """One MoE layer: router, dispatcher and experts (Megatron-Core flag names)."""

    section = "moe"
    hidden_size: int = option(64, "model width (taken from --hidden-size)", flag=None)
    ffn_hidden_size: Optional[int] = option(None, "expert FFN width (default: the dense --ffn-hidden-size)",
                                            flag="--moe-ffn-hidden-size")
    num_experts: int = option(8, "number of routed experts", flag="--num-experts")
    top_k: int = option(2, "experts per token", flag="--moe-router-topk")
    score_function: str = option("softmax", "router score function", flag="--moe-router-score-function",
                                 choices=("softmax", "sigmoid"))
    pre_softmax: bool = option(False, "softmax over all experts before top-k (no top-k renormalisation)",
                               flag="--moe-router-pre-softmax")
    topk_scaling_factor: Optional[float] = option(None, "scale applied to the top-k weights",
                                                  flag="--moe-router-topk-scaling-factor")
    load_balancing_type: str = option("aux_loss", "aux loss scope: micro-batch, per sequence, or none",
                                      flag="--moe-router-load-balancing-type",
                                      choices=("aux_loss", "seq_aux_loss", "none"))
    aux_loss_coeff: float = option(1e-2, "load-balancing aux loss coefficient", flag="--moe-aux-loss-coeff")
    z_loss_coeff: Optional[float] = option(None, "router z-loss coefficient", flag="--moe-z-loss-coeff")
    capacity_factor: Optional[float] = option(None, "expert capacity factor; None = dropless",
                                              flag="--moe-expert-capacity-factor")
    token_drop_policy: str = option("probs", "which tokens an over-capacity expert keeps: highest routing "
                                    "probability, or earliest position", flag="--moe-token-drop-policy",
                                    choices=("probs", "position"))
    input_jitter_eps: Optional[float] = option(None, "multiplicative uniform jitter on router input in training",
                                               flag="--moe-input-jitter-eps")
    enable_expert_bias: bool = option(False, "aux-loss-free load balancing with a per-expert routing bias",
                                      flag="--moe-router-enable-expert-bias")
    bias_update_rate: float = option(1e-3, "expert bias update rate per optimizer step",
                                     flag="--moe-router-bias-update-rate")
    shared_expert_intermediate_size: Optional[int] = option(
        None, "FFN width of the shared expert(s) every token passes through",
        flag="--moe-shared-expert-intermediate-size")
    activation: str = option("gelu", "expert activation (taken from --swiglu)", flag=None,
                             choices=("gelu", "swiglu"))
    grouped_gemm: bool = option(True, "run local experts as one grouped GEMM (else a per-expert loop)",
                                flag="--moe-grouped-gemm")
    init_std: float = option(0.02, "std of the normal init (taken from --init-method-std)", flag=None)
    init_seed: int = option(0, "seed of the layout-invariant init (taken from --seed)", flag=None)

    def __post_init__(self):
        self._check_all_choices()
        self._require(self.hidden_size >= 1, "hidden_size", "must be >= 1")
        if self.ffn_hidden_size is not None:  # None: derived (a GPT's dense width, else 4 * hidden)
            self._require(self.ffn_hidden_size >= 1, "ffn_hidden_size", "must be >= 1")
        self._require(self.num_experts >= 1, "num_experts", "must be >= 1")
        self._require(1 <= self.top_k <= self.num_experts, "top_k",
                      f"must be between 1 and --num-experts ({self.num_experts})")
        if self.capacity_factor is not None:
            self._require(self.capacity_factor > 0 and math.isfinite(self.capacity_factor), "capacity_factor",
                          "must be > 0 (or unset for dropless routing)")
        self._require(self.aux_loss_coeff >= 0, "aux_loss_coeff", "must be >= 0")
        if self.z_loss_coeff is not None:
            self._require(self.z_loss_coeff >= 0, "z_loss_coeff", "must be >= 0")
        if self.input_jitter_eps is not None:
            self._require(0 < self.input_jitter_eps < 1, "input_jitter_eps", "must be in (0, 1)")
        if self.shared_expert_intermediate_size is not None:
            self._require(self.shared_expert_intermediate_size >= 1, "shared_expert_intermediate_size",
                          "must be >= 1")
        self._require(self.bias_update_rate >= 0, "bias_update_rate", "must be >= 0")


@dataclass
class GPTConfig(Validated):
    """The GPT decoder."""

    section = "model"
    num_layers: int = option(4, "transformer layers", flag="--num-layers")
    hidden_size: int = option(128, "model width", flag="--hidden-size")
    num_attention_heads: int = option(4, "attention heads", flag="--num-attention-heads")
    ffn_hidden_size: Optional[int] = option(None, "dense MLP width (default 4 * hidden)", flag="--ffn-hidden-size")
    seq_length: int = option(256, "tokens per sample", flag="--seq-length")
    max_position_embeddings: Optional[int] = option(None, "learned position table size (default --seq-length)",
                                                    flag="--max-position-embeddings")
    vocab_size: Optional[int] = option(None, "vocabulary size (default: the tokenizer's, padded to 128)",
                                       flag="--vocab-size")
    position_embedding_type: str = option("learned_absolute", "position encoding",
                                          flag="--position-embedding-type", choices=("learned_absolute", "rope"))
    rotary_base: float = option(10000.0, "RoPE base", flag="--rotary-base")
    untie_embeddings_and_output_weights: bool = option(False, "separate output layer instead of tied embeddings",
                                                       flag="--untie-embeddings-and-output-weights")
    normalization: str = option("LayerNorm", "norm layer", flag="--normalization", choices=("LayerNorm", "RMSNorm"))
    swiglu: bool = option(False, "SwiGLU MLPs and experts instead of GELU", flag="--swiglu")
    hidden_dropout: float = option(0.0, "dropout on residual branches", flag="--hidden-dropout")
    attention_dropout: float = option(0.0, "dropout on attention probabilities", flag="--attention-dropout")
    init_method_std: float = option(0.02, "std of the normal init", flag="--init-method-std")
    moe_layer_freq: int = option(2, "layers 0, N, 2N, ... have an MoE MLP (Megatron's pattern); 1 = all layers",
                                 flag="--moe-layer-freq")
    recompute_activations: bool = option(False, "non-reentrant activation checkpointing of each layer",
                                         flag="--recompute-activations")

    def __post_init__(self):
        self._check_all_choices()
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "moe_layer_freq"):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        self._require(self.hidden_size % self.num_attention_heads == 0, "hidden_size",
                      f"must be divisible by --num-attention-heads ({self.num_attention_heads})")
        if self.position_embedding_type == "rope":
            self._require((self.hidden_size // self.num_attention_heads) % 2 == 0, "hidden_size",
                          "rope needs an even head dimension (--hidden-size / --num-attention-heads)")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        self._require(self.max_position_embeddings >= self.seq_length, "max_position_embeddings",
                      f"must be >= --seq-length ({self.seq_length})")
        for name in ("hidden_dropout", "attention_dropout"):
            self._require(0.0 <= getattr(self, name) < 1.0, name, "must be in [0, 1)")


def expert_ffn_size(moe: MoEConfig) -> int:
    """The experts' FFN width: --moe-ffn-hidden-size, else 4 * hidden (inside a GPT: its dense width)."""
    return moe.ffn_hidden_size or 4 * moe.hidden_size


def moe_layer_config(gpt: GPTConfig, moe: MoEConfig, seed: int) -> MoEConfig:
    """The MoE layers' config inside a GPT: `moe` with the fields the model decides (width, activation, init)."""
    return dataclasses.replace(moe, hidden_size=gpt.hidden_size,
                               ffn_hidden_size=moe.ffn_hidden_size or gpt.ffn_hidden_size,
                               activation="swiglu" if gpt.swiglu else "gelu", init_std=gpt.init_method_std,
                               init_seed=seed)


@dataclass
class ZeroConfig(Validated):
    """The ZeRO optimizer wrapper and mixed precision."""

    section = "zero"
    stage: int = option(2, "0 = data parallel, 1 = sharded optimizer state, 2 = + sharded gradients, "
                        "3 = + sharded params", flag="--zero-stage", choices=(0, 1, 2, 3))
    bucket_size: int = option(2_000_000, "elements per gradient bucket", flag="--ddp-bucket-size")
    overlap_comm: bool = option(True, "reduce buckets during backward", flag="--overlap-grad-reduce")
    grad_reduce_dtype: str = option("fp32", "dtype gradients are reduced in", flag="--grad-reduce-dtype",
                                    choices=("fp32", "bf16", "fp64"))
    clip_grad: float = option(1.0, "clip the global grad norm to this (0 = off)", flag="--clip-grad")
    max_skipped_steps: int = option(20, "fail after this many non-finite steps in a row",
                                    flag="--max-consecutive-skipped-steps")
    initial_loss_scale: float = option(2.0 ** 16, "fp16 initial dynamic loss scale", flag="--initial-loss-scale")
    min_loss_scale: float = option(1.0, "fp16 minimum loss scale", flag="--min-loss-scale")
    loss_scale_window: int = option(1000, "fp16 steps without overflow before the scale doubles",
                                    flag="--loss-scale-window")
    hysteresis: int = option(2, "fp16 overflows tolerated before the scale halves", flag="--hysteresis")

    def __post_init__(self):
        self._check_all_choices()
        self._require(self.bucket_size >= 1, "bucket_size", "must be >= 1")
        self._require(self.clip_grad >= 0, "clip_grad", "must be >= 0")
        self._require(self.max_skipped_steps >= 1, "max_skipped_steps", "must be >= 1")
        self._require(self.initial_loss_scale > 0, "initial_loss_scale", "must be > 0")
        self._require(self.min_loss_scale > 0, "min_loss_scale", "must be > 0")
        self._require(self.loss_scale_window >= 1, "loss_scale_window", "must be >= 1")
        self._require(self.hysteresis >= 1, "hysteresis", "must be >= 1")


@dataclass
class DataConfig(Validated):
    """Training data: Megatron indexed datasets, or the built-in standard-library corpus."""

    section = "data"
    data_path: Optional[str] = option(None, "dataset prefix(es) '[w1] p1 [w2] p2 ...' of .bin/.idx files "
                                      "(default: the Python standard library tokenized into a cache)",
                                      flag="--data-path")
    split: str = option("969,30,1", "train,valid,test split weights", flag="--split")
    tokenizer_type: str = option("ByteLevelTokenizer", "tokenizer", flag="--tokenizer-type",
                                 choices=("ByteLevelTokenizer", "HuggingFaceTokenizer"))
    tokenizer_model: Optional[str] = option(None, "local HuggingFace tokenizer path", flag="--tokenizer-model")
    data_cache_path: Optional[str] = option(None, "where dataset indices and the default corpus are cached",
                                            flag="--data-cache-path")
    default_corpus_max_files: int = option(400, "files of the standard library in the default corpus",
                                           flag="--default-corpus-max-files")

    def __post_init__(self):
        self._check_all_choices()
        parts = [p.strip() for p in re.split("[,/]", self.split)]
        self.split = ",".join(parts)  # Megatron accepts "," and "/"; everything downstream reads commas
        try:
            weights = self.split_weights if len(parts) <= 3 else ()
        except ValueError:
            weights = ()
        self._require(bool(weights) and all(w >= 0 for w in weights) and sum(weights) > 0,
                      "split", "must be up to three non-negative weights like 969,30,1")
        if self.tokenizer_type == "HuggingFaceTokenizer":
            self._require(self.tokenizer_model is not None, "tokenizer_type",
                          "HuggingFaceTokenizer needs --tokenizer-model (a local path)")
        self._require(self.default_corpus_max_files >= 1, "default_corpus_max_files", "must be >= 1")

    @property
    def split_weights(self) -> Tuple[float, float, float]:
        """(train, valid, test) weights of --split; missing trailing ones are 0, as in Megatron."""
        weights = [float(p) for p in self.split.split(",")]
        return tuple(weights + [0.0] * (3 - len(weights)))


@dataclass
class TrainConfig(Validated):
    """Batching, schedule, precision, evaluation, logging and checkpoints."""

    section = "train"
    micro_batch_size: int = option(4, "samples per rank per micro-step", flag="--micro-batch-size")
    global_batch_size: int = option(16, "samples per optimizer step, over all ranks", flag="--global-batch-size")
    train_iters: int = option(200, "optimizer steps", flag="--train-iters")
    lr: float = option(2e-3, "peak learning rate", flag="--lr")
    min_lr: float = option(1e-4, "learning rate at the end of the decay", flag="--min-lr")
    lr_warmup_iters: int = option(20, "linear warmup steps", flag="--lr-warmup-iters")
    lr_decay_iters: Optional[int] = option(None, "decay length (default --train-iters)", flag="--lr-decay-iters")
    lr_decay_style: str = option("cosine", "decay after warmup", flag="--lr-decay-style",
                                 choices=("constant", "linear", "cosine"))
    optimizer: str = option("adam", "adam = AdamW (decoupled weight decay), sgd = SGD with momentum",
                            flag="--optimizer", choices=("adam", "sgd"))
    weight_decay: float = option(0.01, "weight decay (not applied to biases, norms, embeddings)",
                                 flag="--weight-decay")
    adam_beta1: float = option(0.9, "Adam beta1", flag="--adam-beta1")
    adam_beta2: float = option(0.95, "Adam beta2", flag="--adam-beta2")
    adam_eps: float = option(1e-8, "Adam epsilon", flag="--adam-eps")
    sgd_momentum: float = option(0.9, "SGD momentum", flag="--sgd-momentum")
    bf16: bool = option(False, "bf16 params and activations, fp32 master weights", flag="--bf16")
    fp16: bool = option(False, "fp16 params with dynamic loss scaling, fp32 master weights", flag="--fp16")
    fp64: bool = option(False, "float64 params and activations, for numerics checks (slow)", flag="--fp64")
    seed: int = option(1234, "seed for init, data order, dropout and jitter", flag="--seed")
    eval_interval: int = option(50, "evaluate every N steps (0 = never)", flag="--eval-interval")
    eval_iters: int = option(4, "global batches per evaluation", flag="--eval-iters")
    log_interval: int = option(10, "console and TensorBoard every N steps", flag="--log-interval")
    tensorboard_dir: Optional[str] = option(None, "TensorBoard event directory", flag="--tensorboard-dir")
    save: Optional[str] = option(None, "checkpoint directory to save to", flag="--save")
    load: Optional[str] = option(None, "checkpoint directory to resume from", flag="--load")
    save_interval: int = option(0, "save every N steps (0 = only at the end when --save is set)",
                                flag="--save-interval")
    exit_interval: int = option(0, "stop (after saving, when --save is set) once the iteration is a multiple "
                                "of N (0 = run to --train-iters)", flag="--exit-interval")
    dist_timeout_s: int = option(120, "seconds a collective may wait before a dead peer fails the job",
                                 flag="--distributed-timeout-seconds")

    def __post_init__(self):
        self._check_all_choices()
        for name in ("micro_batch_size", "global_batch_size", "train_iters", "eval_iters", "log_interval",
                     "dist_timeout_s"):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        for name in ("lr_warmup_iters", "eval_interval", "save_interval", "exit_interval"):
            self._require(getattr(self, name) >= 0, name, "must be >= 0")
        self._require(self.lr > 0, "lr", "must be > 0")
        self._require(0 <= self.min_lr <= self.lr, "min_lr", f"must be between 0 and --lr ({self.lr})")
        self._require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        self._require(not (self.bf16 and self.fp16), "fp16", "cannot be combined with --bf16")
        self._require(not (self.fp64 and (self.bf16 or self.fp16)), "fp64", "cannot be combined with --bf16/--fp16")
        if self.lr_decay_iters is not None:
            self._require(self.lr_decay_iters >= 1, "lr_decay_iters", "must be >= 1")
