"""What a pretraining run is made of, each built by one function from the configs.

data  = build_data(cfg, dataset_sizes(cfg, start_iteration, progress))
model = build_model(cfg, groups, data.tokenizer.vocab_size)    # built, expert-parallel, cast, placed
opt   = build_optimizer(model, cfg, groups)                     # after any plug-in reparametrized it
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from moezero.config import ConfigError
from moezero.data import build_datasets
from moezero.hf import CheckpointMismatch, UnsupportedModel, load_hub_weights
from moezero.models import GPTModel
from moezero.moe import expert_parallel
from moezero.parallel import ParallelGroups
from moezero.context_parallel import ContextParallel
from moezero.deferred_values import materialize
from moezero.training.batch_schedule import BatchSchedule
from moezero.training.configs import Configs, TrainConfig
from moezero.training.tensor_parallel import apply_tensor_parallel
from moezero.training.resume import Progress
from moezero.zero import STATE_DTYPES, Muon, PrecisionAwareAdam, ZeroOptimizer, muon_param_groups, weight_decay_groups


def build_data(cfg: Configs, sizes: Tuple[int, int, int]):
    """The train, validation and test splits with `sizes` samples each (0: not built); see `dataset_sizes`."""
    return build_datasets(cfg.data, cfg.model.seq_length, cfg.train.seed, num_samples=sizes)


def dataset_sizes(cfg: Configs, start_iteration: int, progress: Progress) -> Tuple[int, int, int]:
    """Samples per split (Megatron's figures, or more where a resume needs them): train for every step
    (the size a resumed run was built with, if it suffices: the sample order depends on it), validation
    for every evaluation, test for the final one (when --split gives the test split a weight)."""
    t = cfg.train
    schedule = BatchSchedule.from_config(t, cfg.model.seq_length)
    needed = schedule.consumed_after(progress.consumed_train_samples, t.train_iters - start_iteration)
    if needed <= progress.train_dataset_samples:
        train = progress.train_dataset_samples
    else:
        train = max(t.train_samples or t.train_iters * t.global_batch_size, needed)
    valid, per_evaluation = 0, t.eval_iters * t.global_batch_size
    if t.evaluates and t.skip_train:  # one evaluation, from the split's start
        valid = per_evaluation
    elif t.evaluates:
        # every --eval-interval, and once more after training (Megatron's)
        evaluations = sum(1 for i in range(start_iteration + 1, t.train_iters + 1) if i % t.eval_interval == 0) + 1
        valid = max(
            (t.train_iters // t.eval_interval + 1) * per_evaluation,
            progress.consumed_valid_samples + evaluations * per_evaluation,
        )
    test = per_evaluation if cfg.data.split_weights[2] > 0 else 0
    return train, valid, test


def padded_vocab_size(cfg: Configs, tokenizer_vocab: int, tensor_parallel_size: Optional[int] = None) -> int:
    """The model's vocabulary: a config's own (a checkpoint's), or the tokenizer's (at least --vocab-size)
    rounded up to a multiple of --make-vocab-size-divisible-by x --tensor-model-parallel-size (Megatron's padding:
    the padded vocabulary changes with tp unless it is already such a multiple; a checkpoint's is kept).
    `tensor_parallel_size`: the one at another tp than the run's (--save-hf writes tp 1's)."""
    if cfg.model.vocab_size is not None:
        if cfg.model.vocab_size < tokenizer_vocab:
            raise ConfigError(
                f"the model's vocabulary ({cfg.model.vocab_size}) is smaller than the tokenizer's ({tokenizer_vocab})"
            )
        return cfg.model.vocab_size
    multiple = cfg.model.make_vocab_size_divisible_by * (tensor_parallel_size or cfg.parallel.tensor_parallel_size)
    return math.ceil(max(tokenizer_vocab, cfg.data.vocab_size or 0) / multiple) * multiple


def param_dtype(train: TrainConfig) -> torch.dtype:
    if train.bf16:
        return torch.bfloat16
    if train.fp16:
        return torch.float16
    return torch.float64 if train.fp64 else torch.float32


def build_model(
    cfg: Configs,
    groups: ParallelGroups,
    tokenizer_vocab: int,
    hub_dir: Optional[str] = None,
    context_parallel: Optional[ContextParallel] = None,
) -> GPTModel:
    """The GPT(-MoE) with this rank's experts, in the params' dtype, on the device the backend uses; with
    `hub_dir` (--load-hf) its weights are that Hugging Face folder's, read lazily (see load_hub_weights).
    `context_parallel`: the rank holds a part of each sequence (moezero/context_parallel.py)."""
    gpt = dataclasses.replace(cfg.model, vocab_size=padded_vocab_size(cfg, tokenizer_vocab))
    moe = cfg.moe if cfg.moe.num_experts is not None else None  # no --num-experts: a dense GPT, as Megatron's
    with torch.device("meta") if hub_dir else contextlib.nullcontext():
        model = GPTModel(
            gpt, moe, seed=cfg.train.seed, moe_layer=expert_parallel(groups), context_parallel=context_parallel
        )
    model = model.to(param_dtype(cfg.train))
    # the global model's modules swapped for the tensor-parallel ones (their slices of its keyed init)
    with torch.device("meta") if hub_dir else contextlib.nullcontext():  # (--load-hf: the slices stay unread)
        model = apply_tensor_parallel(model, groups.tp, cfg.implementation.sequence_parallel)
    if hub_dir:
        try:
            load_hub_weights(model, hub_dir)
        except (CheckpointMismatch, UnsupportedModel) as exc:  # the files do not hold the configs' model
            raise ConfigError(f"--load-hf={hub_dir}: {exc}") from None
    device = run_device()
    if device is not None:
        model = place_on(model, device)
    return model


def run_device() -> Optional[torch.device]:
    """The GPU the backend uses (nccl), else None (the CPU)."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def place_on(model: GPTModel, device: torch.device) -> GPTModel:
    """The model on `device`; params still deferred to their Hub files (--load-hf) are read there whole first
    (the per-shard read of stage 3 is the CPU path's)."""
    for param in model.parameters():
        materialize(param, device)
    return model.to(device)


def build_optimizer(model: GPTModel, cfg: Configs, groups: ParallelGroups) -> ZeroOptimizer:
    """AdamW or SGD under ZeRO, with Megatron's no-weight-decay groups."""
    cls, kwargs = optimizer_class(cfg)
    return ZeroOptimizer.from_config(
        model,
        cls,
        groups,
        cfg.zero,
        param_groups=optimizer_param_groups(model, cfg.train),
        fp16=cfg.train.fp16,
        lr=cfg.train.lr,
        **kwargs,
    )


def optimizer_param_groups(model: nn.Module, t: TrainConfig) -> List[Dict]:
    """Megatron's param groups of the model (or of a pipeline stage's part of it); with --optimizer muon each split
    in megatron-core's way: Muon for the 2-D weights, Adam for the rest."""
    if t.optimizer == "muon":
        return muon_param_groups(
            model, t.weight_decay, split_qkv=not t.muon_no_split_qkv, base_groups=megatron_param_groups(model, t)
        )
    return megatron_param_groups(model, t)


def optimizer_class(cfg: Configs) -> Tuple[type, Dict]:
    """The inner optimizer's class and keyword arguments (the learning rate aside) from the flags."""
    t, z = cfg.train, cfg.zero
    if t.optimizer == "adam" and z.use_precision_aware_optimizer:
        cls, kwargs = (
            PrecisionAwareAdam,
            dict(
                betas=(t.adam_beta1, t.adam_beta2),
                eps=t.adam_eps,
                master_weight_dtype=STATE_DTYPES[z.main_params_dtype],
                exp_avg_dtype=STATE_DTYPES[z.exp_avg_dtype],
                exp_avg_sq_dtype=STATE_DTYPES[z.exp_avg_sq_dtype],
            ),
        )
    elif t.optimizer == "adam":
        cls, kwargs = torch.optim.AdamW, dict(betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    elif t.optimizer == "muon":
        cls, kwargs = (
            Muon,
            dict(
                betas=(t.adam_beta1, t.adam_beta2),
                eps=t.adam_eps,
                momentum=t.muon_momentum,
                nesterov=t.muon_nesterov,
                scale_mode=t.muon_scale_mode,
                extra_scale_factor=t.muon_extra_scale_factor,
                num_ns_steps=t.muon_num_ns_steps,
                coefficient_type=t.muon_coefficient_type,
                fp32_matmul_prec=t.muon_fp32_matmul_prec,
                tp_mode=t.muon_tp_mode,
            ),
        )
    else:
        cls, kwargs = torch.optim.SGD, dict(momentum=t.sgd_momentum)
    return cls, kwargs


def megatron_param_groups(model: GPTModel, t) -> List[Dict]:
    """Megatron's groups: no weight decay for biases and norms; with --decoupled-lr the embedding and output
    layer (megatron-core's is_embedding_or_output_parameter) in groups of their own max_lr / min_lr."""
    groups = weight_decay_groups(model, t.weight_decay)
    if t.apply_wd_to_qk_layernorm:  # a GPT always has both groups (its embedding is decayed, its norms not)
        groups = _qk_norms_decayed(model, groups)
    if t.decoupled_lr is None:
        return groups
    decoupled = {id(_weight_parameter(m)) for m in (model.embedding, model.output) if m is not None}
    override = {"max_lr": t.decoupled_lr, **({"min_lr": t.decoupled_min_lr} if t.decoupled_min_lr is not None else {})}
    out = []
    for group in groups:
        for own in (False, True):
            params = [p for p in group["params"] if (id(p) in decoupled) == own]
            if params:
                out.append(dict(group, params=params, **(override if own else {})))
    return out


def _qk_norms_decayed(model: nn.Module, groups: List[Dict]) -> List[Dict]:
    """--apply-wd-to-qk-layernorm: megatron-core's get_standard_config_overrides leaves out of its no-decay rule
    the params named `q_layernorm.` or `k_layernorm.` (moezero's q_norm / k_norm; MLA's kv_layernorm, its kv_norm,
    stays undecayed): they move to the decayed group, in the model's order."""
    qk = {id(p) for name, p in model.named_parameters() if ".q_norm." in name or ".k_norm." in name}
    decayed = {id(p) for g in groups if g["wd_mult"] == 1.0 for p in g["params"]} | qk
    out = []
    for group in groups:
        params = [p for p in model.parameters() if (id(p) in decayed) == (group["wd_mult"] == 1.0)]
        out.append(dict(group, params=params))
    return out


def _weight_parameter(module: nn.Module) -> torch.Tensor:
    """module.weight's Parameter, also when a plug-in's parametrization (fake quantization) computes .weight."""
    if parametrize.is_parametrized(module, "weight"):
        return module.parametrizations.weight.original
    return module.weight
