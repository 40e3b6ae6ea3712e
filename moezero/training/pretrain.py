"""A GPT-MoE pretraining run: it composes the builders, then runs the loop, evaluates, logs and saves.

    run = Pretraining(cfg, plugins={"qat": attach_qat})   # see moezero.recipe
    run.train()
"""
from __future__ import annotations

import dataclasses
import math
import os
import resource
from types import MappingProxyType
from typing import Dict, List, Mapping

import torch.distributed as dist

from moezero import checkpoint
from moezero.data import eval_micro_batches, train_micro_batches
from moezero.metrics import tensorboard_scalars
from moezero.models.gpt import is_moe_layer
from moezero.moe.expert_bias import ExpertBiasUpdater
from moezero.parallel import ParallelGroups
from moezero.training.builders import build_data, build_model, build_optimizer
from moezero.training.configs import Configs, validate
from moezero.training.logging import Timer, build_logger, format_train_line, format_validation_line
from moezero.training.loop import StepMetrics, evaluate, expert_load_scalars, train_step
from moezero.training.plugin import PluginFactory, attach_plugins
from moezero.training.schedule import learning_rate


class Pretraining:
    """The whole run; `train()` runs it. `plugins` ({name: factory}) join it from above (QAT, ...)."""

    def __init__(self, cfg: Configs, plugins: Mapping[str, PluginFactory] = MappingProxyType({})):
        self.cfg = cfg
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.micro_steps = validate(cfg, self.world)
        self.groups = ParallelGroups.build(expert_parallel_size=cfg.parallel.expert_parallel_size)
        self.rank = self.groups.rank
        self.logger = build_logger(self.rank, cfg.train.tensorboard_dir)
        self.data = build_data(cfg)
        self.model = build_model(cfg, self.groups, self.data.tokenizer.vocab_size)
        # before the optimizer: a plug-in may reparametrize weights (the Parameters themselves stay)
        self.plugins = attach_plugins(plugins, self.model, self.groups, cfg)
        self.opt = build_optimizer(self.model, cfg, self.groups)
        self.bias_updater = ExpertBiasUpdater(self.model, self.groups.dp)
        self.iteration = 0
        self.history: List[Dict[str, float]] = []  # per iteration: lm loss, grad norm (and validation loss)
        if cfg.train.load:
            self._resume(cfg.train.load)

    def _resume(self, root: str) -> None:
        iteration = checkpoint.latest_iteration(root) if os.path.isdir(root) else None
        if iteration is None:  # Megatron's behaviour: --load and --save may name the same, new, directory
            self.logger.print(f" WARNING: no checkpoint found in --load={root}; training from scratch")
            return
        path = checkpoint.iteration_dir(root, iteration)
        state = checkpoint.load_checkpoint(path, self.model, self.opt, self.groups.control)
        self.iteration = state["iteration"]
        for name, plugin in self.plugins.items():
            if state["plugins"].get(name) is not None:
                plugin.load_state_dict(state["plugins"][name])
            else:  # saved without it: it joins where the run stands
                plugin.on_step_end(self.iteration)
        self.logger.print(f" resumed from {path} at iteration {self.iteration}")

    # ---- the loop -----------------------------------------------------------------------------
    def train(self) -> None:
        t = self.cfg.train
        self._print_header()
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
            for plugin in self.plugins.values():
                plugin.on_step_end(self.iteration)
            self.history.append({"iteration": self.iteration, "lm_loss": metrics.lm_loss,
                                 "aux_loss": metrics.aux_loss, "grad_norm": metrics.grad_norm})
            eta = run_timer.elapsed() / (self.iteration - start_iteration) * (t.train_iters - self.iteration)
            if self.iteration % t.log_interval == 0 or self.iteration == t.train_iters:
                self._log_step(metrics, lr, step_time, eta)
            if t.eval_interval and (self.iteration % t.eval_interval == 0 or self.iteration == t.train_iters):
                self._evaluate()
            if t.save and t.save_interval and self.iteration % t.save_interval == 0:
                self._save()
            if t.exit_interval and self.iteration % t.exit_interval == 0:
                break
        if t.save and not (t.save_interval and self.iteration % t.save_interval == 0):
            self._save()
        self.logger.close()

    def _log_step(self, m: StepMetrics, lr: float, step_time: float, eta: float) -> None:
        t = self.cfg.train
        values = dict(m.values(), consumed_samples=self.iteration * t.global_batch_size, step_time_ms=step_time * 1000,
                      lr=lr, global_batch_size=t.global_batch_size,
                      tokens_per_s=t.global_batch_size * self.cfg.model.seq_length / step_time,
                      skipped_iterations=self.opt.skipped_steps,
                      max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
        if self.opt.loss_scaler is not None:
            values["loss_scale"] = self.opt.loss_scaler.scale
        self.logger.print(format_train_line(self.iteration, t.train_iters, values, eta))
        scalars = tensorboard_scalars(values)
        scalars.update(expert_load_scalars(self._moe_layer_numbers(), m.tokens_per_expert, m.dropped_fraction))
        with self.opt.full_parameters():  # plug-ins may read weights (stage 3 keeps them sharded otherwise)
            for plugin in self.plugins.values():
                scalars.update(plugin.scalars())  # may be a collective: every rank logs
        self.logger.log(scalars, self.iteration)

    def _moe_layer_numbers(self) -> List[int]:
        return [i for i in range(self.cfg.model.num_layers) if is_moe_layer(i, self.cfg.model.moe_layer_freq)]

    def _evaluate(self) -> None:
        t = self.cfg.train
        batches = eval_micro_batches(t.eval_iters, t.global_batch_size, t.micro_batch_size, self.groups.rank,
                                     self.world)
        loss = evaluate(self.model, self.data.valid, batches, self.groups.dp)
        self.history[-1]["validation_loss"] = loss
        values = {"validation_loss": loss, "validation_ppl": math.exp(min(loss, 20.0))}
        self.logger.print(format_validation_line(self.iteration, values))
        self.logger.log(tensorboard_scalars(values), self.iteration)

    def _save(self) -> None:
        path = checkpoint.save_checkpoint(
            self.cfg.train.save, self.iteration, self.model, self.opt,
            configs={f.name: dataclasses.asdict(getattr(self.cfg, f.name)) for f in dataclasses.fields(self.cfg)},
            plugins={name: plugin.state_dict() for name, plugin in self.plugins.items()}, group=self.groups.control)
        self.logger.print(f" saved checkpoint {path}")

    def _print_header(self) -> None:
        params = sum(p.numel() for p in self.model.parameters())
        self.logger.print(
            f" moezero pretraining: world {self.world}, ep {self.groups.ep_size}, ZeRO stage {self.cfg.zero.stage}, "
            f"{self.micro_steps} micro-step(s) per rank per iteration, {params:,} params on rank 0, "
            f"{len(self.data.train)} train samples")
