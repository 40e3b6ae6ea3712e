import math

import pytest
import torch

from moezero.config import ConfigError
from moezero.keyed_random import SampleKeys
from moezero.moe import MoEConfig, MoELayer
from moezero.moe.experts import grouped_mm, grouped_mm_supported, loop_mm
from moezero.moe.load_balancing import switch_aux_loss
from moezero.moe.router import capacity_keep_mask, expert_capacity, router_z_loss
from moezero.parallel import ParallelGroups
from tests.moe_reference import naive_moe

SINGLE = ParallelGroups.single()


def _layer(dtype=torch.float64, **kw):
    cfg = dict(hidden_size=12, ffn_hidden_size=20, num_experts=4, top_k=2, aux_loss_coeff=0.0)
    cfg.update(kw)
    return MoELayer(MoEConfig(**cfg), SINGLE).to(dtype)


def _check_against_naive(layer, x, atol):
    cfg = layer.config
    x = x.clone().requires_grad_(True)
    y, _ = layer(x)
    params = [layer.router.wg.weight, layer.experts.w1, layer.experts.w2]
    ref_params = [p.detach().clone().requires_grad_(True) for p in params]
    x_ref = x.detach().clone().requires_grad_(True)
    bias = layer.router.expert_bias if cfg.enable_expert_bias else None
    y_ref = naive_moe(x_ref.reshape(-1, x.shape[-1]), *ref_params, cfg, bias).view(x.shape)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=atol)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x] + params, g)
    ref_grads = torch.autograd.grad(y_ref, [x_ref] + ref_params, g)
    for name, a, b in zip(["x", "wg", "w1", "w2"], grads, ref_grads):
        torch.testing.assert_close(a, b, atol=atol, rtol=atol, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(top_k=1),
        dict(top_k=4),  # k = num_experts
        dict(score_function="sigmoid", top_k=3),
        dict(pre_softmax=True),
        dict(activation="swiglu"),
        dict(enable_expert_bias=True),
    ],
)
def test_dropless_equals_naive_loop_float64(kw):
    torch.manual_seed(0)
    layer = _layer(**kw)
    if kw.get("enable_expert_bias"):
        layer.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    _check_against_naive(layer, torch.randn(3, 5, 12, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("grouped", [True, False])
def test_fp32_grouped_and_loop_paths_equal_naive(grouped):
    torch.manual_seed(1)
    layer = _layer(torch.float32, hidden_size=16, ffn_hidden_size=32, grouped_gemm=grouped)
    _check_against_naive(layer, torch.randn(4, 7, 16), atol=1e-5)


def test_edge_cases():
    torch.manual_seed(2)
    # one token; hidden not a multiple of 8; an expert that gets nothing
    _check_against_naive(_layer(hidden_size=13, ffn_hidden_size=7), torch.randn(1, 13, dtype=torch.float64), 1e-12)
    # every token to expert 2: a strongly biased gate
    layer = _layer()
    with torch.no_grad():
        layer.router.wg.weight.zero_()
        layer.router.wg.weight[2] = 5.0
    x = torch.rand(2, 6, 12, dtype=torch.float64) + 0.5
    _, stats = layer(x)
    assert stats.tokens_per_expert[2].item() == 12
    _check_against_naive(layer, x, 1e-12)
    # zero tokens
    y, stats = _layer()(torch.zeros(0, 12, dtype=torch.float64))
    assert y.shape == (0, 12) and stats.tokens_per_expert.sum() == 0


def test_bf16_layer_runs_and_tracks_fp32():
    torch.manual_seed(3)
    layer32 = _layer(torch.float32, hidden_size=16, ffn_hidden_size=32)
    layer16 = _layer(torch.bfloat16, hidden_size=16, ffn_hidden_size=32)
    layer16.load_state_dict({k: v.bfloat16() for k, v in layer32.state_dict().items()})
    x = torch.randn(2, 8, 16)
    y32, _ = layer32(x.bfloat16().float())
    y16, stats = layer16(x.bfloat16())
    assert y16.dtype == torch.bfloat16 and stats.aux_loss.dtype == torch.float32
    y16.float().sum().backward()
    assert layer16.router.wg.weight.grad.dtype == torch.bfloat16
    assert layer16.router.wg.weight.grad.abs().sum() > 0
    torch.testing.assert_close(y16.float(), y32, atol=0.05, rtol=0.05)


def test_grouped_mm_guard_and_fallback():
    x = torch.randn(6, 16)
    w = torch.randn(3, 16, 8)
    assert grouped_mm_supported(x, w)
    assert not grouped_mm_supported(x.double(), w.double())  # float64 rejected
    assert not grouped_mm_supported(torch.randn(6, 12).bfloat16(), torch.randn(3, 12, 8).bfloat16())  # 24-byte rows
    assert not grouped_mm_supported(torch.randn(0, 16), w)  # no rows: backward would fail
    counts = [2, 0, 4]
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ya, yb = grouped_mm(xa, wa, counts), loop_mm(xb, wb, counts)
    torch.testing.assert_close(ya, yb)
    g = torch.randn(8, 6).t()  # a non-contiguous incoming gradient
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(wa.grad, wb.grad)


def test_aux_and_z_loss_formulas_and_gradients():
    torch.manual_seed(4)
    layer = _layer(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x = torch.randn(10, 12, dtype=torch.float64)
    _, stats = layer(x)
    logits = x @ layer.router.wg.weight.t()
    probs = torch.softmax(logits, -1)
    ids = torch.topk(probs, 2).indices
    f = torch.bincount(ids.reshape(-1), minlength=4).double() / 20
    expected_aux = 0.1 * 4 * (f * probs.mean(0)).sum()
    expected_z = 0.01 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(
        stats.aux_loss, expected_aux.float() if stats.aux_loss.dtype == torch.float32 else expected_aux
    )
    torch.testing.assert_close(stats.z_loss.double(), expected_z)
    for loss in (stats.aux_loss, stats.z_loss):
        (g,) = torch.autograd.grad(loss, layer.router.wg.weight, retain_graph=True)
        assert g.abs().sum() > 0
    assert switch_aux_loss(torch.full((8, 4), 0.25), torch.tensor([4, 4, 4, 4]), 2).item() == pytest.approx(1.0)
    assert router_z_loss(torch.zeros(3, 4)).item() == pytest.approx(math.log(4) ** 2)


def test_sequence_aux_loss_averages_per_sequence_losses():
    torch.manual_seed(5)
    layer = _layer(aux_loss_coeff=1.0, load_balancing_type="seq_aux_loss")
    x = torch.randn(3, 4, 12, dtype=torch.float64)
    _, stats = layer(x)
    per_seq = []
    for b in range(3):
        probs = torch.softmax(x[b] @ layer.router.wg.weight.t(), -1)
        ids = torch.topk(probs, 2).indices
        f = torch.bincount(ids.reshape(-1), minlength=4).double() / 8
        per_seq.append(4 * (f * probs.mean(0)).sum())
    torch.testing.assert_close(stats.aux_loss.double(), torch.stack(per_seq).mean())


def test_capacity_policies_drop_exactly_the_documented_assignments():
    # 6 tokens, top-1; expert 0 wanted by tokens 0,1,3,4 with weights .5,.9,.7,.85; capacity 2
    ids = torch.tensor([[0], [0], [1], [0], [0], [1]])
    w = torch.tensor([[0.5], [0.9], [0.8], [0.7], [0.85], [0.6]])
    by_probs = capacity_keep_mask(ids, w, 2, 2, "probs").view(-1).tolist()
    assert by_probs == [False, True, True, False, True, True]
    # "position": torch.topk's picks among the routing map's ones, tokens in Megatron's sequence-major order
    for sequences in (1, 2, 3):
        map_TE = torch.zeros(6, 2, dtype=torch.int32).scatter_(1, ids, 1)
        sequence_major = map_TE.view(sequences, -1, 2).transpose(0, 1).reshape(6, 2)
        picked = torch.topk(sequence_major, 2, dim=0, sorted=False).indices
        kept = torch.zeros(6, 2, dtype=torch.bool).scatter_(0, picked, True)
        kept = kept.view(-1, sequences, 2).transpose(0, 1).reshape(6, 2).gather(1, ids)
        assert torch.equal(capacity_keep_mask(ids, w, 2, 2, "position", sequences), kept)
        assert kept.sum() == 4
    assert capacity_keep_mask(ids, w, 2, 7, "position").all()  # a capacity above the tokens drops nothing
    assert expert_capacity(num_tokens=6, num_experts=2, top_k=1, capacity_factor=0.5) == 2


def test_capacity_dropping_in_the_layer():
    torch.manual_seed(6)
    layer = _layer(capacity_factor=0.5, token_drop_policy="position")
    x = torch.randn(16, 12, dtype=torch.float64)
    y, stats = layer(x)
    capacity = expert_capacity(16, 4, 2, 0.5)
    logits = x @ layer.router.wg.weight.t()
    ids = torch.topk(logits, 2).indices
    kept = capacity_keep_mask(ids, torch.ones(16, 2, dtype=torch.float64), 4, capacity, "position")
    assert stats.dropped_fraction.item() == pytest.approx(1 - kept.float().mean().item())
    assert stats.dropped_fraction.item() > 0
    # a token whose assignments were all dropped gets a zero output
    fully_dropped = (~kept).all(1)
    if fully_dropped.any():
        assert y[fully_dropped].abs().max() == 0


def test_jitter_is_keyed_by_sample_not_by_rank_stream():
    torch.manual_seed(7)
    layer = _layer(input_jitter_eps=0.1)
    x = torch.randn(4, 3, 12, dtype=torch.float64)
    keys = SampleKeys(seed=1, iteration=5, sample_ids=(10, 11, 12, 13))
    y_all, _ = layer(x, keys=keys)
    y_half, _ = layer(x[2:], keys=SampleKeys(1, 5, (12, 13)))  # another layout sees samples 12, 13 alone
    torch.testing.assert_close(y_all[2:], y_half, rtol=1e-12, atol=1e-14)  # only summation order differs
    y_other, _ = layer(x, keys=SampleKeys(1, 6, (10, 11, 12, 13)))
    assert not torch.equal(y_all, y_other)
    layer.eval()  # Megatron's router jitters in evaluation too: the same keys draw the same noise
    y_eval, _ = layer(x, keys=keys)
    layer.router.config.input_jitter_eps = None
    y_plain, _ = layer(x, keys=keys)
    layer.train()
    assert torch.equal(y_all, y_eval) and not torch.equal(y_eval, y_plain)


def test_init_is_keyed_by_global_expert():
    a = MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, init_seed=3), SINGLE, layer_number=1)
    b = MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, init_seed=3), SINGLE, layer_number=1)
    c = MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, init_seed=3), SINGLE, layer_number=2)
    assert torch.equal(a.experts.w1, b.experts.w1) and not torch.equal(a.experts.w1, c.experts.w1)
    assert not torch.equal(a.experts.w1[0], a.experts.w1[1])


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(num_experts=3), "--num-experts=3: must be divisible by --expert-model-parallel-size (2)"),
        (dict(top_k=5), "--moe-router-topk=5"),
        (dict(capacity_factor=0.0), "--moe-expert-capacity-factor"),  # a negative one is dropless (Megatron)
        (dict(score_function="tanh"), "--moe-router-score-function"),
    ],
)
def test_bad_config_fails_at_construction(kw, needle):
    from moezero.parallel import rank_layout

    fake_ep2 = ParallelGroups(rank_layout(2, 2), rank=0)  # sizes only; no communication happens
    cfg = dict(hidden_size=8, num_experts=4)
    cfg.update(kw)
    with pytest.raises(ConfigError) as info:
        MoELayer(MoEConfig(**cfg), fake_ep2)
    assert needle in str(info.value)


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss", "none"])
@pytest.mark.parametrize("shape", [(0, 12), (0, 5, 12), (3, 0, 12)])
def test_an_empty_micro_batch_works_for_every_loss_type(balancing, shape):
    layer = _layer(load_balancing_type=balancing, aux_loss_coeff=0.01, z_loss_coeff=1e-3, capacity_factor=1.0)
    x = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    y, stats = layer(x)
    assert y.shape == x.shape
    for loss in (stats.aux_loss, stats.z_loss, stats.dropped_fraction):
        assert torch.isfinite(loss) and loss.item() == 0.0
    (y.sum() + stats.aux_loss + stats.z_loss).backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


def test_the_expert_bias_stays_fp32_in_a_bf16_model_and_its_updates_land():
    """In bf16 an update of 1e-3 to a bias of 0.5 is lost (up) or doubled (down): the router keeps the bias
    fp32 whatever the model is cast to (it only chooses experts; nothing multiplies by it)."""
    from moezero.moe.expert_bias import updated_expert_bias

    layer = MoELayer(MoEConfig(hidden_size=16, num_experts=4, enable_expert_bias=True)).to(torch.bfloat16)
    bias = layer.router.expert_bias
    assert bias.dtype == torch.float32 and layer.router.wg.weight.dtype == torch.bfloat16
    bias.fill_(0.5)
    bias.copy_(updated_expert_bias(bias, torch.tensor([1.0, 5.0, 5.0, 5.0]), 1e-3))
    torch.testing.assert_close(bias, torch.tensor([0.501, 0.499, 0.499, 0.499]), rtol=0, atol=1e-7)
    assert layer.double().router.expert_bias.dtype == torch.float64
    assert "router.expert_bias" in layer.state_dict()
    layer(torch.randn(6, 16, dtype=torch.float64))


def test_expert_bias_updates_are_the_same_when_layers_are_recomputed():
    """The routers' forward hooks count a recomputed layer twice (every micro-batch alike): the counts and
    their mean double, the update's signs do not change."""
    from moezero.config import GPTConfig
    from moezero.models import GPTModel
    from moezero.moe.expert_bias import ExpertBiasUpdater

    biases = []
    for recompute in ({}, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}):
        gpt = GPTConfig(
            num_layers=2,
            hidden_size=16,
            num_attention_heads=2,
            vocab_size=40,
            seq_length=8,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **recompute,
        )
        model = GPTModel(gpt, MoEConfig(num_experts=4, enable_expert_bias=True, bias_update_rate=0.01), seed=3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ExpertBiasUpdater(model, None).attach(optimizer)
        for step in range(3):
            for micro in range(2):
                tokens = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(10 * step + micro))
                model(tokens)[0].square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        biases.append(torch.cat([layer.mlp.router.expert_bias for layer in model.layers]))
    assert biases[0].abs().sum() > 0
    torch.testing.assert_close(biases[0], biases[1], rtol=0, atol=0)


def test_the_routers_bias_starts_as_megatrons():
    """megatron-core's router initialises its bias with init_method, as its weight (router.py's reset_parameters);
    every other bias starts at zero."""
    import dataclasses

    from moezero.models import GPTModel
    from tests.integration.pretrain_utils import TINY, configs

    cfg = configs(TINY + ["--num-experts", "256", "--init-method-std", "0.03"])
    model = GPTModel(dataclasses.replace(cfg.model, vocab_size=64), cfg.moe, seed=1)
    for name, p in model.named_parameters():
        if name.endswith("router.wg.bias"):
            assert abs(p.std().item() - 0.03) < 0.006 and abs(p.mean().item()) < 0.006, name
        elif name.endswith(("bias", ".b1", ".b2")):
            assert not p.any(), name
