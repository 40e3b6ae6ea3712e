"""--log-throughput counts FLOPs as Megatron does: its own figures (tests/assets/megatron_flops.json, from
tools/megatron_flops.py running megatron-core's num_floating_point_operations) for the same flags."""

import json
import os

import pytest

from moezero.training.throughput import flops_per_batch, tflops_per_rank
from tests.integration.pretrain_utils import ASSETS, configs

with open(os.path.join(ASSETS, "megatron_flops.json")) as f:
    TABLE = json.load(f)


@pytest.mark.parametrize("case", TABLE["cases"], ids=[c["name"] for c in TABLE["cases"]])
def test_flops_are_megatrons(case):
    cfg = configs(case["flags"])
    moe = cfg.moe if cfg.moe.num_experts is not None else None
    ours = flops_per_batch(cfg.model, moe, case["padded_vocab_size"], case["batch_size"])
    assert ours == pytest.approx(case["flops"], rel=1e-12), (TABLE["megatron_core"], case["name"])


def test_tflops_per_rank():
    assert tflops_per_rank(8e12, 2.0, 4) == 1.0
