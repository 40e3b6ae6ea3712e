"""Megatron-LM's FLOPs per global batch (the figure behind its `--log-throughput` TFLOP/s) for a few model
shapes, as JSON: the oracle of moezero's own formula (tests/unit/test_throughput.py).

Each case is a flag list both parsers take; Megatron's own parser reads it, the defaults Megatron derives
in validate_args are filled in as it does, and `megatron.training.training.num_floating_point_operations`
counts. Same setup as tools/megatron_arguments.py (megatron-core 0.19's wheel on moezero's Python):

    PYTHONPATH=/tmp/mcore/x .venv/bin/python tools/megatron_flops.py > tests/assets/megatron_flops.json
"""

import argparse
import json
import sys


import megatron_wheel  # noqa: E402,F401  (before megatron-core)
from megatron.core import package_info  # noqa: E402
from megatron.training import arguments  # noqa: E402
from megatron.training.training import num_floating_point_operations  # noqa: E402

SHAPE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "512",
    "--max-position-embeddings",
    "512",
]
CASES = {
    "dense gelu": SHAPE,
    "dense swiglu": SHAPE + ["--swiglu"],
    "moe swiglu top-2": SHAPE
    + ["--swiglu", "--num-experts", "8", "--moe-router-topk", "2", "--ffn-hidden-size", "896"],
    "moe narrow experts, shared expert, first layer dense": SHAPE
    + [
        "--num-experts",
        "16",
        "--moe-router-topk",
        "4",
        "--moe-ffn-hidden-size",
        "128",
        "--moe-shared-expert-intermediate-size",
        "256",
        "--moe-layer-freq",
        "([0]*1+[1]*3)",
        "--swiglu",
    ],
    "moe every other layer, top-1 gelu": SHAPE
    + ["--num-experts", "4", "--moe-router-topk", "1", "--moe-layer-freq", "2"],
    "moe grouped-query attention, wide heads": SHAPE
    + [
        "--swiglu",
        "--num-experts",
        "8",
        "--moe-router-topk",
        "2",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--kv-channels",
        "48",
        "--moe-ffn-hidden-size",
        "128",
    ],
    "moe multi-latent attention, q latent, group-limited sigmoid routing": SHAPE
    + [
        "--swiglu",
        "--num-experts",
        "8",
        "--moe-router-topk",
        "4",
        "--multi-latent-attention",
        "--q-lora-rank",
        "96",
        "--kv-lora-rank",
        "64",
        "--qk-head-dim",
        "32",
        "--qk-pos-emb-head-dim",
        "16",
        "--v-head-dim",
        "24",
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-num-groups",
        "4",
        "--moe-router-group-topk",
        "2",
        "--moe-shared-expert-intermediate-size",
        "128",
        "--moe-ffn-hidden-size",
        "128",
        "--moe-layer-freq",
        "([0]*1+[1]*3)",
    ],
    "moe multi-latent attention without a q latent": SHAPE
    + [
        "--swiglu",
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--multi-latent-attention",
        "--kv-lora-rank",
        "64",
        "--qk-head-dim",
        "32",
        "--qk-pos-emb-head-dim",
        "16",
        "--v-head-dim",
        "32",
    ],
    "GPT-OSS's attention and clamped quick GEGLU": SHAPE
    + [
        "--num-experts",
        "8",
        "--moe-router-topk",
        "2",
        "--quick-geglu",
        "--glu-linear-offset",
        "1.0",
        "--activation-func-clamp-value",
        "7.0",
        "--softmax-type",
        "learnable",
        "--window-size",
        "128,0",
        "--window-attn-skip-freq",
        "2",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--position-embedding-type",
        "rope",
    ],
    "moe with two multi-token-prediction depths": SHAPE
    + [
        "--swiglu",
        "--num-experts",
        "8",
        "--moe-router-topk",
        "2",
        "--ffn-hidden-size",
        "896",
        "--position-embedding-type",
        "rope",
        "--mtp-num-layers",
        "2",
    ],
    "moe with a dense last layer and a multi-token-prediction depth": SHAPE
    + [
        "--swiglu",
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--moe-layer-freq",
        "([1]*3+[0]*1)",
        "--position-embedding-type",
        "rope",
        "--mtp-num-layers",
        "1",
    ],
}
PADDED_VOCAB, BATCH = 50304, 16


def megatron_args(flags):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    args = parser.parse_args(flags)
    if args.ffn_hidden_size is None:  # validate_args' derived defaults
        args.ffn_hidden_size = int(8 * args.hidden_size / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
    args.kv_channels = args.kv_channels or args.hidden_size // args.num_attention_heads
    args.num_query_groups = args.num_query_groups or args.num_attention_heads
    args.padded_vocab_size = PADDED_VOCAB
    return args


def main():
    cases = [
        {
            "name": name,
            "flags": flags,
            "padded_vocab_size": PADDED_VOCAB,
            "batch_size": BATCH,
            "flops": num_floating_point_operations(megatron_args(flags), BATCH),
        }
        for name, flags in CASES.items()
    ]
    json.dump({"megatron_core": package_info.__version__, "cases": cases}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
