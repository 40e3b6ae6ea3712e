"""ep = 2 and ep = 4 give the outputs and gradients of ep = 1 for the same global model."""

import torch
import torch.distributed as dist

from moezero.moe import MoEConfig, MoELayer
from moezero.moe.expert_bias import ExpertBiasUpdater
from moezero.parallel import ParallelGroups, comm
from tests.dist_utils import assert_replicas_equal, run_distributed

CASES = [
    # (config overrides, dtype, tolerance)
    (dict(), torch.float64, 1e-12),
    (dict(top_k=1, score_function="sigmoid"), torch.float64, 1e-12),
    (dict(capacity_factor=0.75, token_drop_policy="probs", activation="swiglu"), torch.float64, 1e-12),
    (dict(top_k=4, shared_expert_intermediate_size=8, z_loss_coeff=1e-3), torch.float64, 1e-12),
    (dict(hidden_size=16, ffn_hidden_size=32), torch.float32, 1e-5),  # grouped GEMM path
]


def _config(**kw):
    cfg = dict(hidden_size=12, ffn_hidden_size=20, num_experts=8, top_k=2, aux_loss_coeff=1e-2, init_seed=11)
    cfg.update(kw)
    return MoEConfig(**cfg)


def _tokens(rank, config, dtype):
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = 3 + rank  # uneven token counts per rank (rank 0 also gets few)
    # positive inputs, so a gate row of -1s scores far below every other expert
    return (torch.rand(2, tokens, config.hidden_size, generator=g, dtype=torch.float64) + 0.5).to(dtype)


def _compare(ep, overrides, dtype, tol):
    rank = dist.get_rank()
    config = _config(**overrides)
    groups = ParallelGroups.build(expert_parallel_size=ep)
    layer = MoELayer(config, groups, layer_number=3).to(dtype)
    reference = MoELayer(config, ParallelGroups.single(), layer_number=3).to(dtype)
    # expert 7 receives no token on any rank: its gate row is pushed far down
    for m in (layer, reference):
        with torch.no_grad():
            m.router.wg.weight[7] = -1.0
    first = groups.ep_rank * (8 // ep)
    local = slice(first, first + 8 // ep)
    assert torch.equal(layer.experts.w1, reference.experts.w1[local])  # layout-invariant init

    x = _tokens(rank, config, dtype)
    out = {}
    for name, m in (("ep", layer), ("ref", reference)):
        xi = x.clone().requires_grad_(True)
        y, stats = m(xi)
        loss = (
            (y.double() * torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view(y.shape)).sum()
            + stats.aux_loss
            + stats.z_loss
        )
        loss.backward()
        out[name] = (y, stats, xi.grad)
    (y, stats, gx), (y_ref, stats_ref, gx_ref) = out["ep"], out["ref"]
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(gx, gx_ref, atol=tol, rtol=tol)
    assert torch.equal(stats.tokens_per_expert, stats_ref.tokens_per_expert)
    assert stats.tokens_per_expert[7] == 0
    torch.testing.assert_close(layer.router.wg.weight.grad, reference.router.wg.weight.grad, atol=tol, rtol=tol)
    # an expert's gradient collects the tokens of every rank in the ep group
    for w, w_ref in ((layer.experts.w1, reference.experts.w1), (layer.experts.w2, reference.experts.w2)):
        summed = w_ref.grad.clone()
        comm.all_reduce(summed, groups.ep)
        torch.testing.assert_close(w.grad, summed[local], atol=tol, rtol=tol)
    if groups.ep_rank == ep - 1:  # this rank holds expert 7, which got no token anywhere
        assert layer.experts.w1.grad[-1].abs().sum() == 0
    assert_replicas_equal(layer, groups)
    groups.destroy()


def _all_cases():
    for ep in (2, 4):
        for overrides, dtype, tol in CASES:
            _compare(ep, overrides, dtype, tol)
    return True


def test_expert_parallel_matches_ep1_on_four_ranks():
    assert all(run_distributed(_all_cases, 4, timeout=240))


def _expert_bias_step():
    groups = ParallelGroups.build(expert_parallel_size=2)
    config = _config(enable_expert_bias=True, bias_update_rate=0.01)
    layer = MoELayer(config, groups)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)
    ExpertBiasUpdater(layer, groups.dp).attach(optimizer)  # counts in forward, updates after each step
    total = torch.zeros(8, dtype=torch.int64)
    for micro in range(2):
        _, stats = layer(_tokens(dist.get_rank() * 2 + micro, config, torch.float32))
        total += stats.tokens_per_expert
    with torch.no_grad():
        layer.eval()(_tokens(7, config, torch.float32))  # an evaluation forward counts nothing
    layer.train()
    comm.all_reduce(total, groups.dp)
    optimizer.step()
    expected = 0.01 * torch.sign(total.float().mean() - total.float())
    torch.testing.assert_close(layer.router.expert_bias, expected)
    assert_replicas_equal(layer, groups)
    assert "router.expert_bias" in layer.state_dict()
    groups.destroy()
    return layer.router.expert_bias.tolist()


def test_expert_bias_update_uses_every_rank_and_micro_batch():
    biases = run_distributed(_expert_bias_step, 2)
    assert biases[0] == biases[1] and any(b != 0 for b in biases[0])


def _one_rank_empty():
    rank = dist.get_rank()
    groups = ParallelGroups.build(expert_parallel_size=2)
    out = []
    for balancing in ("aux_loss", "seq_aux_loss", "none"):
        layer = MoELayer(_config(load_balancing_type=balancing, z_loss_coeff=1e-3), groups).double()
        x = _tokens(rank, layer.config, torch.float64)[:, : 0 if rank == 0 else None].requires_grad_(True)
        y, stats = layer(x)
        (y.sum() + stats.aux_loss + stats.z_loss).backward()
        out.append(bool(torch.isfinite(stats.aux_loss)) and y.shape == x.shape)
    groups.destroy()
    return all(out)


def test_an_empty_micro_batch_on_one_ep_rank():
    assert all(run_distributed(_one_rank_empty, 2))
