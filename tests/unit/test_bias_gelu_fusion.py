"""Megatron's --bias-gelu-fusion is on by default, and it is not only a kernel: an MLP with biases and GELU then
runs megatron-core's bias_gelu_impl, the tanh-approximated GELU. moezero gives a Megatron flag set the same
function: every MLP and expert follows the flag (Megatron refuses its fused GELU in MoE layers, so its MoE scripts
with GELU and biases pass --no-bias-gelu-fusion: the exact GELU, here too). The oracle is megatron-core's own
fused_bias_gelu (the installed wheel), in float64."""

import dataclasses

import pytest
import torch

from moezero.config import upgrade_stored_configs
from moezero.training.megatron_flags import megatron_table
from moezero.training.resume import CheckpointError, ResumePoint, apply_checkpoint_args, check_same_model
from tests.integration.pretrain_utils import configs

SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16"]


def _dense_mlp(argv):
    from moezero.parallel import ParallelGroups
    from moezero.training.builders import build_model

    return build_model(configs(SHAPE + argv), ParallelGroups.single(), 100).layers[0].mlp


@pytest.fixture
def megatron_bias_gelu(monkeypatch):
    """megatron-core's GeLUFunction with its two functions as written (its jit_fuser, torch.compile, left out)."""
    fused = pytest.importorskip("megatron.core.fusions.fused_bias_gelu")
    for name in ("bias_gelu", "bias_gelu_back"):
        function = getattr(fused, name)
        monkeypatch.setattr(fused, name, getattr(function, "_torchdynamo_orig_callable", function))
    return fused.bias_gelu_impl


def _forward_and_grads(mlp, x, activation_of_fc1):
    x = x.clone().requires_grad_(True)
    params = [mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight]
    out = mlp.fc2(activation_of_fc1(x)) if activation_of_fc1 else mlp(x)
    grads = torch.autograd.grad(
        (out * torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out)).sum(), [x] + params
    )
    return out.detach(), grads


def test_a_dense_mlp_with_biases_computes_megatrons_fused_bias_gelu(megatron_bias_gelu):
    mlp = _dense_mlp([]).double()
    assert mlp.activation == "gelu_tanh"
    x = torch.randn(5, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    theirs = _forward_and_grads(mlp, x, lambda x: megatron_bias_gelu(x @ mlp.fc1.weight.t(), mlp.fc1.bias))
    ours = _forward_and_grads(mlp, x, None)
    # Megatron writes its constants to 8-10 digits (0.79788456 for sqrt(2/pi)): ~1e-9 apart from torch's here
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8)
    mlp.activation = "gelu"  # the exact GELU, same weights: far outside that tolerance
    assert (_forward_and_grads(mlp, x, None)[0] - theirs[0]).abs().max() > 100 * 1e-8


@pytest.mark.parametrize(
    "argv, kind",
    [
        ([], "gelu_tanh"),  # Megatron's default: --bias-gelu-fusion, biases on
        (["--no-bias-gelu-fusion"], "gelu"),
        (["--disable-bias-linear"], "gelu"),  # Megatron's validate_args turns the fusion off
        (["--swiglu"], "swiglu"),
    ],
)
def test_every_mlp_and_expert_has_the_gelu_of_the_flags(argv, kind):
    from moezero.parallel import ParallelGroups
    from moezero.training.builders import build_model

    assert configs(SHAPE + argv).model.mlp_activation() == kind
    assert _dense_mlp(argv).activation == kind
    moe = configs(
        SHAPE
        + argv
        + ["--num-experts", "4", "--moe-layer-freq", "([0]+[1])", "--moe-shared-expert-intermediate-size", "8"]
    )
    layers = build_model(moe, ParallelGroups.single(), 100).layers
    assert (layers[0].mlp.activation, layers[1].mlp.experts.activation, layers[1].mlp.shared_expert.activation) == (
        kind,
        kind,
        kind,
    )


def test_megatrons_parser_has_the_fusion_on_by_default():
    flag = megatron_table()["flags"]["--no-bias-gelu-fusion"]
    assert (flag["action"], flag["dest"], flag["default"]) == ("storefalse", "bias_gelu_fusion", True)


def _as_stored(cfg):
    """The model sections as a checkpoint stores them."""
    return {section: dataclasses.asdict(getattr(cfg, section)) for section in ("model", "moe")}


def _stored(argv):
    cfg = configs(SHAPE + argv)
    stored = _as_stored(cfg)
    del stored["model"]["no_bias_gelu_fusion"]  # as a checkpoint from before the flag stored them
    return cfg, upgrade_stored_configs(stored)


def test_a_checkpoint_from_before_the_flag_keeps_the_exact_gelu_it_was_trained_with():
    for argv in ([], ["--num-experts", "4"]):
        cfg, stored = _stored(argv)
        assert stored["model"]["no_bias_gelu_fusion"] is True
        with pytest.raises(CheckpointError, match="--no-bias-gelu-fusion: True in the checkpoint, False now"):
            check_same_model(cfg, ResumePoint("ckpt", 3, stored, {}))
        resumed = apply_checkpoint_args(cfg, ResumePoint("ckpt", 3, stored, {}), lambda _: None)
        assert resumed.model.mlp_activation() == "gelu"
    for argv in (["--disable-bias-linear"], ["--swiglu"]):  # no GELU with biases: the same model either way
        cfg, stored = _stored(argv)
        check_same_model(cfg, ResumePoint("ckpt", 3, stored, {}))


@pytest.mark.parametrize("argv", [["--swiglu"], ["--disable-bias-linear"]], ids=str)
def test_where_the_flag_decides_nothing_a_resume_does_not_compare_it(argv):
    saved, now = configs(SHAPE + argv), configs(SHAPE + argv + ["--no-bias-gelu-fusion"])
    check_same_model(now, ResumePoint("ckpt", 3, _as_stored(saved), {}))
    check_same_model(saved, ResumePoint("ckpt", 3, _as_stored(now), {}))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_the_fused_training_path_computes_the_flags_gelu(approximate):
    """fp32 with gradients runs the fused kernel where it is built (float64 never does; without it, torch's GELU of
    the form): the dense MLP and the experts (a bias per expert, an expert with no rows) against torch's GELU of
    that form on the biased input, and not the other."""
    import torch.nn.functional as F

    from moezero.config import MoEConfig
    from moezero.moe.experts import DenseMLP, GroupedExperts
    from moezero.ops import _loader
    from moezero.ops.gelu import fused_gelu_applies
    from moezero.parallel.expert_marker import ExpertShard

    kind = "gelu_tanh" if approximate == "tanh" else "gelu"
    counts = [5, 0, 9, 3]
    generator = torch.Generator().manual_seed(1)
    experts = GroupedExperts(
        MoEConfig(hidden_size=48, num_experts=4, ffn_hidden_size=40, activation=kind, bias=True), ExpertShard(4, 0, 1)
    )
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    dense = DenseMLP(48, 40, kind, bias=True)
    x = (torch.randn(sum(counts), 48, generator=generator) * 2).requires_grad_(True)
    assert fused_gelu_applies(x) == (_loader.load("cpu") is not None)  # CI builds it (test_loader.py checks)

    def torch_experts(form):
        def run(x):
            h = torch.cat([x_l @ experts.w1[l] + experts.b1[l] for l, x_l in enumerate(x.split(counts))])
            a = F.gelu(h, approximate=form)
            return torch.cat([a_l @ experts.w2[l] + experts.b2[l] for l, a_l in enumerate(a.split(counts))])

        return run

    def torch_dense(form):
        return lambda x: dense.fc2(F.gelu(dense.fc1(x), approximate=form))

    def outputs_and_grads(run, params):
        out = run(x)
        return [out] + list(torch.autograd.grad(out.square().sum(), [x] + params))

    def worst_error(got, want):  # relative to each tensor's scale: fp32 sums of different orders
        return max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))

    other = "none" if approximate == "tanh" else "tanh"
    for ours, theirs, module in ((lambda x: experts(x, counts), torch_experts, experts), (dense, torch_dense, dense)):
        params = list(module.parameters())
        got = outputs_and_grads(ours, params)
        assert worst_error(got, outputs_and_grads(theirs(approximate), params)) < 1e-5
        assert worst_error(got, outputs_and_grads(theirs(other), params)) > 1e-4
