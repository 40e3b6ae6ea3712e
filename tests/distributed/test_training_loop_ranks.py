"""The training loop's step (moezero.training.loop.train_step) on 2 ranks against one process that sees every
rank's micro-batches: what a rank-count factor or a per-step reset left out would change only with several ranks
or several steps."""

import copy
import dataclasses

import torch
import torch.distributed as dist

from moezero.keyed_random import SampleKeys
from moezero.models import GPTModel
from moezero.moe import expert_parallel
from moezero.parallel import ParallelGroups
from moezero.training.loop import _micro_batch_losses, train_step
from moezero.zero import ZeroOptimizer
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, configs

VOCAB, SEQ, MB, LR = 64, 32, 2, 0.5
# kept tokens of each rank's two micro-batches: uneven within a rank and between the ranks
KEPT = ((10, 64), (30, 5))


def _micro_batches(rank, step=0):
    g = torch.Generator().manual_seed(100 * step + rank)
    batches = []
    for j, kept in enumerate(KEPT[rank]):
        mask = torch.zeros(MB, SEQ, dtype=torch.float64)
        mask.view(-1)[:kept] = 1.0
        first = (step * 2 + rank) * 2 * MB + j * MB
        batches.append(
            {
                "tokens": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
                "labels": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
                "loss_mask": mask,
                "sample_index": torch.arange(first, first + MB),
            }
        )
    return batches


def _model_and_sgd(flags, groups):
    cfg = configs(TINY + flags)
    model = (
        GPTModel(dataclasses.replace(cfg.model, vocab_size=VOCAB), cfg.moe, seed=3, moe_layer=expert_parallel(groups))
        .double()
        .train()
    )
    opt = ZeroOptimizer(
        model, torch.optim.SGD, groups, stage=2, bucket_size=500, grad_reduce_dtype=torch.float64, lr=LR
    )
    return model, opt


def _per_token_step_is_the_global_token_mean():
    """--calculate-per-token-loss: the step's gradient is that of (every token loss of every rank) / (the global
    batch's kept tokens), the router losses each times its micro-batch's tokens in that sum (megatron-core's)."""
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=1)
    model, opt = _model_and_sgd([], groups)
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = train_step(model, opt, _micro_batches(dist.get_rank()), 0, 7, groups.dp, per_token_loss=True)
    every = [batch for rank in range(world) for batch in _micro_batches(rank)]
    tokens = float(sum(batch["loss_mask"].sum() for batch in every))
    loss, token_sum = 0.0, 0.0
    for batch in every:
        lm, _, stats, _ = _micro_batch_losses(reference, batch, SampleKeys(7, 0, tuple(batch["sample_index"].tolist())))
        routers = sum(s.aux_loss + s.z_loss for s in stats) * MB * SEQ
        loss = loss + (lm * batch["loss_mask"].sum() + routers) / tokens
        token_sum += float(lm * batch["loss_mask"].sum())
    loss.backward()
    with opt.full_parameters():
        for name, p in reference.named_parameters():
            torch.testing.assert_close(
                model.get_parameter(name).detach(), before[name] - LR * p.grad, rtol=1e-10, atol=1e-12, msg=name
            )
    assert abs(metrics.lm_loss - token_sum / tokens) <= 1e-10 * abs(token_sum / tokens)
    groups.destroy()


def _global_aux_loss_counts_each_step_afresh():
    """--moe-router-load-balancing-type global_aux_loss: a step's losses are those of a model that starts counting
    at that step (the same weights, a tracker that never saw the step before)."""
    flags = ["--moe-router-load-balancing-type", "global_aux_loss"]
    groups = ParallelGroups.build(expert_parallel_size=2)
    model, opt = _model_and_sgd(flags, groups)
    rank = dist.get_rank()
    train_step(model, opt, _micro_batches(rank, step=0), 0, 7, groups.dp)
    fresh, fresh_opt = _model_and_sgd(flags, groups)
    with opt.full_parameters(), fresh_opt.full_parameters():
        fresh.load_state_dict(model.state_dict())
    second = train_step(model, opt, _micro_batches(rank, step=1), 1, 7, groups.dp)
    alone = train_step(fresh, fresh_opt, _micro_batches(rank, step=1), 1, 7, groups.dp)
    assert second.router_losses.keys() == alone.router_losses.keys() and second.router_losses
    for name, value in alone.router_losses.items():
        assert abs(second.router_losses[name] - value) <= 1e-12 * abs(value), (name, second.router_losses, alone)
    groups.destroy()


def _both():
    _per_token_step_is_the_global_token_mean()
    _global_aux_loss_counts_each_step_afresh()
    return True


def test_the_loop_on_two_ranks_is_the_global_batch_of_one_process():
    assert all(run_distributed(_both, 2))
