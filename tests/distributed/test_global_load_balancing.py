"""--moe-router-load-balancing-type global_aux_loss on 2 ranks, as megatron-core computes it: each micro-batch's
loss takes this rank's router probabilities and the tokens per expert of every data-parallel rank, averaged over
the step's micro-batches so far (the counts from the top-k of the scores); the tracker restarts each step."""

import pytest
import torch
import torch.distributed as dist

from torch.utils.checkpoint import checkpoint

from moezero.moe import MoEConfig, MoELayer, reset_global_load_balancing
from moezero.parallel import ParallelGroups
from tests.dist_utils import run_distributed

E, K, T, COEFF = 8, 2, 6, 1e-2


def moe_utils():
    """megatron-core's moe_utils, imported by the tests that call it rather than at collection."""
    return pytest.importorskip("megatron.core.transformer.moe.moe_utils")


def _global_loss_is_megatrons():
    rank, world = dist.get_rank(), dist.get_world_size()
    config = MoEConfig(
        hidden_size=12,
        ffn_hidden_size=16,
        num_experts=E,
        top_k=K,
        init_seed=3,
        load_balancing_type=["aux_loss", "global_aux_loss"],
        aux_loss_coeff=[1e-3, COEFF],
    )
    layer = MoELayer(config, ParallelGroups.build(expert_parallel_size=1)).double().train()
    for step in range(2):
        seen = torch.zeros(E, dtype=torch.float64)
        for micro in range(3):
            xs = [
                torch.randn(
                    T, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * step + 10 * micro + r)
                )
                for r in range(world)
            ]
            _, stats = layer(xs[rank])
            with torch.no_grad():
                probs = [torch.softmax(x @ layer.router.wg.weight.t(), -1) for x in xs]
                seen += sum(
                    torch.zeros(T, E, dtype=torch.float64).scatter_(1, p.topk(K).indices, 1.0).sum(0) for p in probs
                )
                local = moe_utils().switch_load_balancing_loss_func(
                    probs[rank],
                    torch.zeros(T, E, dtype=torch.float64).scatter_(1, probs[rank].topk(K).indices, 1.0).sum(0),
                    T,
                    K,
                    E,
                    1.0,
                )
                glob = moe_utils().switch_load_balancing_loss_func(
                    probs[rank], seen / (micro + 1), T * world, K, E, 1.0
                )
            torch.testing.assert_close(stats.aux_loss.detach(), 1e-3 * local + COEFF * glob, rtol=1e-12, atol=0)
            # logged as Megatron's tracker does: summed over the data-parallel ranks, not averaged
            torch.testing.assert_close(stats.tracked["global_load_balancing_loss"], glob * world, rtol=1e-12, atol=0)
            torch.testing.assert_close(stats.tracked["load_balancing_loss"], local, rtol=1e-12, atol=0)
            stats.aux_loss.backward()
        reset_global_load_balancing(layer)  # the training loop's, after each optimizer step
    return True


def test_global_load_balancing_loss_is_megatrons():
    assert all(run_distributed(_global_loss_is_megatrons, 2))


def _recompute_counts_each_micro_batch_once():
    config = MoEConfig(
        hidden_size=12,
        ffn_hidden_size=16,
        num_experts=E,
        top_k=K,
        init_seed=3,
        load_balancing_type=["global_aux_loss"],
        aux_loss_coeff=[COEFF],
    )
    grads, losses = [], []
    for recompute in (False, True):
        layer = MoELayer(config, ParallelGroups.build(expert_parallel_size=1)).double().train()
        for micro in range(3):
            x = torch.randn(
                T, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * micro + dist.get_rank())
            )
            y, stats = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
            (0.1 * y.sum() + stats.aux_loss).backward()
            losses.append(stats.aux_loss.detach())
        grads.append(layer.router.wg.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.stack(losses[3:]), torch.stack(losses[:3]), rtol=1e-12, atol=0)
    return True


def test_a_recomputed_layer_counts_its_tokens_once():
    """--moe-layer-recompute: the recompute in backward uses the counts its forward saw (it added them again, so
    the next micro-batch's logged loss was off)."""
    assert all(run_distributed(_recompute_counts_each_micro_batch_once, 2))
