"""QAT on a GPT-MoE model under ZeroOptimizer (world of one): grids, storage, masters, schedule, config."""

import pytest
import torch
from torch.nn.utils import parametrize

from moezero.compression import QATConfig, apply_qat
from moezero.compression.targets import canonical_name
from moezero.config import ConfigError, GPTConfig, MoEConfig
from moezero.models import GPTModel, language_model_loss
from moezero.zero import ZeroOptimizer, weight_decay_groups

BITS = 4
GROUPS = 8


def _model(seed=5, **gpt):
    cfg = GPTConfig(
        **dict(
            dict(
                num_layers=2,
                hidden_size=32,
                num_attention_heads=2,
                seq_length=16,
                vocab_size=64,
                moe_layer_freq=2,
                hidden_dropout=0.0,
                attention_dropout=0.0,
            ),
            **gpt,
        )
    )
    return GPTModel(cfg, MoEConfig(num_experts=4, top_k=2), seed=seed)


def _batch(seed=0):
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, seed=0):
    x, y = _batch(seed)
    logits, stats = model(x)
    return language_model_loss(logits, y, torch.ones_like(y, dtype=torch.float32)) + sum(s.aux_loss for s in stats)


def _qat(model, **kw):
    cfg = QATConfig(**dict(dict(weight_bits=BITS, groups=GROUPS, modules="attention,mlp,experts,router"), **kw))
    return apply_qat(model, cfg, seed=11)


def _max_values_per_group(qat):
    """Most distinct values in any group of any effective (fake-quantized) weight."""
    most = 0
    for t in qat.targets:
        rows = getattr(t.module, t.attr).detach().reshape(t.units * GROUPS, -1)
        most = max(most, max(r.unique().numel() for r in rows))
    return most


def test_parametrization_keeps_each_parameter_object_and_storage():
    model = _model()
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    qat = _qat(model)
    after = {canonical_name(n): p for n, p in model.named_parameters()}
    assert after.keys() == before.keys()
    for name, (p, ptr) in before.items():
        assert after[name] is p and p.data_ptr() == ptr
    for t in qat.targets:
        assert parametrize.is_parametrized(t.module, t.attr)
        assert t.module.parametrizations[t.attr].original is t.parameter()
    assert {t.group for t in qat.targets} == {"attention", "mlp", "experts", "router"}


def test_training_under_zero_quantizes_the_forward_and_keeps_fp32_masters():
    torch.manual_seed(0)
    model = _model()
    qat = _qat(model)
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=3e-3, param_groups=weight_decay_groups(model, 0.01))
    _loss(model).detach()
    assert _max_values_per_group(qat) <= 2**BITS  # after the first forward
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    for step in range(4):
        previous = {t.name: t.parameter().detach().clone() for t in qat.targets}
        opt.backward(_loss(model, seed=step))
        opt.step()
        opt.zero_grad()
        qat.on_step_end(step + 1)
        for t in qat.targets:  # the trained Parameter is the parametrization's original, and it moves
            p = t.parameter()
            assert id(p) in trained
            assert not torch.equal(p.detach(), previous[t.name]), f"{t.name} did not move at step {step}"
        assert _max_values_per_group(qat) <= 2**BITS  # after N steps
    _loss(model)  # the forward guard raises if a param's storage left the optimizer's buffer
    # the masters (and the params that alias their all-gathered copies) are not on any 4-bit grid
    for pieces in opt.state_dict()["pieces"].values():
        for piece in pieces:
            master = piece["master"]
            assert master.unique().numel() > 4 * 2**BITS or master.numel() <= 4 * 2**BITS
    raw = max(t.parameter().detach().reshape(t.units * GROUPS, -1)[0].unique().numel() for t in qat.targets)
    assert raw > 2**BITS


def test_quantization_really_changes_the_loss():
    fp, q4, q16 = _model(), _model(), _model()
    _qat(q4)
    _qat(q16, weight_bits=16)
    x = _batch()[0]
    with torch.no_grad():
        base = fp(x)[0]
        assert (q4(x)[0] - base).abs().max() > 1e-2 and _loss(q4).item() != _loss(fp).item()
        assert (q16(x)[0] - base).abs().max() < 1e-3


def test_bit_schedule_advances_with_steps_and_restores():
    qat = _qat(_model(), start_bits=8, bits_period=2, schedule_offset=1)
    seen = []
    for step in range(12):
        seen.append(qat.bits)
        qat.on_step_end(step + 1)
    assert seen == [None, 8, 8, 7, 7, 6, 6, 5, 5, 4, 4, 4]
    other = _qat(_model(), start_bits=8, bits_period=2, schedule_offset=1)
    other.load_state_dict(qat.state_dict())
    assert (other.step, other.bits) == (12, 4)
    scalars = qat.scalars()
    assert scalars["qat/bits/experts"] == 4.0
    assert 0.0 < scalars["qat/quant-error/experts"] < 0.5 and 0.0 < scalars["qat/quant-error/router"] < 0.5


def test_full_precision_before_the_offset():
    fp, q = _model(), _model()
    _qat(q, schedule_offset=3)
    with torch.no_grad():
        assert torch.equal(fp(_batch()[0])[0], q(_batch()[0])[0])


def test_stochastic_rounding_is_keyed_by_step_and_eval_rounds_to_nearest():
    model = _model()
    qat = _qat(model, rounding="stochastic")
    w1 = model.layers[0].mlp.experts.w1
    first, again = w1.detach().clone(), model.layers[0].mlp.experts.w1.detach()
    assert torch.equal(first, again)  # same step: micro-batches and recompute see the same weights
    qat.on_step_end(1)
    assert not torch.equal(first, model.layers[0].mlp.experts.w1.detach())
    model.eval()
    nearest = _model()
    _qat(nearest)
    nearest.eval()
    assert torch.equal(model.layers[0].mlp.experts.w1, nearest.layers[0].mlp.experts.w1)


def test_quantized_embedding_keeps_its_weight_decay():
    """Megatron decays embedding tables (2-D); quantizing one (a parametrization) keeps it in its group."""
    model = _model()
    _qat(model, modules="embedding")
    groups = weight_decay_groups(model, 0.1)
    decay = next(g for g in groups if g["weight_decay"] == 0.1)["params"]
    assert any(p is model.embedding.parametrizations.weight.original for p in decay)


def test_activation_quantization_changes_the_output():
    a, b = _model(), _model()
    _qat(a)
    _qat(b, activation_bits=4)
    with torch.no_grad():
        assert not torch.allclose(a(_batch()[0])[0], b(_batch()[0])[0])


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(weight_bits=1), "--qat-weight-bits=1: must be between 2 and 16"),
        (dict(weight_bits=17), "--qat-weight-bits=17: must be between 2 and 16"),
        (dict(weight_bits=4, start_bits=3), "--qat-start-bits=3: must be >= --qat-weight-bits (4)"),
        (dict(weight_bits=4, modules="attention,moe"), "--qat-modules='attention,moe': unknown module group(s) moe"),
        (dict(weight_bits=4, rounding="up"), "--qat-rounding='up': must be one of nearest, stochastic"),
        (dict(activation_bits=8), "--qat-activation-bits=8: needs --qat-weight-bits"),
        # any --qat-* flag without --qat-weight-bits would do nothing
        (dict(groups=64), "--qat-groups=64: needs --qat-weight-bits"),
        (dict(rounding="stochastic"), "--qat-rounding='stochastic': needs --qat-weight-bits"),
        (dict(modules="experts"), "--qat-modules='experts': needs --qat-weight-bits"),
        (dict(schedule_offset=10), "--qat-schedule-offset=10: needs --qat-weight-bits"),
        (
            dict(weight_bits=4, modules="output,router", activation_bits=4),
            "--qat-activation-bits=4: quantizes the inputs of attention, mlp, shared_expert, experts",
        ),
        (dict(weight_bits=4, groups=0), "--qat-groups=0: must be >= 1"),
    ],
)
def test_bad_config_gives_one_clear_error(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        QATConfig(**kwargs)
    assert needle in str(info.value)


def test_groups_that_do_not_divide_a_tensor_name_it_and_the_flag():
    with pytest.raises(
        ConfigError,
        match=r"--qat-groups=7: does not divide layers\.0\.attention\.qkv\.weight "
        r"\(3072 elements\)",
    ):
        apply_qat(_model(), QATConfig(weight_bits=4, groups=7))
    with pytest.raises(ConfigError, match=r"experts\.w1 \(4096 elements per expert\)"):
        apply_qat(_model(), QATConfig(weight_bits=4, groups=3, modules="experts"))
    with pytest.raises(ConfigError, match="--qat-modules=output: the output layer shares its weight"):
        apply_qat(_model(), QATConfig(weight_bits=4, modules="output"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(symmetric=False, weight_bits=8, activation_bits=8),
        dict(weight_bits=12, modules="experts,embedding"),
    ],
)
def test_export_round_trip_equals_the_fake_quant_forward(kwargs, dtype):
    """Packed codes + scales, dequantized on load, give exactly the fake-quant model's weights and output."""
    from moezero.compression.description import ModelDescription
    from moezero.compression.export import export_quantized
    from moezero.compression.inference import load_checkpoint_weights, load_quantized_model
    from moezero.compression.source import CheckpointModel

    model = _model()
    state = {n: t.float() for n, t in model.state_dict().items()}
    description = ModelDescription.from_configs(model.config, MoEConfig(num_experts=4, top_k=2), dtype)
    source = CheckpointModel("memory", state, description, None, None, 0)
    spec = QATConfig(**dict(dict(weight_bits=BITS, groups=GROUPS, modules="attention,mlp,experts,router"), **kwargs))
    quantized, _ = load_quantized_model(export_quantized(source, spec))
    fake = load_checkpoint_weights(source, fake_quant=spec)
    for name, p in quantized.named_parameters():
        module, _, attr = name.rpartition(".")
        assert torch.equal(p, getattr(fake.get_submodule(module), attr)), name
    with torch.no_grad():
        assert torch.equal(quantized(_batch()[0])[0], fake(_batch()[0])[0])


def test_multi_latent_attention_projections_are_the_attention_group():
    from moezero.compression.targets import quant_targets

    config = GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=50,
        multi_latent_attention=True,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=8,
        qk_layernorm=True,
        position_embedding_type="rope",
    )
    model = GPTModel(config, MoEConfig(num_experts=2))
    names = [t.name for t in quant_targets(model, ["attention"])]
    assert names == [f"layers.0.attention.{p}.weight" for p in ("q_down", "q_up", "kv_down", "kv_up", "proj")]


def test_a_checkpoints_qat_forward_is_where_its_schedule_stood():
    """tools/generate.py fake-quantizes as the run's next forward: full precision before the offset, the start
    bits and each drop after it, the target at the end (it once took the target bits whatever the step)."""
    from moezero.compression.config import QATConfig
    from moezero.compression.source import CheckpointModel

    qat = QATConfig(weight_bits=4, start_bits=8, bits_period=2, schedule_offset=3)
    bits = {step: CheckpointModel("", {}, None, qat, step, step).qat_forward() for step in (0, 3, 5, 20)}
    assert bits[0] is None
    assert [bits[s].weight_bits for s in (3, 5, 20)] == [8, 7, 4]
    assert all(bits[s].start_bits == 8 for s in (3, 5, 20))  # load_checkpoint_weights fixes it at weight_bits
    assert CheckpointModel("", {}, None, None, None, 0).qat_forward() is None
    assert CheckpointModel("", {}, None, qat, None, 0).qat_forward() == qat  # no step recorded: the target
