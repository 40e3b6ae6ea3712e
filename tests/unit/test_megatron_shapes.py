"""The model a Megatron flag set builds has exactly the parameters Megatron's own GPTModel has for it, module by
module: tests/assets/megatron_params.json holds megatron-core's counts (tools/megatron_params.py builds its
GPTModel on the CPU), for attention variants (grouped-query, wide heads, q/k/v biases, per-head q/k norms,
multi-latent with and without latents) and MoE variants (shared expert and its gate, narrow experts, dense
layers, DeepSeek-V3 routing, GLM-4.5's half-rotary attention with q/k/v biases) and DeepSeek-V3's
multi-token-prediction depths."""

import json
import os
import re
from collections import Counter

import pytest

from moezero.models import GPTModel
from tests.integration.pretrain_utils import ASSETS, configs

with open(os.path.join(ASSETS, "megatron_params.json")) as f:
    TABLE = json.load(f)

GROUPS = [  # moezero's parameter names -> the groups the table counts
    (r"^embedding\.", "embedding"),
    (r"^position_embedding\.", "position_embedding"),
    (r"^output\.", "output"),
    (r"^final_norm\.", "final_norm"),
    (r"^layers\.(\d+)\.input_norm\.", r"layer\1.input_norm"),
    (r"^layers\.(\d+)\.attention\.", r"layer\1.attention"),
    (r"^layers\.(\d+)\.mlp_norm\.", r"layer\1.mlp_norm"),
    (r"^layers\.(\d+)\.mlp\.router\.", r"layer\1.router"),
    (r"^layers\.(\d+)\.mlp\.experts\.", r"layer\1.experts"),
    (r"^layers\.(\d+)\.mlp\.shared_expert(_gate)?\.", r"layer\1.shared_expert"),
    (r"^layers\.(\d+)\.mlp\.fc", r"layer\1.dense_mlp"),
    (r"^mtp\.(\d+)\.(enorm|hnorm|eh_proj|final_norm)\.", r"mtp\1.\2"),
    (r"^mtp\.(\d+)\.layer\.input_norm\.", r"mtp\1.input_norm"),
    (r"^mtp\.(\d+)\.layer\.attention\.", r"mtp\1.attention"),
    (r"^mtp\.(\d+)\.layer\.mlp_norm\.", r"mtp\1.mlp_norm"),
    (r"^mtp\.(\d+)\.layer\.mlp\.router\.", r"mtp\1.router"),
    (r"^mtp\.(\d+)\.layer\.mlp\.experts\.", r"mtp\1.experts"),
    (r"^mtp\.(\d+)\.layer\.mlp\.shared_expert(_gate)?\.", r"mtp\1.shared_expert"),
    (r"^mtp\.(\d+)\.layer\.mlp\.fc", r"mtp\1.dense_mlp"),
]


def _group(name):
    for pattern, group in GROUPS:
        if re.match(pattern, name):
            return re.sub(pattern + ".*", group, name)
    raise KeyError(name)


@pytest.mark.parametrize("case", TABLE["cases"], ids=[c["name"] for c in TABLE["cases"]])
def test_the_parameters_are_megatrons(case):
    cfg = configs(case["flags"])
    cfg.model.vocab_size = case["padded_vocab_size"]
    model = GPTModel(cfg.model, cfg.moe if cfg.moe.num_experts else None)
    ours = Counter()
    for name, param in model.named_parameters():
        ours[_group(name)] += param.numel()
    assert dict(sorted(ours.items())) == case["params"], (TABLE["megatron_core"], case["name"])


@pytest.mark.parametrize("freq", ["1", "2", "3", "[0,1,1,0,1]"])
def test_the_moe_layers_are_where_megatron_puts_them(freq):
    """--moe-layer-freq (an integer N: layers 0, N, 2N, ...; a list: per layer) places the MoE layers where
    megatron-core's decoder layer specs put its MoELayer."""
    import dataclasses
    import logging
    import warnings

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moezero.moe import MoELayer
    from tests.megatron_oracle import CPU_BUILD

    cfg = configs(
        [
            "--num-layers",
            "5",
            "--hidden-size",
            "16",
            "--num-attention-heads",
            "2",
            "--num-experts",
            "4",
            "--moe-layer-freq",
            freq,
        ]
    )
    model = GPTModel(dataclasses.replace(cfg.model, vocab_size=64), cfg.moe)
    ours = [isinstance(layer.mlp, MoELayer) for layer in model.layers]
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = TransformerConfig(
                num_layers=5,
                hidden_size=16,
                num_attention_heads=2,
                num_moe_experts=4,
                moe_router_topk=2,
                moe_layer_freq=cfg.model.moe_layer_freq,
                **CPU_BUILD,
            )
            theirs = [
                spec.submodules.mlp.module.__name__ == "MoELayer"
                for spec in get_gpt_decoder_layer_specs(config, use_transformer_engine=False)
            ]
    finally:
        logging.disable(logging.NOTSET)
    assert ours == theirs and any(ours), (ours, theirs)
