"""Hugging Face checkpoints of the MoE families, against transformers (tests/hf_oracle.py): a tiny random model
of each family that transformers saves loads into moezero with the same logits (float64, <= 1e-8), and
moezero's save_pretrained writes the keys and tensors transformers itself writes, which it loads back."""
import json
import os

import pytest
import torch
from safetensors import safe_open

import moezero.hf as hub
from moezero.hf import CheckpointMismatch, UnsupportedModel
from moezero.models import GPTModel
from tests.hf_oracle import CONFIGS, hf_logits, load_with_transformers, tiny_model
from tests.integration.pretrain_utils import configs

FAMILIES = sorted(CONFIGS)
TOKENS = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(1))


def _tensors(path):
    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out.update({key: f.get_tensor(key) for key in f.keys()})
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_checkpoint_gives_its_logits(family, tmp_path):
    reference = tiny_model(family)
    reference.save_pretrained(tmp_path)
    model = hub.from_pretrained(str(tmp_path), dtype=torch.float64)
    with torch.no_grad():
        ours = model(TOKENS)[0]
    theirs = hf_logits(reference, TOKENS)
    assert theirs.std() > 0.3, "the oracle's logits are not trivial"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-8)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_writes_what_transformers_writes(family, tmp_path):
    theirs_dir, ours_dir = str(tmp_path / "theirs"), str(tmp_path / "ours")
    tiny_model(family).save_pretrained(theirs_dir)
    hub.save_pretrained(hub.from_pretrained(theirs_dir, dtype=torch.float64), ours_dir)
    theirs, ours = _tensors(theirs_dir), _tensors(ours_dir)
    assert sorted(ours) == sorted(theirs)
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key
    with open(os.path.join(ours_dir, "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"]) == set(theirs)
    original, exported = load_with_transformers(theirs_dir), load_with_transformers(ours_dir)
    assert type(exported) is type(original)
    torch.testing.assert_close(hf_logits(exported, TOKENS), hf_logits(original, TOKENS), rtol=0, atol=1e-12)


def test_a_model_from_megatron_flags_exports_as_the_family_that_holds_it(tmp_path):
    """GQA, wide heads and per-head q/k norms without a shared expert are Qwen3-MoE."""
    cfg = configs(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                   "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "12", "--qk-layernorm",
                   "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--norm-epsilon", "1e-6",
                   "--position-embedding-type", "rope", "--rotary-base", "500000", "--num-experts", "4",
                   "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--untie-embeddings-and-output-weights"])
    cfg.model.vocab_size = 97
    model = GPTModel(cfg.model, cfg.moe, seed=3).double().eval()
    hub.save_pretrained(model, str(tmp_path))
    exported = load_with_transformers(str(tmp_path))
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        ours = model(TOKENS)[0]
    torch.testing.assert_close(hf_logits(exported, TOKENS), ours, rtol=0, atol=1e-8)


def test_what_a_family_cannot_hold_is_one_clear_error(tmp_path):
    cfg = configs(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                   "--num-experts", "4"])
    cfg.model.vocab_size = 97
    with pytest.raises(UnsupportedModel, match="no Hugging Face family holds this model.*learned_absolute"):
        hub.save_pretrained(GPTModel(cfg.model, cfg.moe), str(tmp_path))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type='yarn'"),
    ({"model_type": "llama"}, "model_type 'llama' is not supported by moezero"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"clip_qkv": 8.0}, "clip_qkv=8.0"),
])
def test_a_config_moezero_cannot_reproduce_is_refused(change, message, tmp_path):
    tiny_model("olmoe").save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    config.update(change)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(UnsupportedModel, match=message.replace("(", r"\(").replace("[", r"\[")):
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
