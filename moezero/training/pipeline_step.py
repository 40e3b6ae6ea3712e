"""One training step of a pipeline rank: its micro-batches through torch.distributed.pipelining's schedule, then the
optimizer step; metrics summed over every stage. The pipeline's `training.loop.train_step` (here, not in
moezero/pipeline/, which the training layer builds on: the metrics are the loop's StepMetrics).

    trainer = PipelineTrainer(model, opt, groups, micro_batch_size=2, seq_length=32)
    metrics = trainer.train_step(micro_batches, iteration, seed)     # every rank of every stage calls it
    loss = trainer.evaluate(global_batches, seed, iteration)         # forward only, the lm loss's token mean

- Schedule: Schedule1F1B, or ScheduleGPipe when there are fewer micro-batches than stages (torch's 1F1B refuses
  them; Megatron runs them with a shortened warm-up, the same numbers); with virtual stages
  ScheduleInterleaved1F1B (its micro-batch counts checked at start: PipelinePlan.check_num_microbatches; over gloo
  every send uses tag 0, so each pair of ranks must post its receives in its sends' order, which torch's action
  lists do: the exactness test would see a swap). One PipelineStage per local chunk with
  static metadata (chunk.py); schedules and their stages are kept per micro-batch count (torch sizes the receive
  buffers once per stage object).
- Inputs: the first stage takes the tokens; every stage the keys' (seed, iteration, sample indices); the last stage
  the labels and loss mask. torch splits the concatenated micro-batches back into them on dim 0.
- Loss: the last stage's forward returns lm + the aux losses of every stage (carried, stage_model.py) + its MTP
  depths' term (they embed the shifted tokens, given to the last stage too); the
  schedule's loss function divides it by the micro-batch count (`scale_grads=False`: torch's own division after
  the step would miss ZeRO's buckets), so a micro-batch adds (lm + Σ router losses) / n, as `training.loop`.
  --calculate-per-token-loss: every stage weighs its router losses by their tokens and the last stage its lm
  loss by its tokens, each times the weight of one loss token (`token_weight`: the stage's dp ranks over the
  global batch's loss tokens), and nothing is divided by n: `training.loop`'s per-token gradient.
- Context parallelism: each cp coordinate's pipeline runs the same micro-batches, every stage holding its part of
  each sequence (stage_model.py); the losses are its shares times cp, the token weight counts its part's tokens and
  the metrics add up the cp ranks' shares (the micro-batches counted once per dp rank).
- Gradients: every backward of the step runs under `opt.no_sync()` (stages 0/1 accumulate locally) and `opt.step()`
  reduces them once, then the norm is summed over the stages (optimizer.py).
- fp16: the loss function multiplies by the loss scale, which every rank holds alike: a non-finite gradient on
  any stage makes the norm summed over the stages non-finite on every rank, so every rank skips the step and
  updates its scaler alike (no rank waits for another: the schedule ran to its end on every stage either way).
- Metrics: every chunk forward records into a StepRecorder in a global layout (metrics.py); one all-reduce over the
  world, then `training.loop`'s own `_step_metrics`.
- Evaluation: the same stages' forwards without a backward (torch's schedule.eval on a GPipe schedule, or the
  interleaved one with virtual stages, whose backward actions do nothing then, with stage objects of its own:
  torch sizes a stage's buffers for one kind of step), the lm loss recorded by the last stage.
- Shared batches: a stage's tp and cp ranks (its tp-cp group) each load the same micro-batches; they agree on each
  one's place, shape and token ids (parallel/batch_agreement.py) before the step's first collective (the records
  launched as the step begins), and in evaluation on each global batch's micro-batches (their count
  included) before its schedule, and on their total at the end. Every stage agrees, its
  middle ones too: each stage's exchanges are sized by the micro-batches' shape and count. A difference raises
  RanksDisagree, which ends as the failure below (its line names it) on every rank of the pipeline.
- Failure: an error anywhere in the step (this rank's or a neighbour's closed connection) ends as one PipelineFailed
  line on every rank of the pipeline (failure.py).
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from moezero.context_parallel import split_sequence
from moezero.moe import reset_global_load_balancing
from moezero.parallel import comm
from moezero.parallel.batch_agreement import SharedBatchCheck, agree_evaluation_end
from moezero.pipeline.chunk import ActivationShape, StageChunk, stage_metas
from moezero.pipeline.failure import FailureGuard, PipelineFailed, agreed_run_key, first_line
from moezero.pipeline.metrics import StepRecorder, tracked_loss_names
from moezero.pipeline.optimizer import PipelineZeroOptimizer
from moezero.pipeline.stage_groups import PipelineGroups
from moezero.pipeline.stage_model import StageModel
from moezero.training.loop import StepMetrics, _GlobalTokens, _step_metrics, _token_mean
from moezero.zero import DynamicLossScaler


class _MicroBatchLoss:
    """The schedule's loss_fn: the last stage's output (the micro-batch's loss) / `divisor` (n; 1 with
    --calculate-per-token-loss, whose token weights already make the sum the global batch's token mean), times the
    fp16 loss scale (`scaler`'s, read at each call: it changes between steps) as ZeroOptimizer.backward's."""

    def __init__(self, divisor: int, scaler: Optional[DynamicLossScaler]):
        self.divisor, self.scaler = divisor, scaler

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = output / self.divisor
        return loss * self.scaler.scale if self.scaler is not None else loss


class PipelineTrainer:
    """Runs a pipeline rank's training steps. Args: the rank's StageModel, its PipelineZeroOptimizer, the groups,
    the micro-batch shape (micro-batch size, sequence length) and `per_token_loss` (--calculate-per-token-loss)."""

    def __init__(
        self,
        model: StageModel,
        opt: PipelineZeroOptimizer,
        groups: PipelineGroups,
        micro_batch_size: int,
        seq_length: int,
        per_token_loss: bool = False,
    ):
        self.model, self.opt, self.groups = model, opt, groups
        self.per_token_loss = per_token_loss
        dtype = next(model.parameters()).dtype
        cp = model.context_parallel
        self.cp_size = 1 if cp is None else cp.size
        self.shape = ActivationShape(
            micro_batch_size,
            seq_length,
            model.config.hidden_size,
            dtype,
            model.aux_dtype(dtype),
            self.cp_size,
            model.sequence_shards,
        )
        self.pieces = model.pieces  # one per virtual stage
        self.batch_group = groups.stage.batch_agreement_group()  # the stage's ranks reading the same micro-batches
        self.device = next(model.parameters()).device
        self.guard = FailureGuard(agreed_run_key(groups.world_control), groups.rank, self.pieces[0].stage_index)
        self._schedules: Dict[int, object] = {}  # training's, by micro-batch count
        self._eval_schedules: Dict[int, object] = {}  # evaluation's (stage objects of their own)
        moe = model.moe_config
        self._recorder_args = (
            model.moe_layers,
            moe.num_experts if moe is not None else 0,
            tracked_loss_names(moe),
            model.config.num_layers,
            model.config.mtp_num_layers or 0,
            self.cp_size * model.sequence_shards,  # the parts of a micro-batch's sequence the routers see
            groups.stage.tp_rank,
        )

    # ---- the schedule ------------------------------------------------------------------------------
    def _schedule(self, num_microbatches: int, evaluation: bool = False):
        cache = self._eval_schedules if evaluation else self._schedules
        schedule = cache.get(num_microbatches)
        if schedule is None:
            pp = self.groups.pp
            if pp is None and self.groups.pp_size > 1:
                raise PipelineFailed("this rank's pipeline was closed after a stage failed; the run cannot go on")
            stages = [self._stage(v, pp) for v in range(len(self.pieces))]
            divisor = 1 if self.per_token_loss and not evaluation else num_microbatches
            loss_fn = _MicroBatchLoss(divisor, None if evaluation else self.opt.loss_scaler)
            if len(stages) > 1:  # Megatron's interleaved placement: stage v * pp + pp_rank on this rank
                # evaluation runs it too: its forwards in the same order, the backward actions skipped (no grad)
                schedule = ScheduleInterleaved1F1B(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
            else:
                one_f_one_b = num_microbatches >= self.groups.pp_size and not evaluation
                kind = Schedule1F1B if one_f_one_b else ScheduleGPipe
                schedule = kind(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
            cache[num_microbatches] = schedule
        return schedule

    def _stage(self, virtual_stage: int, pp) -> PipelineStage:
        """torch's stage object of one of this rank's chunks, with its static metadata."""
        piece = self.pieces[virtual_stage]
        inputs, outputs = stage_metas(piece, self.shape)
        return PipelineStage(
            StageChunk(self.model, virtual_stage, self.shape),
            piece.stage_index,
            self.groups.pp_size * len(self.pieces),
            self.device,
            input_args=inputs,
            output_args=outputs,
            group=pp,
        )

    def _inputs(
        self, micro_batches: Sequence[Dict[str, torch.Tensor]], iteration: int, seed: int
    ) -> Tuple[tuple, dict]:
        """(args, kwargs) of schedule.step for this rank's stage."""

        def joined(key: str) -> torch.Tensor:
            return torch.cat([batch[key] for batch in micro_batches]).to(self.device)

        kwargs = {"seed": seed, "iteration": iteration, "sample_index": joined("sample_index")}
        args = (joined("tokens"),) if any(piece.embedding for piece in self.pieces) else ()
        if any(piece.head for piece in self.pieces):  # every chunk of the rank is given them; the head's reads them
            kwargs.update(labels=joined("labels"), loss_mask=joined("loss_mask"), target=joined("labels"))
            if self.model.mtp is not None:  # the MTP depths embed the shifted tokens
                kwargs["tokens"] = joined("tokens")
        return args, kwargs

    # ---- the step ------------------------------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[Dict[str, torch.Tensor]], iteration: int, seed: int) -> StepMetrics:
        """Forward/backward every micro-batch through the pipeline, then step; a collective over the world."""
        cause = None
        try:
            return self._train_step(micro_batches, iteration, seed)
        except PipelineFailed:
            raise
        except Exception as error:  # this rank's own, or a neighbour's closed connection
            cause = first_line(error)
        self._fail(cause, iteration)  # outside the except block: no frame of the step holds the pp group

    def _train_step(self, micro_batches, iteration: int, seed: int) -> StepMetrics:
        self.model.train()
        shared_batches = SharedBatchCheck(self.batch_group, iteration, micro_batches)  # launched now, checked below
        n = len(micro_batches)
        schedule = self._schedule(n)
        args, kwargs = self._inputs(micro_batches, iteration, seed)
        shared_batches.check()  # before the step's first collective (the token count's, the schedule's exchanges)
        if self.per_token_loss:
            kwargs["token_weight"] = self._token_weight(micro_batches)
        recorder = self.model.recorder = StepRecorder(*self._recorder_args)
        try:
            # one reduction at step(): stages 0/1 accumulate every micro-batch; fp16: the loss_fn scales
            with self.opt.no_sync(), self.opt.scaled_backwards():
                schedule.step(*args, return_outputs=False, **kwargs)
        finally:
            self.model.recorder = None
        stepped = self.opt.step()
        self.opt.zero_grad()
        reset_global_load_balancing(self.model)
        totals = recorder.pack()
        comm.all_reduce(totals, self.groups.world_control)  # one all-reduce for every metric of every stage
        # a cp group's ranks add up shares of the same micro-batches
        micro_batches = n * self.groups.data_parallel_size
        return _step_metrics(recorder.unpack(totals), micro_batches, self.opt.last_grad_norm, stepped)

    def _token_weight(self, micro_batches: Sequence[Dict[str, torch.Tensor]]) -> float:
        """--calculate-per-token-loss: the weight of one loss token, training.loop's (the ranks whose gradients the
        stage's optimizer averages over the global batch's loss tokens). Every rank of a pipeline holds the same
        micro-batches, so each stage counts them itself (Megatron broadcasts the last stage's count): one all-reduce
        over the stage's dp group (Megatron's dp-cp: a cp rank counts its part of each sequence)."""
        if self.cp_size > 1:
            cp = self.model.context_parallel
            micro_batches = [{"loss_mask": split_sequence(b["loss_mask"], cp.size, cp.rank)} for b in micro_batches]
        return _GlobalTokens.count(micro_batches, self.groups.stage.dp).weight(1.0)

    # ---- evaluation ----------------------------------------------------------------------------------
    def evaluate(self, global_batches: Iterable[Sequence[Dict[str, torch.Tensor]]], seed: int, iteration: int) -> float:
        """The lm loss of every pipeline's micro-batches as their token mean (training.loop.evaluate's); each item
        of `global_batches` is this pipeline's micro-batches of one global batch, `seed` the evaluation's keyed
        seed. A collective over the world."""
        cause = None
        try:
            return self._evaluate(global_batches, seed, iteration)
        except PipelineFailed:
            raise
        except Exception as error:
            cause = first_line(error)
        self._fail(cause, iteration)

    def _evaluate(self, global_batches, seed: int, iteration: int) -> float:
        recorder = self.model.recorder = StepRecorder(*self._recorder_args)
        self.model.eval()
        count = 0  # the micro-batches read, agreed over the stage's tp-cp ranks (their end as training.loop's)
        try:
            with torch.no_grad():
                for micro_batches in global_batches:
                    # agreed before the schedule's exchanges, their count too (tp peers pair inside the stages)
                    shared_batches = SharedBatchCheck(self.batch_group, iteration, micro_batches, count)
                    count += len(micro_batches)
                    args, kwargs = self._inputs(micro_batches, iteration, seed)
                    shared_batches.check()
                    self._schedule(len(micro_batches), evaluation=True).eval(*args, return_outputs=False, **kwargs)
            agree_evaluation_end(self.batch_group, iteration, count)
        finally:
            self.model.recorder = None
            self.model.train()
        totals = torch.stack([recorder.totals["lm_loss"], recorder.totals["lm_tokens"]])
        comm.all_reduce(totals, self.groups.world_control)  # the last stages' sums, zeros elsewhere
        return _token_mean(totals[0], totals[1])

    def _fail(self, cause: str, iteration: int) -> None:
        """Raise the step's failure on this rank (see failure.py): state it, close the pipeline, raise."""
        line = self.guard.line_for(cause, iteration)
        self._schedules.clear()  # the stages hold the pp group: drop them before closing it
        self._eval_schedules.clear()
        self.groups.close_pp()
        raise PipelineFailed(line)
