import pytest

from moezero.config import ConfigError, GPTConfig, MoEConfig, TrainConfig, ZeroConfig, flag_of


def test_flags_come_from_field_metadata():
    assert flag_of(MoEConfig, "top_k") == "--moe-router-topk"
    assert flag_of(GPTConfig, "num_layers") == "--num-layers"
    assert flag_of(ZeroConfig, "stage") == "--zero-stage"


@pytest.mark.parametrize("cls,kwargs,needle", [
    (MoEConfig, dict(num_experts=4, top_k=5), "--moe-router-topk=5"),
    (MoEConfig, dict(capacity_factor=0.0), "--moe-expert-capacity-factor=0.0"),
    (MoEConfig, dict(score_function="relu"), "softmax, sigmoid"),
    (GPTConfig, dict(hidden_size=30, num_attention_heads=4), "--hidden-size=30"),
    (ZeroConfig, dict(stage=3), "--zero-stage=3: must be one of 0, 1, 2"),
    (TrainConfig, dict(bf16=True, fp16=True), "--fp16"),
    (TrainConfig, dict(lr_decay_style="step"), "constant, linear, cosine"),
])
def test_bad_values_name_the_flag(cls, kwargs, needle):
    with pytest.raises(ConfigError) as info:
        cls(**kwargs)
    assert needle in str(info.value)


def test_defaults_fill_derived_sizes():
    cfg = MoEConfig(hidden_size=48)
    assert cfg.ffn_hidden_size == 192
    gpt = GPTConfig(seq_length=96)
    assert gpt.max_position_embeddings == 96 and gpt.ffn_hidden_size == 4 * gpt.hidden_size
