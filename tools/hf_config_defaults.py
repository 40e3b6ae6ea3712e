"""transformers' config defaults of every family moezero reads, as JSON: what a config.json that omits a field
means (published configs omit many: Qwen1.5-MoE has no qkv_bias, whose default is true). moezero completes a
config with them before reading it (moezero/hf/defaults.py), and tests/unit/test_hf_config_defaults.py checks
the file against transformers' own config classes.

    .venv/bin/python tools/hf_config_defaults.py > moezero/hf/config_defaults.json
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moezero.hf.families import FAMILIES  # noqa: E402

# who the config is, not what the model is (and what transformers fills in for any model)
IDENTITY = {
    "architectures",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_name_or_path",
    "id2label",
    "label2id",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "chunk_size_feed_forward",
    "problem_type",
    "tokenizer_class",
    "is_encoder_decoder",
    "add_cross_attention",
    "tie_encoder_decoder",
    "model_type",
    "base_model_tp_plan",
    "base_model_pp_plan",
    "base_model_ep_plan",
    "attribute_map",
    "sub_configs",
    "keys_to_ignore_at_inference",
    "base_config_key",
    "has_no_defaults_at_init",
    "base_model_fsdp_plan",
    "extra_config_files",
    "extra_files",
    "sub_configs_defaults",
    "rope_parameters",
}


def defaults(model_type: str) -> dict:
    """The fields `model_type`'s config class declares with their declared defaults (the nearest class in its MRO
    that declares one wins; JSON values only, identity fields left out), and its `default_theta` (RoPE's base
    where the config gives none). A derived field declares None (head_dim: hidden / heads): the reader derives."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    out = {}
    for klass in cls.__mro__:
        for name in getattr(klass, "__annotations__", {}):
            if name not in out and not name.startswith("_") and hasattr(klass, name):
                out[name] = getattr(klass, name)
    out = {k: v for k, v in out.items() if k not in IDENTITY and _is_json(v)}
    if hasattr(cls, "default_theta"):
        out["default_theta"] = cls.default_theta
    out["attribute_map"] = dict(getattr(cls, "attribute_map", {}))  # other names of a field (num_experts)
    return dict(sorted(out.items()))


def _is_json(value) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


def main():
    import transformers

    table = {
        "transformers": transformers.__version__,
        "families": {model_type: defaults(model_type) for model_type in sorted(FAMILIES)},
    }
    json.dump(table, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
