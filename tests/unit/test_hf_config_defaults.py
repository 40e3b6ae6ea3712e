"""A config.json means what transformers makes of it: for every family and every field its config class declares
a default for, a config that omits the field reads in moezero as transformers' own completion of it does
(transformers' config class fills it in; the oracle). The defaults table moezero reads is transformers'."""

import json
import os
import sys

import pytest

from moezero.hf.families import FAMILIES, family_of
from tests.hf_oracle import CONFIGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(config: dict):
    """moezero's (GPTConfig, MoEConfig) of a config.json, or its refusal (a default that leaves the model
    incomplete, DeepSeek-V2's num_experts_per_tok None, fails alike on both sides)."""
    try:
        return family_of(config).configs(config)
    except Exception as exc:  # noqa: BLE001 - compared, not hidden
        return f"{type(exc).__name__}: {exc}"


def test_the_defaults_table_is_transformers():
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from hf_config_defaults import defaults

    with open(os.path.join(REPO, "moezero", "hf", "config_defaults.json")) as f:
        table = json.load(f)["families"]
    assert sorted(table) == sorted(FAMILIES)
    for model_type in FAMILIES:
        assert table[model_type] == defaults(model_type), model_type


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_an_omitted_field_means_transformers_default(family):
    import transformers

    full = json.loads(CONFIGS[family]().to_json_string(use_diff=False))
    config_class = transformers.CONFIG_MAPPING[full["model_type"]]
    with open(os.path.join(REPO, "moezero", "hf", "config_defaults.json")) as f:
        declared = json.load(f)["families"][family_of(full).model_type]
    omittable = [k for k in full if k in declared or k in ("rope_parameters", "rope_theta", "head_dim")]
    assert {"rope_parameters", "num_key_value_heads"} <= set(omittable)
    compared = 0
    for field in omittable:
        partial = {k: v for k, v in full.items() if k != field}
        try:
            completed = json.loads(config_class.from_dict(partial).to_json_string(use_diff=False))
        except Exception:  # noqa: BLE001 - transformers refuses it too (num_hidden_layers without layer_types)
            continue
        assert _read(partial) == _read(completed), (family, field)
        compared += 1
    assert compared >= len(omittable) - 2
