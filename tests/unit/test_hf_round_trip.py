"""Each family is one declaration, read and written by the same code: a config.json read into moezero's configs and
written back reads as the same configs (transformers' own config classes, the oracle's tiny configs, configs that
omit their defaults as saved ones do, and Hub-like ones), and a family holds exactly the models whose config.json
reads back as themselves."""

import dataclasses
import json
import zlib

import pytest
import torch

from moezero.config import ConfigError, moe_layer_config
from moezero.hf.families import FAMILIES, family_for, family_of
from moezero.models import GPTModel
from tests.hf_oracle import CONFIGS, transformers

TOKENS = torch.randint(3, 97, (4, 32), generator=torch.Generator().manual_seed(1))
# Hub config.json files of each family as published (token ids and the like left out)
HUB = {
    "Mixtral-8x7B": dict(
        model_type="mixtral",
        hidden_size=4096,
        intermediate_size=14336,
        max_position_embeddings=32768,
        num_attention_heads=32,
        num_experts_per_tok=2,
        num_hidden_layers=32,
        num_key_value_heads=8,
        num_local_experts=8,
        rms_norm_eps=1e-05,
        rope_theta=1e6,
        router_aux_loss_coef=0.02,
        sliding_window=None,
        tie_word_embeddings=False,
        vocab_size=32000,
    ),
    "Qwen1.5-MoE-A2.7B": dict(
        model_type="qwen2_moe",
        hidden_size=2048,
        intermediate_size=5632,
        max_position_embeddings=8192,
        num_attention_heads=16,
        num_hidden_layers=24,
        num_key_value_heads=16,
        rms_norm_eps=1e-06,
        rope_theta=1e6,
        sliding_window=32768,
        use_sliding_window=False,
        vocab_size=151936,
        decoder_sparse_step=1,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_experts_per_tok=4,
        num_experts=60,
        norm_topk_prob=False,
        router_aux_loss_coef=0.001,
    ),
    "Qwen3-30B-A3B": dict(
        model_type="qwen3_moe",
        attention_bias=False,
        decoder_sparse_step=1,
        head_dim=128,
        hidden_size=2048,
        intermediate_size=6144,
        max_position_embeddings=40960,
        mlp_only_layers=[],
        moe_intermediate_size=768,
        norm_topk_prob=True,
        num_attention_heads=32,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=48,
        num_key_value_heads=4,
        rms_norm_eps=1e-06,
        rope_scaling=None,
        rope_theta=1e6,
        sliding_window=None,
        use_sliding_window=False,
        vocab_size=151936,
    ),
    "OLMoE-1B-7B": dict(
        model_type="olmoe",
        clip_qkv=None,
        hidden_size=2048,
        intermediate_size=1024,
        max_position_embeddings=4096,
        norm_topk_prob=False,
        num_attention_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        num_hidden_layers=16,
        num_key_value_heads=16,
        rms_norm_eps=1e-05,
        rope_theta=10000.0,
        router_aux_loss_coef=0.01,
        vocab_size=50304,
    ),
    "DeepSeek-V2-Lite": dict(
        model_type="deepseek_v2",
        first_k_dense_replace=1,
        hidden_size=2048,
        intermediate_size=10944,
        kv_lora_rank=512,
        max_position_embeddings=163840,
        moe_intermediate_size=1408,
        moe_layer_freq=1,
        n_group=1,
        n_routed_experts=64,
        n_shared_experts=2,
        norm_topk_prob=False,
        num_attention_heads=16,
        num_experts_per_tok=6,
        num_hidden_layers=27,
        num_key_value_heads=16,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        rms_norm_eps=1e-06,
        rope_theta=10000,
        routed_scaling_factor=1.0,
        rope_scaling=dict(
            beta_fast=32,
            beta_slow=1,
            factor=40,
            mscale=0.707,
            mscale_all_dim=0.707,
            original_max_position_embeddings=4096,
            type="yarn",
        ),
        scoring_func="softmax",
        topk_group=1,
        topk_method="greedy",
        v_head_dim=128,
        vocab_size=102400,
    ),
    "DeepSeek-V3": dict(
        model_type="deepseek_v3",
        first_k_dense_replace=3,
        hidden_size=7168,
        intermediate_size=18432,
        kv_lora_rank=512,
        max_position_embeddings=163840,
        moe_intermediate_size=2048,
        moe_layer_freq=1,
        n_group=8,
        n_routed_experts=256,
        n_shared_experts=1,
        norm_topk_prob=True,
        num_attention_heads=128,
        num_experts_per_tok=8,
        num_hidden_layers=61,
        num_key_value_heads=128,
        num_nextn_predict_layers=1,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        rms_norm_eps=1e-06,
        rope_theta=10000,
        routed_scaling_factor=2.5,
        scoring_func="sigmoid",
        rope_scaling=dict(
            beta_fast=32,
            beta_slow=1,
            factor=40,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=4096,
            type="yarn",
        ),
        topk_group=4,
        topk_method="noaux_tc",
        v_head_dim=128,
        vocab_size=129280,
    ),
    "Kimi-K2": dict(
        model_type="kimi_k2",
        first_k_dense_replace=1,
        hidden_size=7168,
        intermediate_size=18432,
        kv_lora_rank=512,
        max_position_embeddings=131072,
        moe_intermediate_size=2048,
        n_group=1,
        n_routed_experts=384,
        n_shared_experts=1,
        norm_topk_prob=True,
        num_attention_heads=64,
        num_experts_per_tok=8,
        num_hidden_layers=61,
        num_key_value_heads=64,
        num_nextn_predict_layers=0,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        rms_norm_eps=1e-06,
        rope_theta=50000.0,
        routed_scaling_factor=2.827,
        topk_group=1,
        topk_method="noaux_tc",
        rope_scaling=dict(
            beta_fast=1.0,
            beta_slow=1.0,
            factor=32.0,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=4096,
            type="yarn",
        ),
        v_head_dim=128,
        vocab_size=163840,
    ),
    "GLM-4.5-Air": dict(
        model_type="glm4_moe",
        attention_bias=True,
        head_dim=128,
        hidden_size=4096,
        partial_rotary_factor=0.5,
        intermediate_size=10944,
        max_position_embeddings=131072,
        moe_intermediate_size=1408,
        norm_topk_prob=True,
        num_attention_heads=96,
        n_group=1,
        topk_group=1,
        n_routed_experts=128,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        num_hidden_layers=46,
        num_key_value_heads=8,
        rms_norm_eps=1e-05,
        rope_scaling=None,
        rope_theta=1000000,
        num_nextn_predict_layers=1,
        use_qk_norm=False,
        vocab_size=151552,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        attention_bias=True,
        head_dim=64,
        hidden_size=2880,
        intermediate_size=2880,
        layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072,
        num_attention_heads=64,
        num_experts_per_tok=4,
        num_hidden_layers=24,
        num_key_value_heads=8,
        num_local_experts=32,
        rms_norm_eps=1e-05,
        rope_scaling=dict(
            beta_fast=32.0,
            beta_slow=1.0,
            factor=32.0,
            rope_type="yarn",
            original_max_position_embeddings=4096,
            truncate=False,
        ),
        rope_theta=150000,
        router_aux_loss_coef=0.9,
        sliding_window=128,
        swiglu_limit=7.0,
        vocab_size=201088,
    ),
    "Llama-3-8B": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        max_position_embeddings=8192,
        num_attention_heads=32,
        num_hidden_layers=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-05,
        rope_theta=500000.0,
        vocab_size=128256,
    ),
    "Qwen3-8B": dict(
        model_type="qwen3",
        head_dim=128,
        hidden_size=4096,
        intermediate_size=12288,
        max_position_embeddings=40960,
        num_attention_heads=32,
        num_hidden_layers=36,
        num_key_value_heads=8,
        rms_norm_eps=1e-06,
        rope_theta=1000000,
        sliding_window=None,
        use_sliding_window=False,
        vocab_size=151936,
    ),
}


# where transformers' config class with nothing given describes no model: DeepSeek-V2 leaves top-k unset, GLM-4.5's
# heads (4096 / 96 wide) rotate an odd half; their Hub models' values
CLASS_DEFAULT_GAPS = {"deepseek_v2": {"num_experts_per_tok": 6}, "glm4_moe": {"head_dim": 128}}


def _class_defaults(model_type):
    config = json.loads(transformers.CONFIG_MAPPING[model_type]().to_json_string(use_diff=False))
    return dict(config, **CLASS_DEFAULT_GAPS.get(model_type, {}))


def _oracle(name, use_diff):
    """A tiny config of tests/hf_oracle.py as transformers writes it: every field, or only those off its defaults."""
    config = json.loads(CONFIGS[name]().to_json_string(use_diff=use_diff))
    return dict(config, model_type="kimi_k2" if name == "kimi_k2" else CONFIGS[name]().model_type)


SOURCES = (
    {f"{model_type}:defaults": (_class_defaults, model_type) for model_type in FAMILIES}
    | {f"{name}:full": (_oracle, name, False) for name in CONFIGS}
    | {f"{name}:changed fields only": (_oracle, name, True) for name in CONFIGS}
    | {name: (dict, config) for name, config in HUB.items()}
)


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_config_written_back_reads_as_it_read(source):
    make, *args = SOURCES[source]
    hf = make(*args)
    family = family_of(hf)
    configs = family.configs(hf)
    written = family.hf_config(*configs, "bfloat16")
    assert family.configs(written) == configs
    assert family.hf_config(*family.configs(written), "bfloat16") == written  # a fixed point


def _base(model_type):
    """The model of a family's tiny oracle config."""
    return FAMILIES[model_type].configs(_oracle(model_type, False))


# changes of a model (some change nothing its weights mean)
MODEL_CHANGES = [
    {"rotary_percent": 0.5},
    {"rotary_percent": 1.0},
    {"normalization": "LayerNorm"},
    {"apply_layernorm_1p": True},
    {"swiglu": False},
    {"disable_bias_linear": False},
    {"add_qkv_bias": True},
    {"add_qkv_bias": False},
    {"qk_layernorm": True, "qk_layernorm_scope": "head"},
    {"qk_layernorm": True, "qk_layernorm_scope": "full_width"},
    {"qk_layernorm": False},
    {"group_query_attention": True, "num_query_groups": 1},
    {"group_query_attention": False, "num_query_groups": 4},
    {"kv_channels": 16},
    {"softmax_type": "learnable"},
    {"softmax_type": "off-by-one"},
    {"softmax_type": "vanilla"},
    {"window_size": (4, 0), "window_attn_skip_freq": 2},
    {"window_size": (4, 0), "window_attn_skip_freq": [1, 0, 0]},
    {"window_size": None, "window_attn_skip_freq": None},
    {"mtp_num_layers": 1},
    {"mtp_num_layers": None},
    {"position_embedding_type": "learned_absolute"},
    {"position_embedding_type": "none"},
    {"rope_type": "yarn", "rotary_scaling_factor": 4.0},
    {"rotary_seq_len_interpolation_factor": 2},
    {
        "rope_type": "rope",
        "rotary_scaling_factor": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.0,
        "yarn_original_max_position_embeddings": None,
        "yarn_beta_fast": None,
        "yarn_beta_slow": None,
        "no_yarn_correction_range_round_to_int": False,
    },
    {"untie_embeddings_and_output_weights": True},
    {"untie_embeddings_and_output_weights": False},
    {"glu_linear_offset": 1.0},
    {"activation_func_clamp_value": 7.0},
    {"activation_func_clamp_value": None},
    {"swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0},
    {"norm_epsilon": 1e-5},
    {"norm_epsilon": 1e-6},
    {"multi_latent_attention": False},
    {"moe_layer_freq": [1, 0, 1]},
    {"moe_layer_freq": [0, 1, 1]},
    {"moe_layer_freq": [0, 0, 0]},
    {"moe_layer_freq": 1},
    {"rotary_base": 5e5},
    {"max_position_embeddings": 128, "seq_length": 128},
    {"vocab_size": 101},
    {"q_lora_rank": None},
    {"q_lora_rank": 8},
    {"kv_lora_rank": 8},
    {"v_head_dim": 4},
    {"qk_head_dim": 4},
    {"qk_pos_emb_head_dim": 2},
    {"num_attention_heads": 2},
    {"mscale": 0.5},
    {"mscale_all_dim": 0.5},
    {"no_yarn_correction_range_round_to_int": True},
    {"moe.pre_softmax": True},
    {"moe.pre_softmax": False},
    {"moe.score_function": "sigmoid", "moe.enable_expert_bias": True},
    {"moe.score_function": "softmax", "moe.enable_expert_bias": False},
    {"moe.topk_scaling_factor": 2.0},
    {"moe.topk_scaling_factor": 1.0},
    {"moe.num_groups": 2, "moe.group_topk": 1, "moe.group_score": "top2_sum"},
    {"moe.num_groups": 2, "moe.group_topk": 1, "moe.group_score": "max"},
    {"moe.enable_expert_bias": True},
    {"moe.shared_expert_intermediate_size": 24},
    {"moe.shared_expert_intermediate_size": 30},
    {"moe.shared_expert_intermediate_size": None, "moe.shared_expert_gate": False},
    {"moe.shared_expert_intermediate_size": 24, "moe.shared_expert_gate": True},
    {"moe.bias": True},
    {"moe.bias": False},
    {"moe.top_k": 1},
    {"moe.top_k": 3},
    {"moe.num_experts": 16},
    {"moe.ffn_hidden_size": 20},
]
# changes of training only: every model of the family stays one
TRAINING_CHANGES = [
    {"hidden_dropout": 0.1},
    {"seq_length": 16},
    {"moe.capacity_factor": 1.5},
    {"moe.load_balancing_type": ["aux_loss", "seq_aux_loss"], "moe.aux_loss_coeff": [0.01, 0.001]},
]


def _changed(configs, change):
    """(gpt, moe) with `change` made ("moe." fields: the MoE config's), or None where that is no valid model."""
    gpt, moe = configs
    model = {k: v for k, v in change.items() if not k.startswith("moe.")}
    experts = {k[4:]: v for k, v in change.items() if k.startswith("moe.")}
    if experts and moe is None:
        return None
    try:
        return dataclasses.replace(gpt, **model), dataclasses.replace(moe, **experts) if experts else moe
    except ConfigError:
        return None


def _reads_back_as_itself(family, configs) -> bool:
    """Whether the model the family's config.json of `configs` reads back as is the same model: the same configs,
    or the same weights (names, shapes) computing the same logits, every weight and buffer random (float64: equal to
    1e-10, so two code paths that reassociate a sum agree on any CPU's SIMD; a different model is off by far more)."""
    try:
        back = family.configs(family._written(*configs, "float32"))
    except ValueError:  # UnsupportedModel, ConfigError: no config.json of the family reads as it
        return False
    if back == configs:
        return True
    ours, theirs = _random_model(configs), _random_model(back)
    if {k: v.shape for k, v in ours.state_dict().items()} != {k: v.shape for k, v in theirs.state_dict().items()}:
        return False
    with torch.no_grad():
        return torch.allclose(ours(TOKENS)[0], theirs(TOKENS)[0], rtol=1e-10, atol=1e-10)


def _random_model(configs):
    """A float64 model of `configs` whose every weight and buffer is random, the same for the same name."""
    model = GPTModel(*configs).double().eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point():
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                tensor.copy_(torch.randn(tensor.shape, generator=g, dtype=tensor.dtype))  # big: clamps bite
    return model


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_family_holds_exactly_the_models_whose_config_reads_back_as_them(model_type):
    """For each change of a family's tiny model: the family holds it iff its config.json reads back as the same model
    (transformers' reading of it is what test_hf_families.py checks)."""
    family, base = FAMILIES[model_type], _base(model_type)
    gpt, moe = base
    assert next(family.differences(*base), None) is None
    if moe is not None:  # as a model holds it (save_pretrained's)
        assert next(family.differences(gpt, moe_layer_config(gpt, moe, seed=0)), None) is None
    checked = 0
    for change in MODEL_CHANGES:
        configs = _changed(base, change)
        if configs is None:
            continue
        holds = next(family.differences(*configs), None) is None
        assert holds == _reads_back_as_itself(family, configs), (change, next(family.differences(*configs), None))
        checked += 1
    assert checked > 30
    for change in TRAINING_CHANGES:
        configs = _changed(base, change)
        assert configs is None or next(family.differences(*configs), None) is None, change


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_tiny_model_is_held_by_its_family_alone(name):
    """No two families hold one model, so family_for's order decides nothing."""
    hf = _oracle(name, False)
    configs = family_of(hf).configs(hf)
    holders = [f.model_type for f in FAMILIES.values() if next(f.differences(*configs), None) is None]
    assert holders == [family_of(hf).model_type]
    assert family_for(*configs).model_type == holders[0]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_several_load_balancing_losses_write_the_batch_losss_coefficient(model_type):
    gpt, moe = _base(model_type)
    moe = dataclasses.replace(moe, load_balancing_type=["aux_loss", "seq_aux_loss"], aux_loss_coeff=[0.01, 0.001])
    written = FAMILIES[model_type].hf_config(gpt, moe, "bfloat16")
    assert written["router_aux_loss_coef"] == 0.01  # a number, as transformers' config classes declare it
    assert FAMILIES[model_type].configs(written)[1].aux_loss_coeff == 0.01
    without = dataclasses.replace(moe, load_balancing_type=["seq_aux_loss"], aux_loss_coeff=[0.001])
    assert FAMILIES[model_type].hf_config(gpt, without, "bfloat16")["router_aux_loss_coef"] == 0.0
