"""Rotary embeddings as Megatron builds them from its command line: multi-latent attention's defaults live in
megatron-core's MLATransformerConfig (YaRN unless --rope-type says otherwise; original_max_position_embeddings,
beta_fast and beta_slow, which no flag reaches), and --rotary-seq-len-interpolation-factor is linear position
interpolation of standard attention's RoPE. The oracles are megatron-core's config classes and embeddings."""

import dataclasses
import math

import pytest
import torch

from moezero.config import ConfigError, GPTConfig
from moezero.config.model import upgrade_stored_configs
from moezero.models.mla import MultiLatentAttention
from moezero.models.rope import Rotary, yarn_of
from moezero.training.megatron_flags import megatron_table
from tests.integration.pretrain_utils import configs

transformer_config = pytest.importorskip("megatron.core.transformer.transformer_config")
embeddings = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
yarn_embeddings = pytest.importorskip("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")

MLA = [
    "--multi-latent-attention",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--q-lora-rank",
    "32",
    "--kv-lora-rank",
    "16",
    "--qk-head-dim",
    "16",
    "--qk-pos-emb-head-dim",
    "8",
    "--v-head-dim",
    "16",
    "--qk-layernorm",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--seq-length",
    "64",
]
DEEPSEEK_V3_YARN = ["--rotary-scaling-factor", "40", "--mscale", "0.707", "--mscale-all-dim", "0.707"]
# MLATransformerConfig's fields and the GPTConfig field each is (the names differ where Megatron's flag has a prefix)
OURS = {
    "original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "beta_fast": "yarn_beta_fast",
    "beta_slow": "yarn_beta_slow",
}


def _defaults_only_the_subclass_gives():
    """{field: default} of MLATransformerConfig that Megatron's args do not set (core_transformer_config_from_args
    copies every field named like an argument, and pops rope_type when --rope-type is not given) and that
    TransformerConfig does not have with the same default."""
    dests = {entry["dest"] for entry in megatron_table()["flags"].values()}
    base = {f.name: f.default for f in dataclasses.fields(transformer_config.TransformerConfig)}
    out = {}
    for f in dataclasses.fields(transformer_config.MLATransformerConfig):
        if (f.name not in dests or f.name == "rope_type") and base.get(f.name, dataclasses.MISSING) != f.default:
            out[f.name] = f.default
    return out


def test_multi_latent_attention_takes_mlatransformerconfigs_defaults():
    subclass_defaults = _defaults_only_the_subclass_gives()
    assert set(subclass_defaults) == {"rope_type", *OURS}, "a new default of Megatron's MLA config: honour it"
    model = configs(MLA).model
    for name, value in subclass_defaults.items():
        assert getattr(model, OURS.get(name, name)) == value, name
    assert configs(MLA + ["--rope-type", "rope"]).model.rope_type == "rope"
    assert configs(MLA[1:]).model.rope_type == "rope"  # standard attention: RoPE (TransformerConfig)


def test_the_deepseek_v3_script_trains_megatrons_yarn(monkeypatch):
    """Its YaRN flags without --rope-type: the softmax scale and the cos/sin tables of Megatron's MLA."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # its tables move to the GPU once
    model = configs(MLA + DEEPSEEK_V3_YARN).model
    theirs_config = transformer_config.MLATransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=16,
        rotary_scaling_factor=40,
        mscale=0.707,
        mscale_all_dim=0.707,
    )
    mscale = yarn_embeddings._yarn_get_mscale(theirs_config.rotary_scaling_factor, theirs_config.mscale_all_dim)
    attention = MultiLatentAttention(model, site="a")
    assert attention.scale == pytest.approx(mscale * mscale / math.sqrt(16 + 8), rel=1e-12)
    assert attention.scale > 1.5 / math.sqrt(16 + 8)  # plain RoPE would leave 1/sqrt(d)
    theirs = yarn_embeddings.YarnRotaryEmbedding(
        8,
        rotary_base=theirs_config.rotary_base,
        scaling_factor=theirs_config.rotary_scaling_factor,
        original_max_position_embeddings=theirs_config.original_max_position_embeddings,
        beta_fast=theirs_config.beta_fast,
        beta_slow=theirs_config.beta_slow,
        mscale=theirs_config.mscale,
        mscale_all_dim=theirs_config.mscale_all_dim,
        use_cpu_initialization=True,
    )
    emb, concentration = theirs.get_emb(64)
    cos, sin = Rotary(8, model.rotary_base, yarn_of(model)).tables(64, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(cos, (emb.cos() * concentration)[:, 0, 0, :4], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, (emb.sin() * concentration)[:, 0, 0, :4], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "flag, value, megatrons",
    [
        ("--yarn-beta-fast", "16", "32"),
        ("--yarn-beta-slow", "2", "1"),
        ("--yarn-original-max-position-embeddings", "8192", "4096"),
    ],
)
def test_yarn_flags_megatrons_mla_never_reads_are_refused_unless_they_say_what_it_uses(flag, value, megatrons):
    with pytest.raises(ConfigError, match=f"{flag}={value}: Megatron's multi-latent attention does not read it"):
        configs(MLA + DEEPSEEK_V3_YARN + [flag, value])
    assert configs(MLA + DEEPSEEK_V3_YARN + [flag, megatrons]).model.rope_type == "yarn"


def test_the_unrounded_correction_range_is_refused_with_mla():
    """Megatron's MLA builds its YaRN without --no-yarn-correction-range-round-to-int (it always rounds)."""
    flag = "--no-yarn-correction-range-round-to-int"
    with pytest.raises(ConfigError, match=f"{flag}: Megatron's multi-latent attention does not read it"):
        configs(MLA + DEEPSEEK_V3_YARN + [flag])


def test_yarn_on_standard_attention_is_refused_as_megatron_does():
    """Megatron-LM's validate_args asserts 'Common attention only support rope_type="rope"' without
    --multi-latent-attention (a Hugging Face GPT-OSS import has YaRN there: its config, not a flag)."""
    with pytest.raises(ConfigError, match="--rope-type=yarn: Megatron's standard attention takes only rope"):
        configs(MLA[1:] + ["--rope-type", "yarn"])
    assert configs(MLA[1:] + ["--rope-type", "rope"]).model.rope_type == "rope"


@pytest.mark.parametrize(
    "mscale, mscale_all_dim", [(2.0, 0.0), (0.0, 1.0), (0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.707, 0.707)]
)
def test_a_yarn_scale_megatron_computes_otherwise_is_refused(mscale, mscale_all_dim):
    """Megatron's YaRN scales cos/sin by mscale(f, mscale) / mscale(f, mscale_all_dim) whatever is 0
    (YarnRotaryEmbedding's concentration factor), transformers' DeepSeek (moezero's MLA) by mscale(f) unless both
    are set: where the two differ the command line is refused, where they agree it trains Megatron's tables."""
    flags = MLA + ["--rotary-scaling-factor", "40", "--mscale", str(mscale), "--mscale-all-dim", str(mscale_all_dim)]
    theirs = yarn_embeddings._yarn_get_concentration_factor(40.0, mscale, mscale_all_dim)
    if not (mscale and mscale_all_dim) and theirs != pytest.approx(yarn_embeddings._yarn_get_mscale(40.0), rel=1e-12):
        with pytest.raises(
            ConfigError,
            match=f"--mscale={mscale:g} with --mscale-all-dim={mscale_all_dim:g}: "
            f"Megatron's YaRN scales cos/sin by .* = {theirs:.6g}",
        ):
            configs(flags)
        return
    assert yarn_of(configs(flags).model).attention_factor == pytest.approx(theirs, rel=1e-12)


def test_mla_with_plain_rope_where_megatron_scales_or_rotates_otherwise_is_refused():
    """With --rope-type rope Megatron's MLA rotates --rotary-percent of the positional dims and still scales the
    softmax by mscale(f, mscale_all_dim)^2; moezero's rotates them all and scales only under YaRN."""
    rope = MLA + ["--rope-type", "rope"]
    with pytest.raises(ConfigError, match="--rotary-percent=0.5: with --rope-type rope Megatron's MLA rotates"):
        configs(rope + ["--rotary-percent", "0.5"])
    with pytest.raises(ConfigError, match="--rotary-scaling-factor=40 with --mscale-all-dim=1: Megatron's MLA"):
        configs(rope + ["--rotary-scaling-factor", "40", "--mscale-all-dim", "1"])
    model = configs(rope + ["--rotary-scaling-factor", "40"]).model  # mscale_all_dim 0: a factor of 1 on both
    assert MultiLatentAttention(model, site="a").scale == pytest.approx(1 / math.sqrt(16 + 8), rel=1e-12)


def test_checkpoints_from_before_the_default_are_plain_rope():
    stored = {
        "model": {
            "num_layers": 2,
            "multi_latent_attention": True,
            "rope_type": None,
            "disable_bias_linear": True,
            "no_bias_gelu_fusion": True,
        }
    }
    assert upgrade_stored_configs(stored)["model"]["rope_type"] == "rope"


def test_linear_position_interpolation_is_megatrons(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    head_dim, base, S, factor = 16, 10000.0, 12, 4
    theirs_rope = embeddings.RotaryEmbedding(
        kv_channels=head_dim,
        rotary_percent=1.0,
        rotary_base=base,
        seq_len_interpolation_factor=factor,
        use_cpu_initialization=True,
    )
    config = configs(
        [
            "--position-embedding-type",
            "rope",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "2",
            "--rotary-seq-len-interpolation-factor",
            str(factor),
        ]
    ).model
    assert config.rotary_seq_len_interpolation_factor == factor
    rotary = Rotary(config.rotary_dim, base, position_interpolation=config.rotary_seq_len_interpolation_factor)
    cos, sin = rotary.tables(S, torch.float32, torch.device("cpu"))
    emb = theirs_rope.get_emb(S) if hasattr(theirs_rope, "get_emb") else theirs_rope(S)
    torch.testing.assert_close(cos, emb.cos()[:, 0, 0, : head_dim // 2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, emb.sin()[:, 0, 0, : head_dim // 2], rtol=1e-6, atol=1e-6)
    plain = Rotary(config.rotary_dim, base).tables(S, torch.float32, torch.device("cpu"))[0]
    assert not torch.allclose(cos, plain), "the factor changed nothing"


@pytest.mark.parametrize("flags", [MLA, ["--position-embedding-type", "learned_absolute"]], ids=["mla", "learned"])
def test_position_interpolation_where_megatron_does_not_apply_it_is_refused(flags):
    with pytest.raises(ConfigError, match="--rotary-seq-len-interpolation-factor=2: Megatron applies it only to"):
        configs(flags + ["--rotary-seq-len-interpolation-factor", "2"])
    with pytest.raises(ConfigError, match="--rotary-seq-len-interpolation-factor=0: must be >= 1"):
        GPTConfig(position_embedding_type="rope", rotary_seq_len_interpolation_factor=0)


class _NoCoreAttention(torch.nn.Module):
    """Stands in for the core attention (the local spec's refuses MLA's widths in megatron-core 0.16.1)."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def _megatron_mla_biased_projections():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    import megatron.core.transformer.multi_latent_attention as mla_module

    from tests.megatron_oracle import CPU_BUILD, megatron_on_cpu

    with megatron_on_cpu():
        saved, mla_module.HAVE_TE = mla_module.HAVE_TE, False  # no Transformer Engine here
        try:
            spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True).submodules.self_attention
            spec.submodules.core_attention = _NoCoreAttention
            config = transformer_config.MLATransformerConfig(
                num_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                q_lora_rank=32,
                kv_lora_rank=16,
                qk_head_dim=16,
                qk_pos_emb_head_dim=8,
                v_head_dim=16,
                add_bias_linear=True,
                **CPU_BUILD,
            )
            attention = build_module(spec, config=config, layer_number=1)
        finally:
            mla_module.HAVE_TE = saved
    return sorted(n.split(".")[0] for n, _ in attention.named_parameters() if n.endswith("bias"))


def test_mla_has_megatrons_biases_without_disable_bias_linear():
    """megatron-core's MLASelfAttention gives only its output projection a bias (add_bias_linear); the down and
    up projections never have one (moezero's once gave the down projections transformers' attention_bias)."""
    from tests.dist_utils import run_distributed

    theirs = run_distributed(_megatron_mla_biased_projections, 1, timeout=120)[0]
    ours = sorted(
        n.split(".")[0]
        for n, _ in MultiLatentAttention(configs(MLA).model, site="a").named_parameters()
        if n.endswith("bias") and "norm" not in n
    )
    assert theirs == ["linear_proj"] and ours == ["proj"]
