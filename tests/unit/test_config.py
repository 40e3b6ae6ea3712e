import pytest

from moezero.config import (
    ConfigError,
    DataConfig,
    GPTConfig,
    MoEConfig,
    ZeroConfig,
    check_experts_divide,
    expert_ffn_size,
    flag_of,
    moe_layer_config,
)
from moezero.training.configs import TrainConfig


def test_flags_come_from_field_metadata():
    assert flag_of(MoEConfig, "top_k") == "--moe-router-topk"
    assert flag_of(GPTConfig, "num_layers") == "--num-layers"
    assert flag_of(ZeroConfig, "stage") == "--zero-stage"


@pytest.mark.parametrize(
    "cls,kwargs,needle",
    [
        (MoEConfig, dict(num_experts=4, top_k=5), "--moe-router-topk=5"),
        (MoEConfig, dict(capacity_factor=0.0), "--moe-expert-capacity-factor=0.0"),
        (MoEConfig, dict(score_function="relu"), "softmax, sigmoid"),
        (GPTConfig, dict(hidden_size=30, num_attention_heads=4), "--hidden-size=30"),
        (ZeroConfig, dict(stage=4), "--zero-stage=4: must be one of 0, 1, 2, 3"),
        (TrainConfig, dict(bf16=True, fp16=True), "--fp16"),
        (TrainConfig, dict(lr_decay_style="step"), "constant, linear, cosine"),
    ],
)
def test_bad_values_name_the_flag(cls, kwargs, needle):
    with pytest.raises(ConfigError) as info:
        cls(**kwargs)
    assert needle in str(info.value)


def test_defaults_fill_derived_sizes():
    assert expert_ffn_size(MoEConfig(hidden_size=48)) == 192
    # inside a GPT the experts default to the dense MLP's width, as --moe-ffn-hidden-size's help says
    gpt = GPTConfig(hidden_size=32, num_attention_heads=2, ffn_hidden_size=100)
    assert expert_ffn_size(moe_layer_config(gpt, MoEConfig(), seed=0)) == 100
    assert expert_ffn_size(moe_layer_config(gpt, MoEConfig(ffn_hidden_size=64), seed=0)) == 64
    gpt = GPTConfig(seq_length=96)
    assert gpt.max_position_embeddings == 96 and gpt.ffn_hidden_size == 4 * gpt.hidden_size


@pytest.mark.parametrize(
    "split,weights",
    [("969,30,1", (969.0, 30.0, 1.0)), ("98/2/0", (98.0, 2.0, 0.0)), ("6, 2", (6.0, 2.0, 0.0)), ("1", (1.0, 0.0, 0.0))],
)
def test_split_has_one_parser_for_both_separators(split, weights):
    cfg = DataConfig(split=split)
    assert cfg.split_weights == weights and "/" not in cfg.split


@pytest.mark.parametrize("split", ["1,2,3,4", "a,b", "0,0", "1,-1", "1,,2"])
def test_bad_split_names_the_flag(split):
    with pytest.raises(ConfigError, match="--split="):
        DataConfig(split=split)


def test_experts_must_divide_over_ep():
    check_experts_divide(8, 4)
    with pytest.raises(ConfigError, match=r"--num-experts=6: must be divisible by --expert-model-parallel-size \(4\)"):
        check_experts_divide(6, 4)
