"""GPT-MoE pretraining: configs -> process groups -> data -> model -> ZeRO optimizer -> loop.

Launched by `torchrun --nproc_per_node=N examples_moe/pretrain_gpt_moe.py <Megatron flags>`;
one process without torchrun works too (a world of one).
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from moezero import checkpoint
from moezero.compression import QATConfig, QATController, apply_qat
from moezero.config import (ConfigError, DataConfig, GPTConfig, MoEConfig, ParallelConfig, TrainConfig,
                            ZeroConfig, check_experts_divide)
from moezero.data import DataError, build_datasets, eval_micro_batches, num_micro_steps, train_micro_batches
from moezero.models import GPTModel
from moezero.models.gpt import is_moe_layer
from moezero.moe import expert_parallel
from moezero.moe.expert_bias import ExpertBiasUpdater
from moezero.parallel import ParallelGroups, rank_layout
from moezero.training.args import parse_configs
from moezero.training.logging import Timer, build_logger, format_train_line
from moezero.training.loop import evaluate, expert_load_metrics, train_step
from moezero.training.schedule import learning_rate
from moezero.zero import ZeroOptimizer, weight_decay_groups

CONFIG_CLASSES = (ParallelConfig, GPTConfig, MoEConfig, ZeroConfig, TrainConfig, DataConfig, QATConfig)
DESCRIPTION = "Pretrain a GPT Mixture-of-Experts model with ZeRO and expert parallelism (Megatron flag names)."
VOCAB_MULTIPLE = 128  # Megatron's --make-vocab-size-divisible-by default


class PeerFailure(RuntimeError):
    """A collective failed: another rank died, was killed, or stopped answering."""


@dataclass
class Configs:
    parallel: ParallelConfig
    model: GPTConfig
    moe: MoEConfig
    zero: ZeroConfig
    train: TrainConfig
    data: DataConfig
    qat: QATConfig = dataclasses.field(default_factory=QATConfig)


def validate(cfg: Configs, world_size: int) -> int:
    """Checks across configs; returns micro-steps per optimizer step. Raises ConfigError naming the flags."""
    ep = cfg.parallel.expert_parallel_size
    try:
        rank_layout(world_size, ep)
    except ValueError:
        raise ConfigError(f"--expert-model-parallel-size={ep}: must divide the number of processes ({world_size})")
    check_experts_divide(cfg.moe.num_experts, ep)
    if cfg.model.moe_layer_freq > cfg.model.num_layers:
        raise ConfigError(f"--moe-layer-freq={cfg.model.moe_layer_freq}: larger than --num-layers "
                          f"({cfg.model.num_layers}) is fine in Megatron's pattern only if >= 1 layer is MoE; "
                          "layer 0 always is, so use a value <= --num-layers")
    if cfg.train.eval_interval > 0 and cfg.data.split_weights[1] == 0:
        raise ConfigError(f"--eval-interval={cfg.train.eval_interval}: needs a validation split, but --split="
                          f"{cfg.data.split} gives it weight 0 (use --eval-interval 0 or a split like 969,30,1)")
    return num_micro_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)


def init_distributed(timeout_s: int) -> None:
    """Join the torchrun world (no-op for a single process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


class Pretraining:
    """The whole run; `train()` runs it."""

    def __init__(self, cfg: Configs):
        self.cfg = cfg
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.micro_steps = validate(cfg, self.world)
        self.groups = ParallelGroups.build(expert_parallel_size=cfg.parallel.expert_parallel_size)
        self.rank = self.groups.rank
        self.logger = build_logger(self.rank, cfg.train.tensorboard_dir)
        self.data = self._build_data()
        self.model = self._build_model()
        self.opt = self._build_optimizer()
        self.bias_updater = ExpertBiasUpdater(self.model, self.groups.dp)
        self.iteration = 0
        self.history: List[Dict[str, float]] = []  # per iteration: lm loss, grad norm (and validation loss)
        if cfg.train.load:
            self._resume(cfg.train.load)

    # ---- construction -------------------------------------------------------------------------
    def _build_data(self):
        t = self.cfg.train
        evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 0
        valid = t.eval_iters * t.global_batch_size if evals else 0
        return build_datasets(self.cfg.data, self.cfg.model.seq_length, t.seed,
                              num_samples=(t.train_iters * t.global_batch_size, valid, 0))

    def _build_model(self) -> GPTModel:
        vocab = self.cfg.model.vocab_size or math.ceil(self.data.tokenizer.vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        if vocab < self.data.tokenizer.vocab_size:
            raise ConfigError(f"--vocab-size={vocab}: smaller than the tokenizer's ({self.data.tokenizer.vocab_size})")
        gpt = dataclasses.replace(self.cfg.model, vocab_size=vocab)
        model = GPTModel(gpt, self.cfg.moe, seed=self.cfg.train.seed, moe_layer=expert_parallel(self.groups))
        if self.cfg.train.bf16:
            model = model.bfloat16()
        elif self.cfg.train.fp16:
            model = model.half()
        elif self.cfg.train.fp64:
            model = model.double()
        if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            model = model.cuda()
        # fake quantization in forward; the params themselves stay where the optimizer will put them
        self.qat: Optional[QATController] = apply_qat(model, self.cfg.qat, self.groups, self.cfg.train.seed) \
            if self.cfg.qat.enabled else None
        return model

    def _build_optimizer(self) -> ZeroOptimizer:
        t, z = self.cfg.train, self.cfg.zero
        if t.optimizer == "adam":
            cls, kwargs = torch.optim.AdamW, dict(betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
        else:
            cls, kwargs = torch.optim.SGD, dict(momentum=t.sgd_momentum)
        return ZeroOptimizer.from_config(self.model, cls, self.groups, z,
                                         param_groups=weight_decay_groups(self.model, t.weight_decay),
                                         fp16=t.fp16, lr=t.lr, **kwargs)

    def _resume(self, root: str) -> None:
        iteration = checkpoint.latest_iteration(root) if os.path.isdir(root) else None
        if iteration is None:  # Megatron's behaviour: --load and --save may name the same, new, directory
            self.logger.print(f" WARNING: no checkpoint found in --load={root}; training from scratch")
            return
        state = checkpoint.load_checkpoint(checkpoint.iteration_dir(root, iteration), self.model, self.opt,
                                           self.groups.control)
        self.iteration = state["iteration"]
        if self.qat is not None:
            self.qat.load_state_dict(state.get("qat") or {"step": self.iteration})
        self.logger.print(f" resumed from {checkpoint.iteration_dir(root, iteration)} at iteration {self.iteration}")

    # ---- the loop -----------------------------------------------------------------------------
    def train(self) -> None:
        t = self.cfg.train
        self._print_header()
        tokens_per_step = t.global_batch_size * self.cfg.model.seq_length
        run_timer = Timer()
        start_iteration = self.iteration
        while self.iteration < t.train_iters:
            lr = learning_rate(self.iteration, t)
            for group in self.opt.param_groups:
                group["lr"] = lr
            timer = Timer()
            batches = train_micro_batches(self.iteration, t.global_batch_size, t.micro_batch_size,
                                          self.groups.rank, self.world)
            metrics = train_step(self.model, self.opt, self.data.train, self.iteration, batches, t.seed,
                                 self.bias_updater, self.groups.dp)
            step_time = timer.elapsed()
            self.iteration += 1
            if self.qat is not None:
                self.qat.advance()
            self.history.append({"iteration": self.iteration, "lm_loss": metrics.lm_loss,
                                 "aux_loss": metrics.aux_loss, "grad_norm": metrics.grad_norm})
            done = self.iteration - start_iteration
            eta = run_timer.elapsed() / done * (t.train_iters - self.iteration)
            if self.iteration % t.log_interval == 0 or self.iteration == t.train_iters:
                self._log_step(metrics, lr, step_time, tokens_per_step / step_time, eta)
            if t.eval_interval and (self.iteration % t.eval_interval == 0 or self.iteration == t.train_iters):
                self._evaluate()
            if t.save and t.save_interval and self.iteration % t.save_interval == 0:
                self._save()
            if t.exit_interval and self.iteration % t.exit_interval == 0:
                break
        if t.save and not (t.save_interval and self.iteration % t.save_interval == 0):
            self._save()
        self.logger.close()

    def _log_step(self, m, lr, step_time, tokens_per_s, eta) -> None:
        t = self.cfg.train
        values = {
            "consumed_samples": self.iteration * t.global_batch_size, "step_time_s": step_time, "lr": lr,
            "global_batch_size": t.global_batch_size, "lm_loss": m.lm_loss, "aux_loss": m.aux_loss,
            "z_loss": m.z_loss, "grad_norm": m.grad_norm, "tokens_per_s": tokens_per_s,
            "skipped_iterations": self.opt.skipped_steps,
        }
        if self.opt.loss_scaler is not None:
            values["loss_scale"] = self.opt.loss_scaler.scale
        self.logger.print(format_train_line(self.iteration, t.train_iters, values, eta))
        scalars = {"lm loss": m.lm_loss, "aux loss": m.aux_loss, "z loss": m.z_loss, "learning-rate": lr,
                   "grad-norm": m.grad_norm, "tokens-per-sec": tokens_per_s, "step-time-ms": step_time * 1000,
                   "skipped-iterations": self.opt.skipped_steps, "consumed-samples": values["consumed_samples"],
                   "memory/max-rss-mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
        if self.opt.loss_scaler is not None:
            scalars["loss-scale"] = self.opt.loss_scaler.scale
        for layer, load in zip(self._moe_layer_numbers(), expert_load_metrics(m.tokens_per_expert, m.dropped_fraction)):
            scalars[f"moe/layer{layer}/max-mean-load-ratio"] = load["max_mean_load_ratio"]
            scalars[f"moe/layer{layer}/dropped-fraction"] = load["dropped_fraction"]
            for expert, count in enumerate(load["tokens_per_expert"]):
                scalars[f"moe/layer{layer}/tokens-per-expert/{expert}"] = count
        if self.qat is not None:
            scalars.update(self.qat.scalars())  # a collective over ep: every rank logs
        self.logger.log(scalars, self.iteration)

    def _moe_layer_numbers(self) -> List[int]:
        return [i for i in range(self.cfg.model.num_layers) if is_moe_layer(i, self.cfg.model.moe_layer_freq)]

    def _evaluate(self) -> None:
        t = self.cfg.train
        batches = eval_micro_batches(t.eval_iters, t.global_batch_size, t.micro_batch_size, self.groups.rank,
                                     self.world)
        loss = evaluate(self.model, self.data.valid, batches, self.groups.dp)
        self.history[-1]["validation_loss"] = loss
        ppl = math.exp(min(loss, 20.0))
        line = f" validation loss at iteration {self.iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
        bar = "-" * len(line)
        self.logger.print(f"{bar}\n{line}\n{bar}")
        self.logger.log({"validation/lm loss": loss, "validation/lm loss ppl": ppl}, self.iteration)

    def _save(self) -> None:
        state = {"qat": self.qat.state_dict() if self.qat is not None else None,
                 "configs": {k: dataclasses.asdict(v) for k, v in vars(self.cfg).items()}}
        path = checkpoint.save_checkpoint(self.cfg.train.save, self.iteration, self.model, self.opt, state,
                                          self.groups.control)
        self.logger.print(f" saved checkpoint {path}")

    def _print_header(self) -> None:
        params = sum(p.numel() for p in self.model.parameters())
        self.logger.print(
            f" moezero pretraining: world {self.world}, ep {self.groups.ep_size}, ZeRO stage {self.cfg.zero.stage}, "
            f"{self.micro_steps} micro-step(s) per rank per iteration, {params:,} params on rank 0, "
            f"{len(self.data.train)} train samples")


def run(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the process exit code."""
    configs = parse_configs(argv, CONFIG_CLASSES, DESCRIPTION)
    cfg = Configs(**configs)
    try:
        init_distributed(cfg.train.dist_timeout_s)
        Pretraining(cfg).train()
        return 0
    except (ConfigError, DataError) as exc:
        _report(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        _report("interrupted; nothing half-written was left (checkpoints are written atomically)", every_rank=True)
        return 130
    except (RuntimeError, dist.DistBackendError) as exc:
        if not dist.is_initialized() or not _looks_like_peer_failure(exc):
            raise
        _report(f"error: a collective failed ({str(exc).splitlines()[0][:200]}); another rank probably died or "
                "stopped answering. Exiting.", every_rank=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _looks_like_peer_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("connection", "timed out", "timeout", "peer", "gloo", "nccl", "broken pipe"))


def _report(message: str, every_rank: bool = False) -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0 or every_rank:
        print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)
