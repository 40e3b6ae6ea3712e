"""A GPT-MoE pretraining run: it composes the builders, then runs the loop, evaluates, logs and saves.

run = Pretraining(cfg, plugins={"qat": attach_qat})   # see moezero.recipe
run.train()
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import resource
from types import MappingProxyType
from typing import Dict, Iterator, List, Mapping, Optional

import torch
import torch.distributed as dist
from torch.nn.utils import parametrize

from moezero import checkpoint
from moezero.checkpoint.lock import lock_save_folder
from moezero.checkpoint.pending import PendingSave
from moezero.data import MicroBatchLoader, eval_micro_batches, micro_batch_indices
from moezero.metrics import tensorboard_scalars, vs_samples_scalars
from moezero.config import ConfigError, is_moe_layer
from moezero.hf import UnsupportedModel, save_pretrained
from moezero.hf.run_tokenizer import run_tokenizer_files, tokenizer_token_ids
from moezero.hf.families import family_for
from moezero.hf.load import hub_dtype
from moezero.keyed_random import keyed_seed
from moezero.models.upcycling import upcycle
from moezero.moe.expert_bias import ExpertBiasUpdater
from moezero.parallel import ParallelGroups
from moezero.parallel.tensor_marker import tensor_shard_of
from moezero.context_parallel import ContextParallel
from moezero.training.args import flag_values
from moezero.training.batch_schedule import BatchSchedule
from moezero.training.builders import (
    build_data,
    build_model,
    build_optimizer,
    dataset_sizes,
    padded_vocab_size,
    param_dtype,
    run_device,
)
from moezero.training.configs import Configs, interleaves_micro_batches, validate
from moezero.training.host_memory import HeapTrimmer
from moezero.training.logging import Timer, agreed_event_files, build_logger, format_train_line, format_validation_line
from moezero.training.log_interval import LogInterval
from moezero.training.megatron_rules import apply_deterministic_mode
from moezero.training.memory_report import memory_report
from moezero.training.loop import (
    StepMetrics,
    evaluate,
    expert_load_scalars,
    moe_layer_loss_scalars,
    moe_losses,
    train_step,
)
from moezero.training.context_parallel_checks import comm_type_notice
from moezero.training.tensor_parallel_checks import muon_tp_mode_notice, sequence_parallel_notice
from moezero.training.pipeline_checks import check_pipeline_run, resolve_pipeline_zero_stage
from moezero.training.pipeline_run import PipelineRun
from moezero.training.plugin import PluginFactory, attach_plugins
from moezero.training.profiling import StepProfiler
from moezero.checkpoint.keys import plain_param_name
from moezero.training.resume import (
    ResumePoint,
    adopted_vocabulary,
    check_shapes,
    data_differences,
    is_import,
    start_iteration,
    start_lr_schedule,
    start_progress,
)
from moezero.training.run_start import resolve_start
from moezero.training.lr_schedule import LearningRateSchedule
from moezero.training.throughput import flops_per_batch, tflops_per_rank
from moezero.training.stopping import StopConditions


def megatron_cuda_memory() -> Dict[str, float]:
    """Megatron's --log-memory-to-tensorboard values, from the CUDA caching allocator's statistics."""
    stats = torch.cuda.memory_stats()
    return {
        "mem_reserved_bytes": stats["reserved_bytes.all.current"],
        "mem_allocated_bytes": stats["allocated_bytes.all.current"],
        "mem_max_allocated_bytes": stats["allocated_bytes.all.peak"],
        "mem_allocated_count": stats["allocation.all.current"],
    }


class Pretraining:
    """The whole run; `train()` runs it. `plugins` ({name: factory}) join it from above (QAT, ...).

    Construction decides the checkpoint to resume from before building anything, so a refused resume
    (missing, damaged, another model, nothing left to train) costs no data or model build.
    """

    def __init__(self, cfg: Configs, plugins: Mapping[str, PluginFactory] = MappingProxyType({})):
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # first, collective: a second job on the same --save stops here, before it reads or writes anything there
        self._save_lock = lock_save_folder(cfg.checkpoint.save)
        try:
            self._build(cfg, plugins)
        except BaseException:
            self._save_lock.release()
            raise

    def _build(self, cfg: Configs, plugins: Mapping[str, PluginFactory]) -> None:
        stage_notice = resolve_pipeline_zero_stage(cfg)  # Megatron's stage at pp > 1 without --zero-stage
        check_pipeline_run(cfg)  # a layout refused before any checkpoint is read
        start = resolve_start(cfg)
        cfg, point, dense_source, notices = start.cfg, start.point, start.dense_source, start.notices
        check_pipeline_run(cfg)  # again with the model a Hub folder or checkpoint gave (--load-hf, ...)
        if stage_notice is not None:
            notices.append(f" {stage_notice}")
        notices += comm_type_notice(cfg) + sequence_parallel_notice(cfg) + muon_tp_mode_notice(cfg)
        self.hub_config, self.hub_generation_config = start.hub_config, start.hub_generation_config
        self.cfg = cfg
        if cfg.checkpoint.save:
            checkpoint.check_writable(cfg.checkpoint.save)  # now, not at the first save an interval later
        progress = start_progress(point, cfg.checkpoint.finetune)
        resumed_at = point.iteration if point is not None and not cfg.checkpoint.finetune else 0
        defaulted = None
        if cfg.train.global_batch_size is None:  # Megatron's default, said as Megatron says it
            defaulted = default_global_batch_notice(cfg, self.world)
            notices.append(f" {defaulted}")
        self.micro_steps = validate(
            cfg,
            self.world,
            resumed_at,
            progress.consumed_train_samples,
            new_model=point is None and dense_source is None,
        )
        self.iteration = start_iteration(point, cfg.train.train_iters, cfg.checkpoint.finetune, cfg.train.skip_train)
        self.batch_schedule = BatchSchedule.from_config(cfg.train, cfg.model.seq_length)
        try:
            self.lr_schedule, self.lr_schedule_steps = start_lr_schedule(
                LearningRateSchedule.from_config(cfg.train), point, cfg.checkpoint, cfg.train
            )
        except ConfigError as exc:  # an iteration-counted schedule moves with a defaulted batch: say why
            if defaulted is None:
                raise
            raise ConfigError(f"{exc} ({defaulted}: give the run's --global-batch-size)") from None
        self._build_groups(cfg)
        self.logger = build_logger(
            0 if self.logs else 1,
            cfg.train,
            cfg.checkpoint.save,
            flag_values(getattr(cfg, f.name) for f in dataclasses.fields(cfg)),
            (self.iteration, progress.consumed_train_samples) if resumed_at else None,
            point.tensorboard_files if point is not None else None,
        )
        # what its checkpoints record: the logging rank's
        self.event_files = agreed_event_files(self.logger, self.control, self.log_rank)
        for line in notices:
            self.logger.print(line)
        sizes = dataset_sizes(cfg, self.iteration, progress)
        self.progress = dataclasses.replace(progress, train_dataset_samples=sizes[0])
        self.data = build_data(cfg, sizes)
        for line in self.data.notices:
            self.logger.print(f" {line}")
        # the rows tp 1 pads to (an export's), whatever vocabulary the model adopts from its checkpoint
        self._tp1_vocab_size = padded_vocab_size(cfg, self.data.tokenizer.vocab_size, tensor_parallel_size=1)
        cfg = self.cfg = self._with_checkpoint_vocabulary(cfg, point)
        self.vocab_size = padded_vocab_size(cfg, self.data.tokenizer.vocab_size)
        self._recorded_vocabulary = (point.configs.get("vocabulary") or {}) if point is not None else {}
        for split in (self.data.train, self.data.valid, self.data.test):
            if split is not None:
                split.vocab_limit = self.vocab_size
        if cfg.train.bf16 and cfg.implementation.disable_bf16_reduced_precision_matmul:  # megatron-core's, global
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        apply_deterministic_mode(cfg)
        self.model = self._build_model(cfg, point)
        if dense_source is not None:  # before the optimizer copies the params into its masters
            dense = checkpoint.consolidate_checkpoint(dense_source.path)  # a QAT run's under plain names
            upcycle(self.model, {plain_param_name(name): value for name, value in dense.items()}, tensor_shard_of)
        # before the optimizer: a plug-in may reparametrize weights (the Parameters themselves stay)
        self.plugins = attach_plugins(
            plugins, self.model, self.groups if self.pipeline is None else self.pipeline.groups, cfg
        )
        self._check_exportable()
        if point is not None:  # at pp > 1 the other stages' params are in it too
            check_shapes(self.model, point, self.pipeline.other_stages_params() if self.pipeline is not None else ())
        self.opt = (
            build_optimizer(self.model, cfg, self.groups) if self.pipeline is None else self.pipeline.optimizer(cfg)
        )
        self.pipeline_trainer = self.pipeline.trainer(self.opt, cfg) if self.pipeline is not None else None
        self.opt.count_zeros_in_grad = cfg.train.log_num_zeros_in_grad
        # process-wide: glibc's thresholds now, a trim after each step that ends well above the warmed-up heap
        self.heap = HeapTrimmer() if cfg.train.host_heap_policy else None
        ExpertBiasUpdater(self.model, self.every_rank).attach(self.opt)  # counts in forward, updates after step
        self.history: List[Dict[str, float]] = []  # per iteration: lm loss, grad norm (and validation loss)
        self.stop_reason: Optional[str] = None
        self._saved_at: Optional[int] = None
        self._saved_path: Optional[str] = None
        self._saved_hf_at: Optional[int] = None
        self._memory_reported = False
        self._pending: Optional[PendingSave] = None  # --async-save: the save in flight
        self._writer_group = self._async_writer_group()
        if point is not None:
            self._resume(point)

    def _build_groups(self, cfg: Configs) -> None:
        """The process groups: one pipeline's (`groups`), or at --pipeline-model-parallel-size > 1 this rank's
        stage's (`groups`) in its pipeline's (`pipeline`). `control` decides for the whole world, (`dp_rank`,
        `dp_size`) deal the batch (every rank of a pipeline loads the same micro-batches) and `log_rank` logs:
        Megatron's last rank with a pipeline (it holds the loss)."""
        if cfg.parallel.pipeline_parallel_size == 1:
            self.pipeline = None
            self.groups = ParallelGroups.build(
                expert_parallel_size=cfg.parallel.expert_parallel_size,
                timeout=datetime.timedelta(minutes=cfg.train.dist_timeout_minutes),
                context_parallel_size=cfg.parallel.context_parallel_size,
                tensor_parallel_size=cfg.parallel.tensor_parallel_size,
                expert_tensor_parallel_size=cfg.parallel.expert_tensor_parallel,
            )
            self.rank, self.log_rank = self.groups.rank, 0
            # at tp > 1 the groups' control is the optimizer's ranks (its tp coordinate's), the run decides for all
            world = self.groups.world_control
            self.control = self.groups.control if world is None else world
            self.every_rank = self.groups.dp if world is None else world  # the losses' and counts' sums
            # the ranks of a cp group read the same micro-batches, each its part of every sequence
            self.dp_rank, self.dp_size = self.groups.data_parallel_rank, self.groups.data_parallel_size
            self.context_parallel = ContextParallel(self.groups.cp, cfg.parallel.cp_comm_type)
            self.batch_group = self.groups.batch_agreement_group()  # tp x cp ranks agree on their micro-batches
        else:
            self.context_parallel = None  # at pp > 1 the stage model holds its own (pipeline_run.py)
            self.batch_group = None
            self.pipeline = PipelineRun.build(cfg)
            pipeline = self.pipeline.groups
            self.groups, self.control, self.log_rank = pipeline.stage, pipeline.world_control, self.pipeline.log_rank
            self.every_rank = self.groups.dp
            self.rank = pipeline.rank  # a stage's cp ranks read the same micro-batches, as at pp 1
            self.dp_rank, self.dp_size = pipeline.data_parallel_rank, pipeline.data_parallel_size
        self.logs = self.rank == self.log_rank

    def _with_checkpoint_vocabulary(self, cfg: Configs, point: Optional[ResumePoint]) -> Configs:
        """`cfg` with the checkpoint's padded vocabulary where this run's tp pads the tokenizer's to other rows
        (a checkpoint saved at another tp: its padded rows are logits too), said as Megatron's padding line."""
        tokenizer = self.data.tokenizer.vocab_size
        if point is None or cfg.model.vocab_size is not None:  # a config's own vocabulary is checked by shape
            return cfg
        padded = padded_vocab_size(cfg, tokenizer)
        rows = adopted_vocabulary(point, tokenizer, padded, cfg.parallel.tensor_parallel_size)
        if rows is None:
            return cfg
        self.logger.print(
            f" padded vocab (size: {tokenizer}) with {rows - tokenizer} dummy tokens (new size: {rows}): the "
            f"checkpoint's, not the {padded} of --make-vocab-size-divisible-by {cfg.model.make_vocab_size_divisible_by}"
            f" x tp {cfg.parallel.tensor_parallel_size}"
        )
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=rows))

    def _build_model(self, cfg: Configs, point: Optional[ResumePoint]):
        """The GPT (build_model), or at pp > 1 this rank's stages of it."""
        if self.pipeline is None:
            return build_model(
                cfg,
                self.groups,
                self.data.tokenizer.vocab_size,
                hub_dir=cfg.checkpoint.load_hf if point is None else None,
                context_parallel=self.context_parallel,
            )
        gpt = dataclasses.replace(cfg.model, vocab_size=padded_vocab_size(cfg, self.data.tokenizer.vocab_size))
        hub_dir = cfg.checkpoint.load_hf if point is None else None
        return self.pipeline.build_model(cfg, gpt, param_dtype(cfg.train), run_device(), hub_dir=hub_dir)

    def destroy_groups(self) -> None:
        """Release every process group of the run (tests run many in one world)."""
        (self.pipeline.groups if self.pipeline is not None else self.groups).destroy()

    def _resume(self, point: ResumePoint) -> None:
        ck = self.cfg.checkpoint
        state = checkpoint.load_checkpoint(
            point.path,
            self.model,
            self.opt,
            self.control,
            load_optim=not (ck.no_load_optim or ck.finetune or is_import(point)),
            load_rng=not (ck.no_load_rng or ck.finetune),
        )
        if ck.finetune:  # a new run from these weights: iteration 0, plug-ins start fresh
            self.logger.print(f" --finetune: weights from {point.path} (iteration {point.iteration}); starting at 0")
            return
        for name, plugin in self.plugins.items():
            if state["plugins"].get(name) is not None:
                plugin.load_state_dict(state["plugins"][name])
            else:  # saved without it: it joins where the run stands
                plugin.on_step_end(self._steps_taken())
        fresh = [flag for flag, on in (("optimizer state", ck.no_load_optim), ("RNG states", ck.no_load_rng)) if on]
        self.logger.print(
            f" resumed from {point.path} at iteration {self.iteration}, "
            f"{self.progress.consumed_train_samples} samples consumed"
            + (f" (fresh {' and '.join(fresh)})" if fresh else "")
        )
        changed = [] if is_import(point) or self.cfg.train.skip_train else data_differences(self.cfg, point)
        if changed:  # Megatron's resume says nothing; a document already trained on may come again
            self.logger.print(
                f" the sample stream is not the checkpoint's ({'; '.join(changed)}): training goes on "
                f"at sample {self.progress.consumed_train_samples} of the new one, as Megatron's resume "
                "does"
            )

    # ---- the loop -----------------------------------------------------------------------------
    def train(self) -> None:
        """Train to --train-iters, or until a stop condition (signal, duration, --exit-interval); save at the
        end with --save. `stop_reason` says why it stopped early (None: it finished)."""
        try:
            self._run()
        finally:  # the --save folder is free for the next job, however the run ends
            self._save_lock.release()

    def _run(self) -> None:
        t = self.cfg.train
        self._print_header()
        if t.skip_train:  # Megatron's evaluation-only run: no step, no save, the evaluations below
            self.logger.print(" skipping training (--skip-train is on) ...")
        elif self.iteration >= t.train_iters:  # a finished run relaunched (a requeued job): its end again
            self.logger.print(
                f" the checkpoint is at iteration {self.iteration} = --train-iters: nothing to train "
                "(raise --train-iters to go on); the end of the run follows (Megatron's)"
            )
        else:
            self._train_and_save(t)
        # Megatron's order for a run that finished: the checkpoint, then one more validation (its window is not
        # in the checkpoint: a longer run resumed from it validates there again), then the test split
        if self.stop_reason is None and t.evaluates:
            self._evaluate("valid", after_training=True)
        if self.stop_reason is None and self.data.test is not None:
            self._evaluate("test")
        finished = self.stop_reason is None  # a stopped run's grace goes to the checkpoint that resumes it
        if self.cfg.checkpoint.save_hf and finished and not t.skip_train and self._saved_hf_at != self.iteration:
            self._save_hf()
        if self.stop_reason is not None:
            saved = f"saved {self._saved_path}" if self.cfg.checkpoint.save else "nothing saved (no --save)"
            self.logger.print(f" stopped after iteration {self.iteration} ({self.stop_reason}); {saved}")
        self.logger.close()

    def _train_and_save(self, t) -> None:
        """The loop to --train-iters or a stop condition, then the last checkpoint."""
        stop = StopConditions(t, self.control)
        loader = MicroBatchLoader(self.data.train, self._train_index_lists(), self.cfg.data.num_workers)
        profiler = StepProfiler(self.cfg.profiling, self.rank, t.tensorboard_dir, self.iteration)
        try:
            self._loop(stop, loader, profiler)
        except BaseException:
            stop.close()
            raise
        finally:
            profiler.close()
            loader.close()
        try:  # the last checkpoint first (Megatron's order: a job's grace), published (an --async-save's too)
            if self.cfg.checkpoint.save and self._saved_at != self.iteration:
                self._save()
            self._finish_pending()
        finally:  # the handlers stay while it is written: a signal then waits for it instead of killing it
            stop.close()

    def _steps_taken(self) -> int:
        """The optimizer steps taken: iterations less the skipped ones (fp16 overflows), which DeepSpeed's MoQ
        schedule does not count either (a checkpoint from before the count: its iterations)."""
        return self.iteration - self.progress.skipped_iterations

    def _train_index_lists(self) -> Iterator[List[int]]:
        """This rank's micro-batches (global sample indices) of every step still to run, in order."""
        t, consumed = self.cfg.train, self.progress.consumed_train_samples
        for _ in range(self.iteration, t.train_iters):
            batch_size = self.batch_schedule.batch_size(consumed)
            yield from micro_batch_indices(consumed, batch_size, t.micro_batch_size, self.dp_rank, self.dp_size)
            consumed += batch_size

    def _loop(self, stop: StopConditions, loader: MicroBatchLoader, profiler: StepProfiler) -> None:
        t, ck = self.cfg.train, self.cfg.checkpoint
        run_timer, interval = Timer(), LogInterval()
        start_iteration = self.iteration
        last_batch_size = self.batch_schedule.batch_size(self.progress.consumed_train_samples)
        while self.iteration < t.train_iters:
            consumed = self.progress.consumed_train_samples
            batch_size = self.batch_schedule.batch_size(consumed)
            if batch_size != last_batch_size and ck.save and self._saved_at != self.iteration:
                self._save()  # Megatron's: a checkpoint whenever a batch ramp changes the number of micro-batches
            last_batch_size = batch_size
            for group in self.opt.param_groups:  # a group's own max_lr / min_lr: --decoupled-lr
                group["lr"] = self.lr_schedule.group_lr(self.lr_schedule_steps, group)
                group["weight_decay"] = self.lr_schedule.weight_decay_at(self.lr_schedule_steps) * group["wd_mult"]
            profiler.before_iteration(self.iteration)
            timer = Timer()
            batches = [next(loader) for _ in range(batch_size // (t.micro_batch_size * self.dp_size))]
            if self.pipeline_trainer is not None:
                metrics = self.pipeline_trainer.train_step(batches, self.iteration, t.seed)
            else:
                metrics = train_step(
                    self.model,
                    self.opt,
                    batches,
                    self.iteration,
                    t.seed,
                    self.every_rank,
                    per_token_loss=t.calculate_per_token_loss,
                    overlap_moe_comm=interleaves_micro_batches(self.cfg),
                    context_parallel=self.context_parallel,
                    tensor_parallel_size=self.groups.tp_size,
                    batch_group=self.batch_group,
                )
            if self.heap is not None:
                self.heap.after_step()
            if not metrics.stepped:
                self._check_non_finite(metrics)
            step_time = timer.elapsed()
            if metrics.stepped:  # as Megatron's scheduler: a skipped step does not advance it
                self.lr_schedule_steps += batch_size
            self.iteration += 1
            profiler.after_iteration(self.iteration)
            self.progress = dataclasses.replace(
                self.progress,
                consumed_train_samples=consumed + batch_size,
                skipped_iterations=self.progress.skipped_iterations + int(not metrics.stepped),
            )
            for plugin in self.plugins.values():
                plugin.on_step_end(self._steps_taken())
            self.history.append({"iteration": self.iteration, **metrics.values()})
            moe = moe_losses(metrics)
            interval.add(step_time, {"lm_loss": metrics.lm_loss, **moe, **metrics.mtp_values()}, metrics.stepped)
            eta = run_timer.elapsed() / (self.iteration - start_iteration) * (t.train_iters - self.iteration)
            # Megatron's: every --log-interval and the run's first iteration (moezero's: and its last)
            console = self.iteration % t.log_interval == 0 or self.iteration in (start_iteration + 1, t.train_iters)
            board = t.tensorboard_dir is not None and self.iteration % t.tensorboard_log_interval == 0
            if console or board:  # decided alike on every rank: logging may run collectives
                # the lr Megatron logs is its scheduler's after the step: the next step's
                logged_lr = self.lr_schedule.lr(self.lr_schedule_steps)
                self._log_step(
                    metrics, moe, logged_lr, batch_size, step_time, eta, board, interval if console else None
                )
            if console and not self._memory_reported:  # Megatron's report_memory, once: every stage's first rank
                self._memory_reported = True
                if self.dp_rank == 0:
                    stage = self.pipeline.groups.pp_rank if self.pipeline is not None else None
                    print(memory_report(self.rank, self.iteration, stage), flush=True)
            if t.tensorboard_dir is not None and not board:  # Megatron's MoE and MTP trackers: every iteration
                self.logger.log(self._moe_board_scalars(metrics, dict(moe, **metrics.mtp_values())), self.iteration)
            if t.evaluates and self.iteration % t.eval_interval == 0:
                self._evaluate("valid")
            if self._pending is not None and self._pending.done_everywhere():
                self._finish_pending()
            if ck.save and ck.save_interval and self.iteration % ck.save_interval == 0:
                self._save()
            if ck.save_hf and ck.save_hf_interval and self.iteration % ck.save_hf_interval == 0:
                self._save_hf()
            self.stop_reason = stop.reason(self.iteration)
            if self.stop_reason is not None:
                return

    def _check_non_finite(self, m: StepMetrics) -> None:
        """Megatron's --check-for-nan-in-loss-and-grad (on by default; off with fp16's dynamic loss scaling,
        whose overflows are skipped steps): a non-finite loss or gradient stops the run. The norm and loss are
        global, so every rank stops at the same step."""
        if not self.cfg.implementation.check_for_nan_in_loss_and_grad or self.cfg.train.fp16:
            return
        raise FloatingPointError(
            f"iteration {self.iteration + 1}: the loss or the gradient is not finite (lm loss {m.lm_loss:g}, grad "
            f"norm {m.grad_norm:g}); the step was not taken and the run stops, as Megatron's "
            "--check-for-nan-in-loss-and-grad does (the last checkpoint stays as it was); "
            "--no-check-for-nan-in-loss-and-grad skips such steps instead"
        )

    def _log_step(
        self,
        m: StepMetrics,
        moe: Dict[str, float],
        lr: float,
        batch_size: int,
        step_time: float,
        eta: float,
        board: bool,
        interval: Optional[LogInterval],
    ) -> None:
        """Megatron's TensorBoard scalars (`board`: the step's) and with `interval` the console line (averages
        over the interval, then reset); moezero's per-expert loads and plug-in scalars with the console line of
        an uninterrupted run (every --log-interval, the first and the last iteration)."""
        values = dict(self._step_values(m, lr, batch_size, step_time), **moe)
        layers = self._moe_layer_numbers()
        layer_loads = expert_load_scalars(layers, m.tokens_per_expert, m.dropped_fraction)
        ratios = [v for k, v in layer_loads.items() if k.endswith("max-mean-load-ratio")]
        if ratios:
            values["moe_max_mean_load"] = max(ratios)
        if board:
            board_values = self._board_values(values)
            scalars = tensorboard_scalars(board_values)
            scalars.update(self._moe_board_scalars(m, {}))
            self.logger.log(scalars, self.iteration)
            self.logger.log_vs_samples(vs_samples_scalars(board_values), self.progress.consumed_train_samples)
        if interval is not None:
            line = {k: v for k, v in values.items() if k not in interval.loss_names}  # the step's own losses:
            line.update(interval.summary())  # the interval's instead
            self._rate_values(line, batch_size, line["step_time_ms"] / 1000)
            t = self.cfg.train
            if self.iteration % t.log_interval == 0 or self.iteration == t.train_iters:
                # Megatron's line at the run's first iteration keeps its sums (should_reset = not
                # is_first_iteration): the next --log-interval line averages from the run's start
                interval.reset()
            self.logger.print(format_train_line(self.iteration, self.cfg.train.train_iters, line, eta))
            if self.iteration % t.log_interval == 0 or self.iteration in (1, t.train_iters):
                # the steps a run never stopped logs at: a resume's first line is the console's alone
                with self.opt.full_parameters():  # plug-ins may read weights (stage 3 keeps them sharded else)
                    for plugin in self.plugins.values():
                        layer_loads.update(plugin.scalars())  # may be a collective: every rank logs
                self.logger.log(layer_loads, self.iteration)

    def _moe_board_scalars(self, m: StepMetrics, moe: Dict[str, float]) -> Dict[str, float]:
        """The MoE losses' tags (`moe`: the mean over layers, and the MTP depths'; per layer with
        --moe-per-layer-logging), which Megatron's trackers write at every iteration whatever
        --tensorboard-log-interval says."""
        scalars = tensorboard_scalars(moe)
        layers = self._moe_layer_numbers()
        if layers and self.cfg.train.moe_per_layer_logging:
            scalars.update(moe_layer_loss_scalars(layers, m))
        return scalars

    def _board_values(self, values: Dict[str, float]) -> Dict[str, float]:
        """The step's values TensorBoard gets: Megatron's switches for the loss scale and the world size."""
        t = self.cfg.train
        board = {k: v for k, v in values.items() if k != "loss_scale" or t.log_loss_scale_to_tensorboard}
        if t.log_world_size_to_tensorboard:
            board["world_size"] = self.world
        return board

    def _step_values(self, m: StepMetrics, lr: float, batch_size: int, step_time: float) -> Dict[str, float]:
        t = self.cfg.train
        values = dict(
            m.values(),
            consumed_samples=self.progress.consumed_train_samples,
            step_time_ms=step_time * 1000,
            iteration_time=step_time,
            lr=lr,
            global_batch_size=batch_size,
            loss_scale=1.0,
            **self._memory_values(),
        )  # Megatron's loss scale without fp16: 1.0
        for name in self._router_losses_not_in_the_run():
            values.pop(name, None)
        self._rate_values(values, batch_size, step_time)
        if t.log_params_norm:
            values["params_norm"] = self.opt.params_norm()  # a collective: every rank logs
        if t.log_num_zeros_in_grad and self.opt.last_num_zeros_in_grad is not None:
            values["num_zeros"] = self.opt.last_num_zeros_in_grad
        if self.opt.loss_scaler is not None:
            values["loss_scale"] = self.opt.loss_scaler.scale
        return values

    def _router_losses_not_in_the_run(self) -> List[str]:
        """moezero's 'aux loss' / 'z loss' (with coefficients) of a loss the run does not have: no z-loss coefficient,
        aux-loss coefficients of 0. Megatron logs no series of such a loss; the step's values hold a 0.0 for it."""
        moe = self.cfg.moe
        coefficients = moe.aux_loss_coeff if isinstance(moe.aux_loss_coeff, list) else [moe.aux_loss_coeff]
        return ([] if moe.z_loss_coeff is not None else ["router_z_loss"]) + (
            [] if any(coefficients) else ["router_aux_loss"]
        )

    def _rate_values(self, values: Dict[str, float], batch_size: int, step_time: float) -> None:
        """tokens/s and (--log-throughput) TFLOP/s per rank at `step_time` seconds per step."""
        values["tokens_per_s"] = batch_size * self.cfg.model.seq_length / step_time
        if self.cfg.train.log_throughput:
            moe = self.cfg.moe if self.cfg.moe.num_experts is not None else None
            flops = flops_per_batch(self.cfg.model, moe, self.vocab_size, batch_size)
            values["throughput"] = tflops_per_rank(flops, step_time, self.world)

    def _memory_values(self) -> Dict[str, float]:
        """This rank's peak process memory, what the optimizer holds, and (CUDA) the peak allocation."""
        values = {
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            "zero_held_mb": sum(self.opt.memory_bytes().values()) / 2**20,
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            values["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
            if self.cfg.implementation.log_memory_to_tensorboard:
                values.update(megatron_cuda_memory())
        return values

    def _moe_layer_numbers(self) -> List[int]:
        if self.cfg.moe.num_experts is None:
            return []
        model = self.cfg.model
        decoder = [i for i in range(model.num_layers) if is_moe_layer(i, model.moe_layer_freq)]
        # the MTP depths' layers are numbered on from the decoder's, with its last layer's kind of MLP
        depths = range(model.num_layers, model.num_layers + (model.mtp_num_layers or 0))
        return decoder + (list(depths) if model.num_layers - 1 in decoder else [])

    def _evaluate(self, split: str, after_training: bool = False) -> None:
        """Mean lm loss over --eval-iters global batches of the validation split, or of the test split (the
        validation `after_training` is printed as Megatron's: '... at iteration N on validation set')."""
        t = self.cfg.train
        # Megatron's --skip-train validates from the split's start too
        start = self.progress.consumed_valid_samples if split == "valid" and not t.skip_train else 0
        indices = eval_micro_batches(
            t.eval_iters, t.global_batch_size, t.micro_batch_size, self.dp_rank, self.dp_size, start
        )
        loader = MicroBatchLoader(
            self.data.valid if split == "valid" else self.data.test, indices, self.cfg.data.num_workers
        )
        try:
            if self.pipeline_trainer is not None:  # one forward-only schedule per global batch
                per_batch = len(indices) // t.eval_iters
                batches = ([next(loader) for _ in range(per_batch)] for _ in range(t.eval_iters))
                loss = self.pipeline_trainer.evaluate(batches, keyed_seed(t.seed, "evaluation", split), self.iteration)
            else:
                loss = evaluate(  # the tp ranks' copies of each loss count alike in its token mean
                    self.model,
                    loader,
                    self.every_rank,
                    t.seed,
                    self.iteration,
                    split,
                    self.context_parallel,
                    batch_group=self.batch_group,
                )
        finally:
            loader.close()
        if split == "valid":
            self.progress = dataclasses.replace(
                self.progress, consumed_valid_samples=start + t.eval_iters * t.global_batch_size
            )
        name = "validation" if split == "valid" else "test"
        if self.history:
            self.history[-1][f"{name}_loss"] = loss
        values = {f"{name}_loss": loss, f"{name}_ppl": math.exp(min(loss, 20.0))}
        where = "test" if split == "test" else "validation" if after_training else ""
        self.logger.print(format_validation_line(self.iteration, values, where))
        if t.skip_train:  # Megatron's write_to_tensorboard=not args.skip_train
            return
        if after_training and t.eval_interval and self.iteration % t.eval_interval == 0:
            return  # the interval's validation of this iteration is on the board; Megatron adds a second point
        self.logger.log(tensorboard_scalars(values), self.iteration)
        if split == "valid":
            self.logger.log_vs_samples(vs_samples_scalars(values), self.progress.consumed_train_samples)

    def _save(self) -> None:
        self._finish_pending()  # one save in flight at a time
        ck = self.cfg.checkpoint
        saved = checkpoint.save_checkpoint(
            ck.save,
            self.iteration,
            self.model,
            self.opt,
            configs=self._stored_configs(),
            plugins={name: plugin.state_dict() for name, plugin in self.plugins.items()},
            progress=self.progress.saved(),
            lr_schedule=self.lr_schedule.state(self.lr_schedule_steps),
            group=self.control,
            keep_last=ck.keep_last,
            background=ck.async_save,
            writer_group=self._writer_group,
            tensorboard_files=self.event_files,
        )
        self._saved_at = self.iteration
        if isinstance(saved, PendingSave):
            self._pending = saved
            self.logger.print(f" saving checkpoint {saved.path} in the background")
        else:
            self._saved_path = saved
            self.logger.print(f" saved checkpoint {saved}")

    def _stored_configs(self) -> Dict[str, Dict]:
        """The run's config sections, and the Hub config it started from (an export keeps its token ids)."""
        configs = {f.name: dataclasses.asdict(getattr(self.cfg, f.name)) for f in dataclasses.fields(self.cfg)}
        if self.hub_config is not None:
            configs["hf"] = self.hub_config
        if self.hub_generation_config is not None:
            configs["hf_generation"] = self.hub_generation_config
        # an export of the checkpoint writes the rows --save-hf writes, whatever tp it was saved at
        configs["vocabulary"] = {"tokenizer": self.data.tokenizer.vocab_size, "exported": self._exported_vocab_size()}
        return configs

    def _exported_vocab_size(self) -> int:
        """The vocabulary as a tp 1 run pads it: the rows tp adds are no part of the model. A run resumed from a
        checkpoint that records its own for this tokenizer keeps it (one saved at tp 2 resumed at tp 1 with its
        rows: the first run's tp 1 padding, not the resumed run's)."""
        recorded, tokenizer = self._recorded_vocabulary, self.data.tokenizer.vocab_size
        if recorded.get("tokenizer") == tokenizer and tokenizer <= recorded.get("exported", 0) <= self.vocab_size:
            return recorded["exported"]
        return min(self._tp1_vocab_size, self.vocab_size)  # (an adopted vocabulary may have fewer rows)

    def _check_exportable(self) -> None:
        """--save-hf: a model no Hugging Face family holds is refused now, not after the training."""
        target = self.cfg.checkpoint.save_hf
        if not target:
            return
        try:
            family = family_for(self.model.config, self.model.moe_config)
        except UnsupportedModel as exc:
            raise ConfigError(f"--save-hf={target}: {exc}") from None
        if family.stacked_experts and self.groups.ep_size > 1:
            raise ConfigError(
                f"--save-hf={target}: {family.model_type} holds all experts of a layer in one tensor, "
                f"which no rank of --expert-model-parallel-size {self.groups.ep_size} holds whole; "
                "export a checkpoint with tools/hf_checkpoint.py export instead"
            )
        if self.hub_config is not None:  # the dtype the folder is written in (the source's)
            try:
                hub_dtype(self.hub_config)
            except ValueError as exc:
                raise ConfigError(f"--save-hf={target}: the source's {exc}") from None
        if any(parametrize.is_parametrized(module) for module in self.model.modules()):
            raise ConfigError(
                f"--save-hf={target}: not with a plug-in that reparametrizes weights (QAT); write the "
                "quantized model with tools/export_quantized.py, or a checkpoint's fp32 masters with "
                "tools/hf_checkpoint.py export --qat-masters"
            )

    def _save_hf(self) -> None:
        """--save-hf: the model as a Hub folder of this iteration, every rank writing its share (in the Hub
        source's dtype and with its token ids for a run that started from one, else the params' dtype and the
        run tokenizer's ids)."""
        path = os.path.join(self.cfg.checkpoint.save_hf, f"iter_{self.iteration:07d}")
        dtype = hub_dtype(self.hub_config) if self.hub_config is not None else None
        self.model.hub_config, self.model.hub_generation_config = self.hub_config, self.hub_generation_config
        save_pretrained(
            self.model,
            path,
            groups=self.groups if self.pipeline is None else self.pipeline.groups,  # at pp > 1: each stage's ranks
            dtype=dtype,
            optimizer=self.opt,
            overwrite=True,
            token_ids=tokenizer_token_ids(self.data.tokenizer),
            tokenizer_files=run_tokenizer_files(dataclasses.asdict(self.cfg.data)),
            vocab_size=self._exported_vocab_size(),
        )
        self._saved_hf_at = self.iteration
        self.logger.print(f" saved Hugging Face model {path}")

    def _finish_pending(self) -> None:
        """--async-save: wait for the save in flight (every rank), then publish it as latest."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._saved_path = pending.finish()
            self.logger.print(f" saved checkpoint {self._saved_path}")

    def _async_writer_group(self):
        """--async-save on several ranks: a gloo group of the background writer's own (its collectives run in
        another thread, so never on a group training uses), created alike on every rank."""
        if not (self.cfg.checkpoint.async_save and self.cfg.checkpoint.save and dist.is_initialized()):
            return None
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=self.cfg.train.dist_timeout_minutes))

    def _print_header(self) -> None:
        params = sum(p.numel() for p in self.model.parameters())
        pp = ""
        if self.pipeline is not None:
            plan = self.pipeline.plan
            schedule = f"interleaved 1F1B, {plan.virtual_stages} virtual stages" if plan.virtual_stages > 1 else "1F1B"
            pp = f"pp {plan.pp} ({schedule}), "
        if self.groups.cp_size > 1:
            pp += f"cp {self.groups.cp_size}, "
        if self.groups.tp_size > 1:
            sp = " with sequence parallelism" if self.cfg.implementation.sequence_parallel else ""
            pp += f"tp {self.groups.tp_size}{sp}, "
        etp = f", etp {self.groups.etp_size}" if self.groups.etp_size > 1 else ""
        self.logger.print(
            f" moezero pretraining: world {self.world}, {pp}ep {self.groups.ep_size}{etp}, "
            f"ZeRO stage {self.cfg.zero.stage}, "
            f"{self.micro_steps} micro-step(s) per rank per iteration, {params:,} params on rank {self.rank}, "
            f"{len(self.data.train)} train samples"
        )
        if self.cfg.moe.num_experts and self.cfg.model.mlp_activation() == "gelu_tanh":
            self.logger.print(
                " Megatron's bias-GELU fusion (on by default): the MLPs and experts use the tanh GELU, "
                "which Megatron refuses in MoE layers; --no-bias-gelu-fusion gives the exact GELU"
            )
        sections = [getattr(self.cfg, f.name) for f in dataclasses.fields(self.cfg)]
        self.logger.log_run_config(flag_values(sections), tensorboard_scalars({"lm_loss": 0, "validation_loss": 0}))


def default_global_batch_notice(cfg: Configs, world: int) -> str:
    """Megatron's line for a run without --global-batch-size: the micro-batch size times the data-parallel size
    (the processes over tp x pp x cp)."""
    sizes = {
        "--tensor-model-parallel-size": cfg.parallel.tensor_parallel_size,
        "--pipeline-model-parallel-size": cfg.parallel.pipeline_parallel_size,
        "--context-parallel-size": cfg.parallel.context_parallel_size,
    }
    dp_size = world // math.prod(sizes.values())
    processes = "the number of processes" + "".join(f" / {flag}" for flag, n in sizes.items() if n > 1)
    return (
        f"setting global batch size to {cfg.train.micro_batch_size * dp_size} "
        f"(--micro-batch-size x {processes}; no --global-batch-size given)"
    )
