"""The ranks that share micro-batches (a tp group, a cp group) and whose data paths diverge: every rank raises
RanksDisagree naming its micro-batch and another rank's, never a hang, a gloo abort or a silent mix of tensors.

The training step (moezero.training.loop.train_step, the pretraining script's) on 2 ranks at tp 2 (with sequence
parallelism) and at cp 2, with one rank given (a) micro-batches of another sequence length, (b) one more
micro-batch, (c) other token ids of the same shape; and a step whose ranks agree, which trains as before. The same
for an evaluation (moezero.training.loop.evaluate), whose micro-batches' count is its loader's. Then the pipeline's
step and evaluation (training/pipeline_step.py) on 4 ranks at tp 2 x pp 2, each stage's tp ranks agreeing: one rank
of the first or the last stage given other micro-batches ends as one PipelineFailed line naming RanksDisagree on
every rank of the world, the other stage's ranks (blocked in the schedule) included."""

import dataclasses
import datetime

import torch
import torch.distributed as dist

from moezero.context_parallel import ContextParallel
from moezero.config import GPTConfig
from moezero.models import GPTModel
from moezero.parallel import ParallelGroups
from moezero.pipeline import PipelinePlan
from moezero.pipeline.failure import PipelineFailed
from moezero.pipeline.optimizer import PipelineZeroOptimizer
from moezero.pipeline.stage_groups import PipelineGroups
from moezero.pipeline.stage_model import StageModel
from moezero.training.loop import evaluate, train_step
from moezero.training.pipeline_step import PipelineTrainer
from moezero.training.tensor_parallel import apply_tensor_parallel, apply_tensor_parallel_to_stage
from moezero.zero import RanksDisagree, ZeroOptimizer
from tests.dist_utils import run_distributed

VOCAB, SEQ, MB = 64, 16, 2
GPT = GPTConfig(
    num_layers=1,
    hidden_size=16,
    num_attention_heads=2,
    ffn_hidden_size=32,
    seq_length=SEQ,
    max_position_embeddings=SEQ,
    vocab_size=VOCAB,
    position_embedding_type="rope",
    normalization="RMSNorm",
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def _micro_batches(count=2, seq=SEQ, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "tokens": torch.randint(0, VOCAB, (MB, seq), generator=g),
            "labels": torch.randint(0, VOCAB, (MB, seq), generator=g),
            "loss_mask": torch.ones(MB, seq, dtype=torch.float64),
            "sample_index": torch.arange(j * MB, (j + 1) * MB),
        }
        for j in range(count)
    ]


CASES = {  # what rank 1 gets instead of rank 0's two micro-batches
    "sequence length": dict(seq=SEQ // 2),
    "one more micro-batch": dict(count=3),
    "other tokens": dict(seed=1),
}


def _model(layout):
    groups = ParallelGroups.build(timeout=datetime.timedelta(seconds=15), **{f"{layout}_parallel_size": 2})
    cp = ContextParallel(groups.cp) if layout == "context" else None
    model = GPTModel(GPT, None, seed=3, context_parallel=cp).double().train()
    return groups, cp, apply_tensor_parallel(model, groups.tp, sequence_parallel=True)


def _step(layout, rank_one):
    """One train_step on a fresh model, rank 1 given `rank_one`'s micro-batches: its error message, or its loss."""
    groups, cp, model = _model(layout)
    opt = ZeroOptimizer(model, torch.optim.SGD, groups, stage=1, grad_reduce_dtype=torch.float64, lr=0.1)
    batches = _micro_batches(**(rank_one if dist.get_rank() == 1 else {}))
    try:
        metrics = train_step(
            model,
            opt,
            batches,
            0,
            7,
            groups.dp if groups.world_control is None else groups.world_control,
            context_parallel=cp,
            tensor_parallel_size=groups.tp_size,
            batch_group=groups.batch_agreement_group(),
        )
        return metrics.lm_loss
    except RanksDisagree as exc:
        return f"RanksDisagree: {exc}"
    except Exception as exc:  # what a mismatch ends in without the records (a gloo abort, a pipe's error)
        return f"{type(exc).__name__}: {exc}"


def _evaluations(layout):
    """evaluate() on one model: agreeing, then rank 1 given other tokens, then one more micro-batch. Each
    disagreement raises on both ranks at the same record, so the groups stay in step for the next."""
    groups, cp, model = _model(layout)
    group = groups.dp if groups.world_control is None else groups.world_control
    out = {}
    for name, rank_one in (("agreeing", {}), ("other tokens", dict(seed=1)), ("one more micro-batch", dict(count=3))):
        try:
            batches = _micro_batches(**(rank_one if dist.get_rank() == 1 else {}))
            loss = evaluate(model, batches, group, 7, 0, "valid", cp, batch_group=groups.batch_agreement_group())
            out["evaluation", layout, name] = loss
        except RanksDisagree as exc:
            out["evaluation", layout, name] = f"RanksDisagree: {exc}"
    return out


def _cases():
    out = {}
    for layout in ("tensor", "context"):
        for name, rank_one in CASES.items():
            out[layout, name] = _step(layout, rank_one)
        out[layout, "agreeing"] = _step(layout, {})
        out.update(_evaluations(layout))
    return out


def test_ranks_sharing_micro_batches_that_diverge_raise_on_every_rank():
    results = run_distributed(_cases, 2, isolated=True, timeout=300)
    for rank, out in enumerate(results):
        for layout in ("tensor", "context"):
            assert isinstance(out[layout, "agreeing"], float), (layout, out[layout, "agreeing"])
            assert out[layout, "agreeing"] == results[0][layout, "agreeing"]
            for name in CASES:
                message = out[layout, name]
                assert message.startswith("RanksDisagree: the ranks are not doing the same thing"), (
                    rank,
                    layout,
                    name,
                    message,
                )
                assert f"this rank ({rank}) was at iteration 0, micro-batch 1 of " in message, message
                assert "another rank was at iteration 0, micro-batch 1 of " in message, message
            assert f"tokens ({MB}, {SEQ}) " in out[layout, "sequence length"]
            assert f"tokens ({MB}, {SEQ // 2}) " in out[layout, "sequence length"]
            assert "micro-batch 1 of 3" in out[layout, "one more micro-batch"]
            assert "micro-batch 1 of 2" in out[layout, "one more micro-batch"]
            assert "token digest" in out[layout, "other tokens"]
            assert isinstance(out["evaluation", layout, "agreeing"], float)
            assert out["evaluation", layout, "agreeing"] == results[0]["evaluation", layout, "agreeing"]
            other, more = out["evaluation", layout, "other tokens"], out["evaluation", layout, "one more micro-batch"]
            assert f"this rank ({rank}) was at iteration 0, evaluation micro-batch 1: tokens" in other, other
            assert "another rank was at iteration 0, evaluation micro-batch 1: tokens" in other, other
            assert "had ended the evaluation at iteration 0 after 2 micro-batches" in more, more
            assert "evaluation micro-batch 3: tokens" in more, more


# tp 2 x pp 2 (Megatron's tp {0,1} {2,3}, pp {0,2} {1,3}): what one rank gets instead of the others' two micro-batches
PIPELINE_CASES = {
    "sequence length, first stage": (1, "train", dict(seq=SEQ // 2)),
    "one more micro-batch, last stage": (3, "train", dict(count=3)),
    "other tokens, last stage": (2, "train", dict(seed=1)),
    "evaluation, other tokens, first stage": (0, "evaluate", dict(seed=1)),
    "evaluation, one more micro-batch, last stage": (3, "evaluate", dict(count=3)),
}


def _pipeline():
    groups = PipelineGroups.build(2, tensor_parallel_size=2, timeout=datetime.timedelta(seconds=60))
    plan = PipelinePlan(num_layers=2, pipeline_model_parallel_size=2)
    model = StageModel(dataclasses.replace(GPT, num_layers=2), None, 3, plan, groups.pp_rank).double()
    model = apply_tensor_parallel_to_stage(model, groups.stage.tp, sequence_parallel=True)
    opt = PipelineZeroOptimizer(model, torch.optim.SGD, groups, stage=1, grad_reduce_dtype=torch.float64, lr=0.1)
    return groups, PipelineTrainer(model, opt, groups, MB, SEQ)


def _pipeline_run(trainer, kind, rank_one):
    batches = _micro_batches(**rank_one)
    try:
        if kind == "train":
            return trainer.train_step(batches, 0, 7).lm_loss
        return trainer.evaluate([batches], 7, 0)
    except PipelineFailed as exc:
        return f"PipelineFailed: {exc}"


def _pipeline_cases():
    """An agreeing step and evaluation, then each case on a fresh pipeline (a failure closes the pipeline's groups);
    every rank waits for the others before dropping its groups (the failing ranks' teardown frees the rest)."""
    groups, trainer = _pipeline()
    out = {"agreeing": _pipeline_run(trainer, "train", {}), "evaluation, agreeing": _pipeline_run(trainer, "eval", {})}
    for name, (rank, kind, rank_one) in PIPELINE_CASES.items():
        if groups is None:
            groups, trainer = _pipeline()
        out[name] = _pipeline_run(trainer, kind, rank_one if dist.get_rank() == rank else {})
        dist.barrier(group=groups.world_control)
        groups.destroy()
        groups = None
    return out


def test_pipeline_stages_ranks_sharing_micro_batches_that_diverge_fail_on_every_rank():
    results = run_distributed(_pipeline_cases, 4, timeout=120)
    for out in results:
        for name in ("agreeing", "evaluation, agreeing"):
            assert isinstance(out[name], float), (name, out[name])
            assert out[name] == results[0][name]
        for name, (rank, _, _) in PIPELINE_CASES.items():
            message = out[name]
            assert message == results[0][name], (name, message, results[0][name])  # the first failure's line
            stage = rank // 2
            assert message.startswith(f"PipelineFailed: pipeline stage {stage} (rank "), message
            assert "failed at iteration 0: RanksDisagree: the ranks are not doing the same thing" in message, message
    line = results[0]
    assert f"tokens ({MB}, {SEQ}) " in line["sequence length, first stage"]
    assert f"tokens ({MB}, {SEQ // 2}) " in line["sequence length, first stage"]
    assert "micro-batch 1 of 3" in line["one more micro-batch, last stage"]
    assert "micro-batch 1 of 2" in line["one more micro-batch, last stage"]
    assert "token digest" in line["other tokens, last stage"]
    assert "evaluation micro-batch 1 (of a global batch of 2): tokens" in line["evaluation, other tokens, first stage"]
    more = line["evaluation, one more micro-batch, last stage"]
    assert "evaluation micro-batch 1 (of a global batch of 2): tokens" in more, more
    assert "evaluation micro-batch 1 (of a global batch of 3): tokens" in more, more
