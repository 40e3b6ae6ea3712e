"""The MoE load-balancing features Megatron's scripts use, against megatron-core's own functions: several
--moe-router-load-balancing-type losses at once with a coefficient each (computed, as Megatron computes them,
from the top-k of the scores rather than the biased or group-limited selection), sinkhorn routing, and
--moe-router-force-load-balancing. The global-batch loss over ranks is in tests/distributed."""
import pytest
import torch

from moezero.config import ConfigError, MoEConfig
from moezero.moe import MoELayer
from moezero.moe.router import TopKRouter, sinkhorn
from tests.integration.pretrain_utils import TINY, configs, train

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
E, K, D = 8, 2, 16


def _router(**kwargs) -> TopKRouter:
    torch.manual_seed(0)
    router = TopKRouter(MoEConfig(hidden_size=D, num_experts=E, top_k=K, **kwargs))
    router.wg.weight.data.normal_(0, 1.0)
    return router


def _megatron_losses(logits_BSE, score_function, coefficients):
    """megatron-core's aux and seq aux losses (router.py's _apply_aux_loss / _apply_seq_aux_loss), sequence-major
    as Megatron lays tokens out, without their coefficients."""
    B, S, _ = logits_BSE.shape
    logits = logits_BSE.transpose(0, 1).reshape(S * B, E)
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, K, score_function)
    out = {}
    if "aux_loss" in coefficients:
        out["load_balancing_loss"] = moe_utils.switch_load_balancing_loss_func(
            scores, routing_map.sum(0), S * B, K, E, 1.0)
    if "seq_aux_loss" in coefficients:
        out["seq_load_balancing_loss"] = moe_utils.switch_load_balancing_loss_func(
            scores.reshape(S, -1), routing_map.reshape(S, -1).sum(0), S, K, E, 1.0) / B
    return out


@pytest.mark.parametrize("score_function, extra", [
    ("softmax", {}), ("sigmoid", {}),
    ("sigmoid", dict(enable_expert_bias=True, num_groups=4, group_topk=2)),   # DeepSeek-V3's router
])
def test_several_load_balancing_losses_are_megatrons(score_function, extra):
    router = _router(score_function=score_function, load_balancing_type=["aux_loss", "seq_aux_loss"],
                     aux_loss_coeff=[1e-2, 1e-3], **extra)
    if extra.get("enable_expert_bias"):
        router.expert_bias.copy_(torch.linspace(-1, 1, E))   # the selection is not the top-k of the scores
    x = torch.randn(3 * 5, D, generator=torch.Generator().manual_seed(1))
    routing = router(x, num_sequences=3)
    logits = (x @ router.wg.weight.t()).view(3, 5, E)
    theirs = _megatron_losses(logits, score_function, {"aux_loss", "seq_aux_loss"})
    assert set(routing.tracked) == {"load_balancing_loss", "seq_load_balancing_loss"}
    for name, value in theirs.items():   # fp32 both (Megatron's softmax is fp32): summation order aside
        torch.testing.assert_close(routing.tracked[name], value, rtol=1e-5, atol=0)
    expected = 1e-2 * theirs["load_balancing_loss"] + 1e-3 * theirs["seq_load_balancing_loss"]
    torch.testing.assert_close(routing.aux_loss, expected, rtol=1e-5, atol=0)


def test_the_flags_take_megatrons_lists_and_its_rules():
    moe = configs(["--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
                   "--moe-aux-loss-coeff", "1e-2", "1e-3"]).moe
    assert moe.balancing_coefficients() == {"aux_loss": 1e-2, "seq_aux_loss": 1e-3}
    with pytest.raises(ConfigError, match="one --moe-aux-loss-coeff per --moe-router-load-balancing-type"):
        MoEConfig(num_experts=4, load_balancing_type=["aux_loss", "seq_aux_loss"], aux_loss_coeff=1e-2)
    with pytest.raises(ConfigError, match="sinkhorn.*no aux loss"):
        MoEConfig(num_experts=4, load_balancing_type="sinkhorn", aux_loss_coeff=1e-2)
    assert MoEConfig(num_experts=4, load_balancing_type="none", aux_loss_coeff=1e-2).balancing_coefficients() == {}


def test_sinkhorn_routing_is_megatrons():
    cost = torch.randn(20, E, dtype=torch.float32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(sinkhorn(cost), moe_utils.sinkhorn(cost), rtol=0, atol=0)
    router = _router(load_balancing_type="sinkhorn")
    x = torch.randn(20, D, generator=torch.Generator().manual_seed(3))
    logits = x @ router.wg.weight.t()
    router.train()
    routing = router(x)
    expected_ids = torch.topk(moe_utils.sinkhorn(logits), K, dim=1).indices   # training: balanced assignment
    assert torch.equal(routing.topk_ids_TK.sort(1).values, expected_ids.sort(1).values)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(routing.topk_weights_TK, probs.gather(1, routing.topk_ids_TK), rtol=1e-6, atol=0)
    router.eval()
    assert torch.equal(router(x).topk_ids_TK.sort(1).values, torch.topk(probs, K).indices.sort(1).values)
    assert routing.tracked == {} and float(routing.aux_loss) == 0.0


def test_forced_load_balancing_routes_at_random_and_passes_gradients_straight_through():
    layer = MoELayer(MoEConfig(hidden_size=D, ffn_hidden_size=8, num_experts=E, top_k=K,
                               force_load_balancing=True))
    x = torch.randn(4096, D, generator=torch.Generator().manual_seed(4))
    x[:, 0] += 100.0   # every real logit alike: unforced, the router would send every token the same way
    y, stats = layer(x)
    counts = stats.tokens_per_expert.double()
    assert (counts / counts.mean() - 1).abs().max() < 0.1, counts   # uniform in expectation
    y.sum().backward()
    assert layer.router.wg.weight.grad is not None and layer.router.wg.weight.grad.abs().sum() > 0


def test_the_console_names_each_loss(tmp_path, capsys):
    train(TINY + ["--train-iters", "2", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
                  "--moe-aux-loss-coeff", "1e-2", "1e-3"], str(tmp_path))
    line = [line for line in capsys.readouterr().out.splitlines() if "] iteration " in line][-1]
    assert "| load_balancing_loss: " in line and "| seq_load_balancing_loss: " in line and "| z_loss: " in line
