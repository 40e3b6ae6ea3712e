"""--delay-wgrad-compute: the experts' weight gradients come from a node of their own, made where the MoE layer
makes it (after launching the rows' all-to-all), and autograd reaches it after the experts' backward. The
gradients are the GEMMs autograd runs itself: equal bit for bit, on the grouped GEMM (fp32, bf16) and the
per-expert loop (float64, and every dtype with --moe-grouped-gemm off), padded rows or not, an expert without
rows included."""

import pytest
import torch

from moezero.moe import MoEConfig, MoELayer
from moezero.moe.experts import GroupedExperts
from moezero.parallel.expert_marker import ExpertShard

COUNTS = [5, 0, 11, 16]


def _experts(delay, dtype, **kw):
    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=24, num_experts=4, delay_wgrad_compute=delay, **kw)
    experts = GroupedExperts(cfg, ExpertShard(4, 0, 1))
    with torch.no_grad():
        for i, p in enumerate(experts.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.3)
    return experts.to(dtype)


def _grads(delay, dtype, **kw):
    experts = _experts(delay, dtype, **kw)
    x = torch.randn(sum(COUNTS), 16, generator=torch.Generator().manual_seed(9)).to(dtype).requires_grad_(True)
    deferred = experts.defer_weight_grads()
    assert (deferred is not None) == delay
    y = experts(x, COUNTS) if deferred is None else experts(x, COUNTS, deferred)
    y.backward(torch.linspace(-1, 1, y.numel()).view(y.shape).to(dtype))
    return [x.grad] + [p.grad for p in experts.parameters()]


@pytest.mark.parametrize(
    "dtype,kw",
    [
        (torch.float32, {}),
        (torch.bfloat16, {}),
        (torch.float64, {}),
        (torch.float32, {"grouped_gemm": False}),
        (torch.float32, {"pad_expert_rows": False}),
        (torch.float32, {"activation": "swiglu"}),
    ],
)
def test_delayed_weight_gradients_equal_autograds_own(dtype, kw):
    for delayed, plain in zip(_grads(True, dtype, **kw), _grads(False, dtype, **kw)):
        assert delayed is not None and torch.equal(delayed, plain)


def test_the_weight_gradients_wait_for_the_node_made_after_the_launch():
    """Made before the experts run, the node is reached last: after the GEMMs' backward gave it their inputs."""
    order = []
    experts = _experts(True, torch.float32)
    experts.w1.register_post_accumulate_grad_hook(lambda p: order.append("w1"))
    x = torch.randn(sum(COUNTS), 16, requires_grad=True)
    x.register_hook(lambda g: order.append("x"))
    deferred = experts.defer_weight_grads()
    experts(x * 1.0, COUNTS, deferred).sum().backward()
    assert order == ["x", "w1"]


def test_an_moe_layer_with_the_flag_trains_as_without_it():
    layers = [
        MoELayer(
            MoEConfig(
                hidden_size=16, ffn_hidden_size=24, num_experts=4, top_k=2, init_seed=5, delay_wgrad_compute=delay
            )
        ).double()
        for delay in (True, False)
    ]
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for layer in layers:
        y, stats = layer(x)
        (y.square().sum() + stats.aux_loss).backward()
    for (name, p), q in zip(layers[0].named_parameters(), layers[1].parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantization_aware_experts_with_the_flag_train_as_without_it(rounding):
    """QAT's weights are parametrized (a new fake-quantized tensor at each read): the deferred node and the GEMMs
    must use the same reads, whose gradient reaches the params through the straight-through estimator."""
    import dataclasses
    from moezero.compression import apply_qat
    from moezero.models import GPTModel
    from tests.integration.pretrain_utils import TINY, configs

    grads = []
    for delay in (True, False):
        cfg = configs(
            TINY + ["--qat-weight-bits", "8", "--qat-rounding", rounding] + (["--delay-wgrad-compute"] if delay else [])
        )
        model = GPTModel(dataclasses.replace(cfg.model, vocab_size=64), cfg.moe, seed=3).double()
        apply_qat(model, cfg.qat, None, 7)
        model.train()
        torch.manual_seed(0)  # the same dropout draws
        logits, stats = model(torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(4)))
        (logits.square().mean() + sum(s.aux_loss for s in stats)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert any("experts" in n for n in grads[0])
    for name, g in grads[1].items():
        assert grads[0][name] is not None and torch.equal(grads[0][name], g), name
