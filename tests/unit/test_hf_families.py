"""Hugging Face checkpoints of the MoE families, against transformers (tests/hf_oracle.py): a tiny random model
of each family (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2, DeepSeek-V3, Kimi-K2, GLM-4.5) that transformers
saves
loads into moezero with the same logits (float64, <= 1e-8), and moezero's save_pretrained writes the keys and
tensors transformers itself writes, which it loads back. DeepSeek-V3's FP8 weights and its multi-token
prediction layer are read as its published checkpoints store them."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

import moezero.hf as hub
from moezero.hf import CheckpointMismatch, UnsupportedModel
from moezero.models import GPTModel
from moezero.parallel import ParallelGroups
from moezero.zero import ZeroOptimizer
from tests.hf_oracle import (
    CONFIGS,
    add_mtp_layer,
    hf_logits,
    hub_tensors,
    load_with_transformers,
    mtp_layer,
    save_tiny_model,
    tiny_model,
)
from tests.integration.pretrain_utils import configs

FAMILIES = sorted(CONFIGS)
TOKENS = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_checkpoint_gives_its_logits(family, tmp_path):
    reference = save_tiny_model(family, str(tmp_path))
    model = hub.from_pretrained(str(tmp_path), dtype=torch.float64)
    with torch.no_grad():
        ours = model(TOKENS)[0]
    theirs = hf_logits(reference, TOKENS)
    assert theirs.std() > 0.3, "the oracle's logits are not trivial"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-8)


def test_deepseek_v3_groups_score_their_two_best_experts_whatever_top_k(tmp_path):
    """transformers scores a DeepSeek-V3 expert group by its top two experts for any num_experts_per_tok
    (Megatron's top_sum takes top_k / topk_group): 3 experts per token among 2 of 4 groups, both ways."""
    reference = tiny_model("deepseek_v3", num_experts_per_tok=3)
    reference.save_pretrained(tmp_path / "source")
    model = hub.from_pretrained(str(tmp_path / "source"), dtype=torch.float64)
    assert model.moe_config.group_score == "top2_sum"
    with torch.no_grad():
        ours = model(TOKENS)[0]
    torch.testing.assert_close(ours, hf_logits(reference, TOKENS), rtol=0, atol=1e-8)
    hub.save_pretrained(model, str(tmp_path / "exported"))
    again = load_with_transformers(str(tmp_path / "exported"))
    assert again.config.num_experts_per_tok == 3 and again.config.topk_group == 2
    torch.testing.assert_close(hf_logits(again, TOKENS), ours, rtol=0, atol=1e-8)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_writes_what_transformers_writes(family, tmp_path):
    theirs_dir, ours_dir = str(tmp_path / "theirs"), str(tmp_path / "ours")
    tiny_model(family).save_pretrained(theirs_dir)
    hub.save_pretrained(hub.from_pretrained(theirs_dir, dtype=torch.float64), ours_dir)
    theirs, ours = hub_tensors(theirs_dir), hub_tensors(ours_dir)
    assert sorted(ours) == sorted(theirs)
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key
    with open(os.path.join(ours_dir, "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"]) == set(theirs)
    original, exported = load_with_transformers(theirs_dir), load_with_transformers(ours_dir)
    assert type(exported) is type(original)
    torch.testing.assert_close(hf_logits(exported, TOKENS), hf_logits(original, TOKENS), rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_the_mtp_layer_after_the_last_is_the_models_mtp_depth_both_ways(family, tmp_path):
    """DeepSeek-V3's and GLM-4.5's multi-token-prediction layer (Hub layer num_hidden_layers) loads as moezero's
    MTP depth, which runs Megatron's MTP forward on those weights, and exports back bitwise with its copies of the
    embedding and head; transformers (which skips the layer) loads the export to the same logits."""
    source, exported = tmp_path / "source", str(tmp_path / "exported")
    tiny_model(family).save_pretrained(source)
    add_mtp_layer(str(source))
    model = hub.from_pretrained(str(source), dtype=torch.float64)
    assert model.config.mtp_num_layers == 1
    last = model.config.num_layers
    stored = hub_tensors(str(source))
    assert torch.equal(model.mtp[0].eh_proj.weight, stored[f"model.layers.{last}.eh_proj.weight"])
    assert torch.equal(model.mtp[0].final_norm.weight, stored[f"model.layers.{last}.shared_head.norm.weight"])
    with torch.no_grad():
        logits, _, (depth,) = model(TOKENS, mtp=True)
        # the depth by hand: norms, projection and layer on the shifted tokens' embedding and the final hidden
        hidden = model.final_norm(model._layers(0, last, model.embedding(TOKENS), None)[0])
        shifted = torch.cat([TOKENS[:, 1:], torch.zeros_like(TOKENS[:, :1])], dim=1)
        mtp = model.mtp[0]
        x = mtp.eh_proj(torch.cat([mtp.enorm(model.embedding(shifted)), mtp.hnorm(hidden)], dim=-1))
        expected = model.output(mtp.final_norm(mtp.layer(x, None)[0]))
    torch.testing.assert_close(depth, expected, rtol=0, atol=0)
    hub.save_pretrained(model, exported)
    again = hub_tensors(exported)
    assert sorted(again) == sorted(stored) and all(torch.equal(again[k], stored[k]) for k in stored)
    with open(os.path.join(exported, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    torch.testing.assert_close(hf_logits(load_with_transformers(exported), TOKENS), logits, rtol=0, atol=1e-8)
    # a family without MTP layers cannot hold it
    with pytest.raises(UnsupportedModel, match="--mtp-num-layers"):
        hub.save_pretrained(model, str(tmp_path / "mixtral"), family="mixtral")


def test_a_model_from_megatron_flags_exports_as_the_family_that_holds_it(tmp_path):
    """GQA, wide heads and per-head q/k norms without a shared expert are Qwen3-MoE."""
    cfg = configs(
        [
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "16",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--kv-channels",
            "12",
            "--qk-layernorm",
            "--swiglu",
            "--normalization",
            "RMSNorm",
            "--disable-bias-linear",
            "--norm-epsilon",
            "1e-6",
            "--position-embedding-type",
            "rope",
            "--rotary-base",
            "500000",
            "--num-experts",
            "4",
            "--moe-router-topk",
            "2",
            "--moe-ffn-hidden-size",
            "24",
            "--untie-embeddings-and-output-weights",
        ]
    )
    cfg.model.vocab_size = 97
    model = GPTModel(cfg.model, cfg.moe, seed=3).double().eval()
    hub.save_pretrained(model, str(tmp_path))
    exported = load_with_transformers(str(tmp_path))
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        ours = model(TOKENS)[0]
    torch.testing.assert_close(hf_logits(exported, TOKENS), ours, rtol=0, atol=1e-8)


def test_megatron_flags_of_a_glm_model_export_as_glm4_moe(tmp_path):
    """RoPE on half of each head, q/k/v biases, DeepSeek-V3's router, a shared expert and a dense first layer
    (Megatron-Bridge's GLM-4.5 flags, shrunk) are GLM-4.5: transformers loads the export to moezero's logits."""
    cfg = configs(
        QWEN3_MOE_FLAGS
        + [
            "--rotary-percent",
            "0.5",
            "--add-qkv-bias",
            "--rotary-base",
            "1000000",
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-enable-expert-bias",
            "--moe-router-topk-scaling-factor",
            "2.5",
            "--moe-router-num-groups",
            "2",
            "--moe-router-group-topk",
            "1",
            "--moe-shared-expert-intermediate-size",
            "24",
            "--moe-layer-freq",
            "[0,1]",
        ]
    )
    cfg.model.vocab_size = 97
    model = GPTModel(cfg.model, cfg.moe, seed=3).double().eval()
    with torch.no_grad():
        model.layers[1].mlp.router.expert_bias.uniform_(-0.1, 0.1)  # the choice's correction bias, nonzero
    hub.save_pretrained(model, str(tmp_path))
    exported = load_with_transformers(str(tmp_path))
    assert type(exported).__name__ == "Glm4MoeForCausalLM"
    with torch.no_grad():
        ours = model(TOKENS)[0]
    torch.testing.assert_close(hf_logits(exported, TOKENS), ours, rtol=0, atol=1e-8)


QWEN3_MOE_FLAGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--kv-channels",
    "12",
    "--qk-layernorm",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--disable-bias-linear",
    "--norm-epsilon",
    "1e-6",
    "--position-embedding-type",
    "rope",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "24",
    "--untie-embeddings-and-output-weights",
]


def _set_config_field(folder, name, value):
    with open(folder / "config.json") as f:
        config = json.load(f)
    config[name] = value
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)


def test_partial_rotary_factor_means_what_transformers_makes_of_it(tmp_path):
    """The MoE families' transformers models rotate the whole head whatever partial_rotary_factor says: an
    import does too, and a model rotating part of it (--rotary-percent) is no such family. DeepSeek's
    shortens its frequencies only, which moezero does not reproduce: refused by name."""
    for family in ("qwen3_moe", "mixtral"):
        tiny_model(family).save_pretrained(tmp_path / family)
        _set_config_field(tmp_path / family, "partial_rotary_factor", 0.5)
        ours = hub.from_pretrained(str(tmp_path / family), dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(
                ours(TOKENS)[0], hf_logits(load_with_transformers(str(tmp_path / family)), TOKENS), rtol=0, atol=1e-8
            )
    cfg = configs(QWEN3_MOE_FLAGS + ["--rotary-percent", "0.5"])
    cfg.model.vocab_size = 97
    with pytest.raises(UnsupportedModel, match="--rotary-percent 0.5"):
        hub.save_pretrained(GPTModel(cfg.model, cfg.moe, seed=3), str(tmp_path / "partial"))
    tiny_model("deepseek_v3").save_pretrained(tmp_path / "v3")
    _set_config_field(tmp_path / "v3", "partial_rotary_factor", 0.5)
    with pytest.raises(UnsupportedModel, match="partial_rotary_factor"):
        hub.from_pretrained(str(tmp_path / "v3"))


@pytest.mark.parametrize(
    "omitted",
    [
        ("partial_rotary_factor",),
        ("use_qk_norm", "n_group", "topk_group"),
        ("routed_scaling_factor", "first_k_dense_replace"),
    ],
)
def test_a_glm4_moe_config_that_omits_fields_means_what_transformers_makes_of_it(omitted, tmp_path):
    """GLM-4.5 without partial_rotary_factor rotates half of each head (its config class sets 0.5); without
    use_qk_norm, n_group, routed_scaling_factor or first_k_dense_replace, their declared defaults hold."""
    tiny_model("glm4_moe", seed=4, use_qk_norm=False).save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    for name in omitted:
        config.pop(name, None)
        (config.get("rope_parameters") or {}).pop(name, None)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    theirs = load_with_transformers(str(tmp_path))
    assert theirs.config.rope_parameters["partial_rotary_factor"] == 0.5
    with torch.no_grad():
        torch.testing.assert_close(
            hub.from_pretrained(str(tmp_path), dtype=torch.float64)(TOKENS)[0],
            hf_logits(theirs, TOKENS),
            rtol=0,
            atol=1e-8,
        )


def test_a_tied_config_whose_files_hold_another_head_is_untied_as_transformers_does(tmp_path):
    """transformers 5 leaves embedding and lm_head untied (with a warning) when a tied config's files hold a
    different lm_head.weight; moezero used to drop the file's head silently."""
    tiny_model("qwen3_moe", tie_word_embeddings=True).save_pretrained(tmp_path)
    tensors = hub_tensors(str(tmp_path))
    tensors["lm_head.weight"] = torch.full_like(tensors["model.embed_tokens.weight"], 0.05)
    for name in os.listdir(tmp_path):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.remove(tmp_path / name)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="different lm_head.weight"):
        ours = hub.from_pretrained(str(tmp_path), dtype=torch.float64)
    theirs = load_with_transformers(str(tmp_path))
    assert not torch.equal(theirs.lm_head.weight, theirs.model.embed_tokens.weight)
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS)[0], hf_logits(theirs, TOKENS), rtol=0, atol=1e-8)


def test_what_a_family_cannot_hold_is_one_clear_error(tmp_path):
    cfg = configs(
        [
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "16",
            "--num-experts",
            "4",
        ]
    )
    cfg.model.vocab_size = 97
    with pytest.raises(UnsupportedModel, match="no Hugging Face family holds this model.*learned_absolute"):
        hub.save_pretrained(GPTModel(cfg.model, cfg.moe), str(tmp_path))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type='yarn'"),
        ({"model_type": "jamba"}, "model_type 'jamba' is not supported by moezero"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"clip_qkv": 8.0}, "clip_qkv=8.0"),
    ],
)
def test_a_config_moezero_cannot_reproduce_is_refused(change, message, tmp_path):
    tiny_model("olmoe").save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    config.update(change)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(UnsupportedModel, match=message.replace("(", r"\(").replace("[", r"\[")):
        hub.from_pretrained(str(tmp_path))


def test_a_gpt_oss_config_moezero_cannot_reproduce_is_refused(tmp_path):
    """Quick GELU's gain is 1.702 in moezero (and Megatron); another swiglu_alpha is refused by name."""
    tiny_model("gpt_oss").save_pretrained(tmp_path)
    _set_config_field(tmp_path, "swiglu_alpha", 1.5)
    with pytest.raises(UnsupportedModel, match="swiglu_alpha=1.5"):
        hub.from_pretrained(str(tmp_path))


def test_a_sigmoid_router_with_one_expert_per_token_is_refused_by_name(tmp_path):
    tiny_model("deepseek_v3").save_pretrained(tmp_path)
    _set_config_field(tmp_path, "num_experts_per_tok", 1)
    with pytest.raises(UnsupportedModel, match="num_experts_per_tok=1 with sigmoid scores"):
        hub.from_pretrained(str(tmp_path))


def test_tensors_that_do_not_fit_the_config_are_named(tmp_path):
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    config["num_experts"] = config.pop("num_local_experts", config.get("num_experts")) + 4
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointMismatch, match=r"tensors missing .*experts\.4\."):
        hub.from_pretrained(str(tmp_path))


def _fp8_blocks(weight, block):
    """DeepSeek-V3's storage of a weight: float8_e4m3fn per block x block tile, with the tile's scale inverse."""
    rows, cols = weight.shape
    tiles = torch.nn.functional.pad(weight, (0, -cols % block, 0, -rows % block))
    tiles = tiles.reshape(tiles.shape[0] // block, block, tiles.shape[1] // block, block)
    scale_inv = (tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0).float()
    quantized = (tiles / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)
    # DeepSeek's weight_dequant: the fp8 value times its tile's scale, in fp32
    dequantized = (quantized.float() * scale_inv[:, None, :, None]).double().reshape(tiles.shape[0] * block, -1)
    return quantized.reshape(dequantized.shape)[:rows, :cols], scale_inv, dequantized[:rows, :cols]


def _write_directory(path, config, tensors):
    os.makedirs(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def test_deepseek_v3_fp8_weights_and_its_mtp_layer_load_as_published(tmp_path):
    """Linear weights stored FP8 in 16x16 tiles with weight_scale_inv (DeepSeek-V3's layout, tiles of 128 there)
    give the logits transformers gives for the dequantized weights; the MTP layer after the last layer (FP8 too,
    with its copies of the embedding and head) becomes the model's MTP depth."""
    tiny_model("deepseek_v3").save_pretrained(tmp_path / "plain")
    with open(tmp_path / "plain" / "config.json") as f:
        config = json.load(f)
    stored, dequantized = hub_tensors(str(tmp_path / "plain")), {}
    stored.update(mtp_layer(stored, last=2))
    for key in [k for k in stored if re.search(r"proj(_with_mqa)?\.weight$", k)]:
        quantized, scale_inv, dequantized[key] = _fp8_blocks(stored[key], 16)
        stored[key], stored[key + "_scale_inv"] = quantized, scale_inv
    assert len(dequantized) > 40
    _write_directory(
        str(tmp_path / "dequantized"),
        config,
        {
            **hub_tensors(str(tmp_path / "plain")),
            **{k: v for k, v in dequantized.items() if not k.startswith("model.layers.3.")},
        },
    )
    fp8 = dict(
        config,
        num_nextn_predict_layers=1,
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [16, 16],
        },
    )
    _write_directory(str(tmp_path / "fp8"), fp8, stored)
    model = hub.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float64)
    assert torch.equal(model.mtp[0].eh_proj.weight, dequantized["model.layers.3.eh_proj.weight"])
    assert torch.equal(model.mtp[0].layer.attention.proj.weight, dequantized["model.layers.3.self_attn.o_proj.weight"])
    with torch.no_grad():
        ours = model(TOKENS)[0]
    reference = load_with_transformers(str(tmp_path / "dequantized"))
    torch.testing.assert_close(ours, hf_logits(reference, TOKENS), rtol=0, atol=1e-8)
    # read lazily by rows (ZeRO-3's way): each row range meets its blocks' scales
    lazy = hub.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float64, lazy=True)
    with pytest.raises(hub.ParamsNotRead, match="build it first"):  # a named error, not torch's device one
        lazy(TOKENS)
    opt = ZeroOptimizer(lazy, torch.optim.SGD, ParallelGroups.single(), stage=3, bucket_size=100, lr=0.1)
    with torch.no_grad(), opt.full_parameters():
        torch.testing.assert_close(lazy(TOKENS)[0], ours, rtol=0, atol=1e-13)


def test_gpt_oss_mxfp4_experts_load_as_published_and_export_dense(tmp_path):
    """GPT-OSS's expert stacks stored MXFP4 (X_blocks and X_scales, as OpenAI's files hold them) give the logits
    transformers gives for the weights its own dequantization makes, eagerly and lazily at stage 3 (read by
    expert rows); the export is dense and drops quantization_config."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tiny_model("gpt_oss", intermediate_size=32).save_pretrained(tmp_path / "plain")  # widths of 32-blocks
    with open(tmp_path / "plain" / "config.json") as f:
        config = json.load(f)
    stored, dequantized, g = hub_tensors(str(tmp_path / "plain")), {}, torch.Generator().manual_seed(3)
    for key in [k for k in stored if k.endswith(("gate_up_proj", "down_proj"))]:
        experts, inputs, outputs = stored.pop(key).shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=g, dtype=torch.int32)
        scales = torch.randint(120, 125, (experts, outputs, inputs // 32), generator=g, dtype=torch.int32)
        stored[key + "_blocks"], stored[key + "_scales"] = blocks.to(torch.uint8), scales.to(torch.uint8)
        dequantized[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float64)
    _write_directory(str(tmp_path / "dequantized"), config, {**hub_tensors(str(tmp_path / "plain")), **dequantized})
    _write_directory(str(tmp_path / "mxfp4"), dict(config, quantization_config={"quant_method": "mxfp4"}), stored)
    reference = hf_logits(load_with_transformers(str(tmp_path / "dequantized")), TOKENS)
    model = hub.from_pretrained(str(tmp_path / "mxfp4"), dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS)[0], reference, rtol=0, atol=1e-8)
    lazy = hub.from_pretrained(str(tmp_path / "mxfp4"), dtype=torch.float64, lazy=True)
    opt = ZeroOptimizer(lazy, torch.optim.SGD, ParallelGroups.single(), stage=3, bucket_size=100, lr=0.1)
    with torch.no_grad(), opt.full_parameters():
        torch.testing.assert_close(lazy(TOKENS)[0], model(TOKENS)[0], rtol=0, atol=1e-13)
    hub.save_pretrained(model, str(tmp_path / "dense"))
    with open(tmp_path / "dense" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    exported = hub_tensors(str(tmp_path / "dense"))
    assert all(torch.equal(exported[k], v) for k, v in dequantized.items())


GPT_OSS_WINDOWS = {
    "every other layer": (
        ["--window-size", "4,0", "--window-attn-skip-freq", "2"],
        5,
        ["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # transformers' model needs a sliding_window even where no layer has one
    "none": ([], 128, ["full_attention"] * 3),
}


@pytest.mark.parametrize("windows", list(GPT_OSS_WINDOWS))
def test_megatron_flags_of_a_gpt_oss_model_export_as_gpt_oss(windows, tmp_path):
    """Megatron's GPT-OSS flags (sinks, a window on every other layer or none, clamped quick GEGLU) with biases
    are GPT-OSS: transformers loads the export (sliding_window = the window + 1) to moezero's logits."""
    window_flags, sliding_window, layer_types = GPT_OSS_WINDOWS[windows]
    cfg = configs(
        [
            "--num-layers",
            "3",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "32",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--kv-channels",
            "12",
            "--normalization",
            "RMSNorm",
            "--norm-epsilon",
            "1e-6",
            "--position-embedding-type",
            "rope",
            "--untie-embeddings-and-output-weights",
            "--num-experts",
            "4",
            "--moe-router-topk",
            "2",
            "--moe-ffn-hidden-size",
            "24",
            "--quick-geglu",
            "--glu-linear-offset",
            "1",
            "--activation-func-clamp-value",
            "0.5",
            "--softmax-type",
            "learnable",
        ]
        + window_flags
    )
    cfg.model.vocab_size = 97
    model = GPTModel(cfg.model, cfg.moe, seed=3).double().eval()
    with torch.no_grad():  # biases and sinks away from their zero init
        for name, p in model.named_parameters():
            if p.ndim == 1 or name.endswith(("b1", "b2")):
                p.add_(0.3 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(len(name))))
    hub.save_pretrained(model, str(tmp_path))
    exported = load_with_transformers(str(tmp_path))
    assert type(exported).__name__ == "GptOssForCausalLM" and exported.config.sliding_window == sliding_window
    assert exported.config.layer_types == layer_types
    with torch.no_grad():
        ours = model(TOKENS)[0]
    torch.testing.assert_close(hf_logits(exported, TOKENS), ours, rtol=0, atol=1e-8)


def test_a_lazy_model_placed_on_a_device_reads_its_deferred_params_there(tmp_path):
    """What a GPU run of --load-hf does before model.cuda() (here with the CPU as the device): every param still
    deferred to the Hub files is read whole where the model goes; the model then runs as an eager load."""
    from moezero.training.builders import place_on

    save_tiny_model("mixtral", str(tmp_path))
    eager = hub.from_pretrained(str(tmp_path), dtype=torch.float64)
    lazy = place_on(hub.from_pretrained(str(tmp_path), dtype=torch.float64, lazy=True), torch.device("cpu"))
    for (name, theirs), ours in zip(eager.named_parameters(), lazy.parameters()):
        assert ours.device.type == "cpu" and torch.equal(ours, theirs), name
    with torch.no_grad():
        torch.testing.assert_close(lazy(TOKENS)[0], eager(TOKENS)[0], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral", "gpt_oss"])
def test_greedy_generation_is_transformers(family, tmp_path):
    """moezero.models.generate on a loaded model continues a prompt as transformers' generate does (its KV
    cache, float64 throughout)."""
    from moezero.models import generate
    from tests.hf_oracle import Float64Throughout

    reference = save_tiny_model(family, str(tmp_path), seed=7)
    model = hub.from_pretrained(str(tmp_path), dtype=torch.float64)
    prompt = [5, 17, 33, 2, 60]
    ours = generate(model, prompt, 8, temperature=0.0)
    with torch.no_grad(), Float64Throughout():
        theirs = reference.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert ours == theirs


def test_the_tensors_transformers_keeps_in_fp32_stay_fp32_both_ways(tmp_path):
    """DeepSeek's router weight and correction bias: transformers keeps them fp32 in a bf16 model
    (_keep_in_fp32_modules_strict, read from its classes here); a bf16 import keeps their fp32 values and a bf16
    export writes them fp32, bitwise the source's."""
    import transformers

    for family in hub.FAMILIES.values():
        architecture = getattr(transformers, family.architecture)
        assert tuple(sorted(getattr(architecture, "_keep_in_fp32_modules_strict", None) or ())) == tuple(
            sorted(family.fp32_modules)
        ), family.model_type
    tiny_model("deepseek_v3").float().save_pretrained(tmp_path / "fp32")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).save_pretrained(
        tmp_path / "source"
    )  # as a published bf16 checkpoint: the kept tensors fp32
    source = hub_tensors(str(tmp_path / "source"))
    kept = [k for k in source if k.endswith(("mlp.gate.weight", "e_score_correction_bias"))]
    assert kept and all(source[k].dtype == torch.float32 for k in kept)
    model = hub.from_pretrained(str(tmp_path / "source"), dtype=torch.bfloat16)
    assert model.layers[1].mlp.router.wg.weight.dtype == torch.float32
    hub.save_pretrained(model, str(tmp_path / "export"), dtype=torch.bfloat16)
    exported = hub_tensors(str(tmp_path / "export"))
    assert all(exported[k].dtype == torch.float32 and torch.equal(exported[k], source[k]) for k in kept)
    assert exported["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16


def test_an_fp8_checkpoint_exports_dense_and_a_scale_grid_that_does_not_fit_is_refused(tmp_path):
    """The export of an FP8 import writes dense tensors and no quantization_config (transformers loads it, to the
    same logits); FP8 tiles of 16 with no weight_block_size in the config (transformers would assume 128) are one
    error naming the file and the key, not weights dequantized with the wrong scales."""
    tiny_model("deepseek_v3").save_pretrained(tmp_path / "plain")
    with open(tmp_path / "plain" / "config.json") as f:
        config = json.load(f)
    stored = hub_tensors(str(tmp_path / "plain"))
    for key in [k for k in stored if re.search(r"proj(_with_mqa)?\.weight$", k)]:
        stored[key], stored[key + "_scale_inv"], _ = _fp8_blocks(stored[key], 16)
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    _write_directory(
        str(tmp_path / "fp8"), dict(config, quantization_config=dict(quantization, weight_block_size=[16, 16])), stored
    )
    model = hub.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float64)
    hub.save_pretrained(model, str(tmp_path / "dense"))
    with open(tmp_path / "dense" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    with torch.no_grad():
        ours = model(TOKENS)[0]
    torch.testing.assert_close(
        hf_logits(load_with_transformers(str(tmp_path / "dense")), TOKENS), ours, rtol=0, atol=1e-8
    )
    _write_directory(str(tmp_path / "no_block_size"), dict(config, quantization_config=quantization), stored)
    with pytest.raises(
        CheckpointMismatch,
        match=r"model\.safetensors: model\.layers\.0\.self_attn\.\S+ is an FP8 "
        r".* scales are a .* grid, not the 1 x 1 its 128 x 128 blocks need",
    ):
        hub.from_pretrained(str(tmp_path / "no_block_size"), dtype=torch.float64)


def test_damaged_files_are_one_error_naming_file_and_key(tmp_path):
    """A truncated shard, a key the index names but its shard lacks, a tensor of the wrong shape and a config
    that is not JSON: one CheckpointMismatch each, naming the file (and the key), not a library traceback."""
    import shutil

    tiny_model("qwen3_moe").save_pretrained(tmp_path / "good", max_shard_size="20KB")
    index = json.loads((tmp_path / "good" / "model.safetensors.index.json").read_text())
    key = "model.layers.1.self_attn.o_proj.weight"
    shard = index["weight_map"][key]

    def damaged(name, damage):
        folder = tmp_path / name
        shutil.copytree(tmp_path / "good", folder)
        damage(folder)
        return str(folder)

    def truncate(folder):
        os.truncate(folder / shard, 100)

    def missing_key(folder):
        tensors = hub_tensors(str(folder))
        kept = {k: v for k, v in tensors.items() if index["weight_map"][k] == shard and k != key}
        save_file(kept, str(folder / shard))

    def wrong_shape(folder):
        kept = {k: v for k, v in hub_tensors(str(folder)).items() if index["weight_map"][k] == shard}
        kept[key] = kept[key][:, :-1].contiguous()
        save_file(kept, str(folder / shard))

    cases = [
        (truncate, f"{shard}: not a readable safetensors file"),
        (missing_key, f"{shard}: cannot read {key}"),
        (
            wrong_shape,
            f"{shard}: layers.1.attention.proj.weight is (32, 48) in the model its config describes, "
            f"(32, 47) from {key}",
        ),
        (lambda folder: (folder / "config.json").write_text("{not json"), "config.json: not JSON"),
    ]
    for i, (damage, needle) in enumerate(cases):
        with pytest.raises(CheckpointMismatch) as info:
            hub.from_pretrained(damaged(f"case{i}", damage), dtype=torch.float64)
        assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def _edit_rope(folder, edit):
    with open(folder / "config.json") as f:
        config = json.load(f)
    edit(config)
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)


def _no_original_length(config):
    config["rope_parameters"].pop("original_max_position_embeddings")


def _top_level_original_length(config):
    _no_original_length(config)
    config["original_max_position_embeddings"] = 32


def _rope_scaling_beside(config):
    config["rope_scaling"] = dict(config["rope_parameters"], factor=8.0)


@pytest.mark.parametrize(
    "edit",
    [_no_original_length, _top_level_original_length, _rope_scaling_beside],
    ids=lambda edit: edit.__name__.strip("_"),
)
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_yarn_fields_mean_what_transformers_makes_of_them(family, edit, tmp_path):
    """A Hub config's YaRN as transformers reads it: without original_max_position_embeddings, the config's
    max_position_embeddings (not Megatron's 4096); a top-level one first; rope_scaling before rope_parameters.
    The export then reads the same in transformers."""
    tiny_model(family).save_pretrained(tmp_path / "source")
    _edit_rope(tmp_path / "source", edit)
    model = hub.from_pretrained(str(tmp_path / "source"), dtype=torch.float64)
    with torch.no_grad():
        ours = model(TOKENS)[0]
    torch.testing.assert_close(
        ours, hf_logits(load_with_transformers(str(tmp_path / "source")), TOKENS), rtol=0, atol=1e-8
    )
    hub.save_pretrained(model, str(tmp_path / "exported"))
    torch.testing.assert_close(
        hf_logits(load_with_transformers(str(tmp_path / "exported")), TOKENS), ours, rtol=0, atol=1e-8
    )
