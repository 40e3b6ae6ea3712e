"""The ranks that share micro-batches (a tp group, a cp group) and whose data paths diverge: every rank raises
RanksDisagree naming its micro-batch and another rank's, never a hang, a gloo abort or a silent mix of tensors.

The training step (moezero.training.loop.train_step, the pretraining script's) on 2 ranks at tp 2 (with sequence
parallelism) and at cp 2, with one rank given (a) micro-batches of another sequence length, (b) one more
micro-batch, (c) other token ids of the same shape; and a step whose ranks agree, which trains as before. The same
for an evaluation (moezero.training.loop.evaluate), whose micro-batches' count is its loader's."""

import datetime

import torch
import torch.distributed as dist

from moezero.context_parallel import ContextParallel
from moezero.config import GPTConfig
from moezero.models import GPTModel
from moezero.parallel import ParallelGroups
from moezero.training.loop import evaluate, train_step
from moezero.training.tensor_parallel import apply_tensor_parallel
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
