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

E, K, D = 8, 2, 16


def moe_utils():
    """megatron-core's moe_utils, imported by the tests that call it rather than at collection."""
    return pytest.importorskip("megatron.core.transformer.moe.moe_utils")


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
    routing_map, scores = moe_utils().compute_routing_scores_for_aux_loss(logits, K, score_function)
    out = {}
    if "aux_loss" in coefficients:
        out["load_balancing_loss"] = moe_utils().switch_load_balancing_loss_func(
            scores, routing_map.sum(0), S * B, K, E, 1.0
        )
    if "seq_aux_loss" in coefficients:
        out["seq_load_balancing_loss"] = (
            moe_utils().switch_load_balancing_loss_func(
                scores.reshape(S, -1), routing_map.reshape(S, -1).sum(0), S, K, E, 1.0
            )
            / B
        )
    return out


@pytest.mark.parametrize(
    "score_function, extra",
    [
        ("softmax", {}),
        ("sigmoid", {}),
        ("sigmoid", dict(enable_expert_bias=True, num_groups=4, group_topk=2)),  # DeepSeek-V3's router
    ],
)
def test_several_load_balancing_losses_are_megatrons(score_function, extra):
    router = _router(
        score_function=score_function,
        load_balancing_type=["aux_loss", "seq_aux_loss"],
        aux_loss_coeff=[1e-2, 1e-3],
        **extra,
    )
    if extra.get("enable_expert_bias"):
        router.expert_bias.copy_(torch.linspace(-1, 1, E))  # the selection is not the top-k of the scores
    x = torch.randn(3 * 5, D, generator=torch.Generator().manual_seed(1))
    routing = router(x, num_sequences=3)
    logits = (x @ router.wg.weight.t()).view(3, 5, E)
    theirs = _megatron_losses(logits, score_function, {"aux_loss", "seq_aux_loss"})
    assert set(routing.tracked) == {"load_balancing_loss", "seq_load_balancing_loss"}
    for name, value in theirs.items():  # fp32 both (Megatron's softmax is fp32): summation order aside
        torch.testing.assert_close(routing.tracked[name], value, rtol=1e-5, atol=0)
    expected = 1e-2 * theirs["load_balancing_loss"] + 1e-3 * theirs["seq_load_balancing_loss"]
    torch.testing.assert_close(routing.aux_loss, expected, rtol=1e-5, atol=0)


def test_the_flags_take_megatrons_lists_and_its_rules():
    moe = configs(
        [
            "--num-experts",
            "4",
            "--moe-router-load-balancing-type",
            "aux_loss",
            "seq_aux_loss",
            "--moe-aux-loss-coeff",
            "1e-2",
            "1e-3",
        ]
    ).moe
    assert moe.balancing_coefficients() == {"aux_loss": 1e-2, "seq_aux_loss": 1e-3}
    with pytest.raises(ConfigError, match="one --moe-aux-loss-coeff per --moe-router-load-balancing-type"):
        MoEConfig(num_experts=4, load_balancing_type=["aux_loss", "seq_aux_loss"], aux_loss_coeff=1e-2)
    with pytest.raises(ConfigError, match="sinkhorn.*no aux loss"):
        MoEConfig(num_experts=4, load_balancing_type="sinkhorn", aux_loss_coeff=1e-2)
    assert MoEConfig(num_experts=4, load_balancing_type="none", aux_loss_coeff=1e-2).balancing_coefficients() == {}


def test_sinkhorn_routing_is_megatrons():
    cost = torch.randn(20, E, dtype=torch.float32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(sinkhorn(cost), moe_utils().sinkhorn(cost), rtol=0, atol=0)
    router = _router(load_balancing_type="sinkhorn")
    x = torch.randn(20, D, generator=torch.Generator().manual_seed(3))
    logits = x @ router.wg.weight.t()
    router.train()
    routing = router(x)
    expected_ids = torch.topk(moe_utils().sinkhorn(logits), K, dim=1).indices  # training: balanced assignment
    assert torch.equal(routing.topk_ids_TK.sort(1).values, expected_ids.sort(1).values)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(routing.topk_weights_TK, probs.gather(1, routing.topk_ids_TK), rtol=1e-6, atol=0)
    router.eval()
    assert torch.equal(router(x).topk_ids_TK.sort(1).values, torch.topk(probs, K).indices.sort(1).values)
    assert routing.tracked == {} and float(routing.aux_loss) == 0.0


def test_forced_load_balancing_routes_at_random_and_passes_gradients_straight_through():
    layer = MoELayer(MoEConfig(hidden_size=D, ffn_hidden_size=8, num_experts=E, top_k=K, force_load_balancing=True))
    x = torch.randn(4096, D, generator=torch.Generator().manual_seed(4))
    x[:, 0] += 100.0  # every real logit alike: unforced, the router would send every token the same way
    y, stats = layer(x)
    counts = stats.tokens_per_expert.double()
    assert (counts / counts.mean() - 1).abs().max() < 0.1, counts  # uniform in expectation
    y.sum().backward()
    assert layer.router.wg.weight.grad is not None and layer.router.wg.weight.grad.abs().sum() > 0


def test_the_console_names_each_loss(tmp_path, capsys):
    train(
        TINY
        + [
            "--train-iters",
            "2",
            "--moe-router-load-balancing-type",
            "aux_loss",
            "seq_aux_loss",
            "--moe-aux-loss-coeff",
            "1e-2",
            "1e-3",
        ],
        str(tmp_path),
    )
    line = [line for line in capsys.readouterr().out.splitlines() if "] iteration " in line][-1]
    assert "| load_balancing_loss: " in line and "| seq_load_balancing_loss: " in line and "| z_loss: " in line


def _routing_of_logits(logits_TE, **kwargs):
    """moezero's routing of these exact logits (an identity gate), as Megatron's [T, E] probabilities."""
    T, experts = logits_TE.shape
    router = TopKRouter(MoEConfig(hidden_size=experts, num_experts=experts, **kwargs))
    router.wg.weight.data.copy_(torch.eye(experts))
    routing = router(logits_TE)
    return torch.zeros(T, experts).scatter(1, routing.topk_ids_TK, routing.topk_weights_TK)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=2),
        dict(top_k=2, pre_softmax=True),
        dict(top_k=4, topk_scaling_factor=2.5),
        dict(top_k=4, num_groups=4, group_topk=2),
        dict(top_k=4, num_groups=4, group_topk=2, pre_softmax=True),
        dict(top_k=3, score_function="sigmoid"),
        dict(top_k=4, score_function="sigmoid", num_groups=4, group_topk=2),
        # a group's score: the sum of its top top_k / group_topk (here 3 and 1, not DeepSeek-V3's top two)
        dict(top_k=3, num_groups=2, group_topk=1),
        dict(top_k=2, score_function="sigmoid", num_groups=4, group_topk=2),
    ],
)
def test_the_selection_and_weights_are_megatrons(kwargs):
    """Megatron's topk_routing_with_score_function: after the top-k the softmax selects on the logits, groups
    scored by their logits too (a softmax's sum of the top probabilities ranks groups otherwise)."""
    logits = torch.randn(64, E, generator=torch.Generator().manual_seed(5)) * 2
    theirs, _ = moe_utils().topk_routing_with_score_function(
        logits,
        kwargs["top_k"],
        use_pre_softmax=kwargs.get("pre_softmax", False),
        num_groups=kwargs.get("num_groups"),
        group_topk=kwargs.get("group_topk"),
        scaling_factor=kwargs.get("topk_scaling_factor"),
        score_function=kwargs.get("score_function", "softmax"),
    )
    torch.testing.assert_close(_routing_of_logits(logits, **kwargs), theirs, rtol=1e-6, atol=0)


def test_groups_and_near_ties_are_chosen_by_the_logits():
    """Two tokens a review found routed unlike Megatron when the selection ran on softmax probabilities."""
    groups = torch.tensor([[2.0, -10.0, 0.0, 0.0]])  # group {0, 1} has the larger probability sum, {2, 3} logits
    assert torch.equal(
        _routing_of_logits(groups, top_k=2, num_groups=2, group_topk=1), torch.tensor([[0.0, 0.0, 0.5, 0.5]])
    )
    near_tie = torch.tensor([[0.5, 0.0, 1e-9, -5.0]])  # softmax rounds logits 0 and 1e-9 to one probability
    assert _routing_of_logits(near_tie, top_k=2)[0, 2] > 0


def test_the_expert_bias_counts_the_assignments_capacity_kept():
    """Megatron updates the bias from the routing map after dropping: an expert that dropped tokens is not
    counted as loaded by them."""
    from moezero.moe.expert_bias import ExpertBiasUpdater

    router = TopKRouter(
        MoEConfig(
            hidden_size=4,
            num_experts=4,
            top_k=1,
            score_function="sigmoid",
            enable_expert_bias=True,
            capacity_factor=1.0,
        )
    )
    router.wg.weight.data.copy_(torch.eye(4))
    logits = torch.full((16, 4), -1.0)
    logits[:9, 0] = 1.0  # 9 tokens want expert 0; its capacity is 4
    logits[9:12, 1] = logits[12:15, 2] = logits[15, 3] = 1.0
    updater = ExpertBiasUpdater(router, None)
    routing = router(logits)
    assert routing.tokens_per_expert_E.tolist() == [9, 3, 3, 1]
    assert routing.kept_per_expert_E.tolist() == [4, 3, 3, 1]
    updater.step()
    assert router.expert_bias.tolist() == pytest.approx([-1e-3, -1e-3, -1e-3, 1e-3])  # mean 2.75 kept per expert


def test_a_top1_softmax_router_needs_the_softmax_first():
    """Megatron's rule: after the top-1 the softmax is over one logit, 1.0 for every token, and the router would
    not learn from the loss."""
    from moezero.training.configs import validate

    with pytest.raises(ConfigError, match="--moe-router-topk 1: needs --moe-router-pre-softmax"):
        validate(configs(TINY + ["--moe-router-topk", "1"]), world_size=1)
    for allowed in (["--moe-router-pre-softmax"], ["--moe-router-score-function", "sigmoid"]):
        validate(configs(TINY + ["--moe-router-topk", "1"] + allowed), world_size=1)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["--moe-router-enable-expert-bias"],
            "--moe-router-enable-expert-bias: only with --moe-router-score-function sigmoid",
        ),
        (["--moe-router-group-topk", "2"], "--moe-router-group-topk=2: group-limited routing needs"),
    ],
)
def test_router_settings_megatron_refuses_are_refused(argv, needle):
    """megatron-core's TransformerConfig refuses an expert bias on softmax scores and a group top-k without groups
    (moezero trained the first and ignored the second); a negative capacity factor is its spelling of dropless."""
    from moezero.training.configs import validate

    with pytest.raises(ConfigError, match=needle):
        validate(configs(TINY + argv), world_size=1)
    validate(
        configs(TINY + ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]), world_size=1
    )
    assert configs(TINY + ["--moe-expert-capacity-factor", "-1"]).moe.capacity_factor is None
