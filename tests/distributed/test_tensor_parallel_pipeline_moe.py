"""A GPT-MoE with capacity drops at tp 2 (sequence parallel) x pp 2 on 4 gloo ranks (training/pipeline_step.py,
Megatron's tp {0,1} {2,3}, pp {0,2} {1,3}) against one float64 process whose routers decide the drops on each tp
rank's sequence shard, as megatron-core's router does under SP (test_tp_model_exactness.py's oracle): each step's
dropped fraction, counted once (each tp rank's is its shard's), with the lm and router losses and tokens per expert."""

import dataclasses

import torch

from moezero.models import GPTModel
from moezero.moe import expert_parallel
from moezero.moe.router import TopKRouter
from moezero.parallel import ParallelGroups
from moezero.pipeline import PipelinePlan
from moezero.pipeline.optimizer import PipelineZeroOptimizer
from moezero.pipeline.stage_groups import PipelineGroups
from moezero.pipeline.stage_model import StageModel
from moezero.training.loop import train_step
from moezero.training.pipeline_step import PipelineTrainer
from moezero.training.tensor_parallel import apply_tensor_parallel_to_stage
from moezero.zero import ZeroOptimizer
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, configs

TP, VOCAB, SEQ, MB, SEED, KEY_SEED, STEPS, TOL = 2, 64, 32, 2, 3, 7, 2, 1e-10
FLAGS = TINY + ["--moe-expert-capacity-factor", "1.0"]  # drops on most steps and layers


def _model_configs():
    cfg = configs(FLAGS)
    return dataclasses.replace(cfg.model, vocab_size=VOCAB), cfg.moe


def _micro_batches(step, count=2):
    g = torch.Generator().manual_seed(1000 + step)
    return [
        {
            "tokens": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
            "loss_mask": (torch.rand(MB, SEQ, generator=g) > 0.2).double(),
            "sample_index": torch.arange((step * count + j) * MB, (step * count + j + 1) * MB),
        }
        for j in range(count)
    ]


def _metrics(m):
    return {
        "lm_loss": m.lm_loss,
        **m.router_losses,
        "dropped_fraction": m.dropped_fraction.tolist(),
        "tokens_per_expert": m.tokens_per_expert.flatten().tolist(),
    }


def _pipeline_steps():
    gpt, moe = _model_configs()
    groups = PipelineGroups.build(2, tensor_parallel_size=TP)
    plan = PipelinePlan(num_layers=gpt.num_layers, pipeline_model_parallel_size=2)
    model = StageModel(gpt, moe, SEED, plan, groups.pp_rank, moe_layer=expert_parallel(groups.stage)).double()
    model = apply_tensor_parallel_to_stage(model, groups.stage.tp, sequence_parallel=True)
    opt = PipelineZeroOptimizer(model, torch.optim.SGD, groups, stage=1, grad_reduce_dtype=torch.float64, lr=0.1)
    trainer = PipelineTrainer(model, opt, groups, MB, SEQ)
    out = [_metrics(trainer.train_step(_micro_batches(step), step, KEY_SEED)) for step in range(STEPS)]
    groups.destroy()
    return out


def _blocks(x):
    """Each tp rank's sequence shard of batch-major tokens `x` (MB sequences of SEQ), batch-major as it sees it."""
    return [block.reshape(-1, *x.shape[1:]) for block in x.view(MB, SEQ, *x.shape[1:]).chunk(TP, dim=1)]


def _joined(blocks):
    return torch.cat([b.view(MB, -1, *b.shape[1:]) for b in blocks], dim=1).reshape(-1, *blocks[0].shape[1:])


def _drop_per_shard(router):
    """One process's `router` dropping over capacity on each tp shard's tokens (their fractions' mean)."""
    drop = router._drop_over_capacity

    def per_shard(ids_TK, weights_TK, num_sequences):
        shards = [drop(ids, weights, num_sequences) for ids, weights in zip(_blocks(ids_TK), _blocks(weights_TK))]
        return _joined([s[0] for s in shards]), _joined([s[1] for s in shards]), sum(s[2] for s in shards) / TP

    router._drop_over_capacity = per_shard


def _reference_steps():
    gpt, moe = _model_configs()
    model = GPTModel(gpt, moe, seed=SEED).double().train()
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
        _drop_per_shard(router)
    opt = ZeroOptimizer(
        model, torch.optim.SGD, ParallelGroups.single(), stage=1, grad_reduce_dtype=torch.float64, lr=0.1
    )
    return [_metrics(train_step(model, opt, _micro_batches(step), step, KEY_SEED, None)) for step in range(STEPS)]


def test_dropped_fraction_at_tp2_sp_x_pp2_equals_the_per_shard_oracle():
    ranks = run_distributed(_pipeline_steps, 4)
    expected = _reference_steps()
    assert all(0 < f < 1 for step in expected for f in step["dropped_fraction"]), expected
    for rank, steps in enumerate(ranks):  # every rank reports every stage's metrics
        for step, (got, want) in enumerate(zip(steps, expected)):
            assert sorted(got) == sorted(want)
            for name, value in want.items():
                values = value if isinstance(value, list) else [value]
                actual = got[name] if isinstance(value, list) else [got[name]]
                for a, v in zip(actual, values, strict=True):
                    assert abs(a - v) <= TOL * max(1.0, abs(v)), (rank, step, name, actual, values)
