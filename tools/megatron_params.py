"""Megatron-LM's own GPTModel, built on the CPU for a few flag sets, counted per module: the oracle of
moezero's model shapes (tests/unit/test_megatron_shapes.py).

Each case is a flag list both parsers take. Megatron's parser reads it, the defaults validate_args derives
are filled in as it does, core_transformer_config_from_args makes its TransformerConfig (MLATransformerConfig
with --multi-latent-attention) and megatron-core's GPTModel is built with its decoder block spec without
Transformer Engine (dense and MoE layers by --moe-layer-freq) in a one-process gloo world; the implementation
flags a CPU build needs are added (they choose kernels, and --no-bias-gelu-fusion the GELU's form, not shapes).
Same setup as tools/megatron_arguments.py (megatron-core 0.19's wheel):

    PYTHONPATH=/tmp/mcore/x .venv/bin/python tools/megatron_params.py > tests/assets/megatron_params.json
"""

import argparse
import json
import logging
import os
import re
import sys
from collections import Counter

logging.disable(logging.WARNING)  # its deprecation notices print on stdout, which is the JSON

import megatron_wheel  # noqa: E402,F401  (before megatron-core)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CPU_BUILD = [
    "--no-rope-fusion",
    "--no-bias-swiglu-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-dropout-fusion",
    "--no-gradient-accumulation-fusion",
    "--transformer-impl",
    "local",
    "--no-persist-layer-norm",
    "--no-bias-gelu-fusion",
]
SHAPE = [
    "--num-layers",
    "3",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
]
LLAMA = [
    "--swiglu",
    "--disable-bias-linear",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
]
CASES = {
    "gpt with biases, gelu experts, tied head": SHAPE + ["--num-experts", "4", "--moe-router-topk", "2"],
    "grouped-query, per-head q/k norms, gated shared expert": SHAPE
    + LLAMA
    + [
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--qk-layernorm",
        "--moe-shared-expert-intermediate-size",
        "32",
        "--moe-shared-expert-gate",
    ],
    "wide heads, q/k/v biases, narrow experts, a dense first layer": SHAPE
    + LLAMA
    + [
        "--num-experts",
        "8",
        "--moe-router-topk",
        "2",
        "--kv-channels",
        "24",
        "--add-qkv-bias",
        "--moe-ffn-hidden-size",
        "48",
        "--moe-layer-freq",
        "([0]*1+[1]*2)",
    ],
    "multi-latent attention with a q latent, DeepSeek-V3 routing": SHAPE
    + LLAMA
    + [
        "--num-experts",
        "8",
        "--moe-router-topk",
        "4",
        "--multi-latent-attention",
        "--q-lora-rank",
        "48",
        "--kv-lora-rank",
        "32",
        "--qk-head-dim",
        "16",
        "--qk-pos-emb-head-dim",
        "8",
        "--v-head-dim",
        "12",
        "--qk-layernorm",
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-num-groups",
        "4",
        "--moe-router-group-topk",
        "2",
        "--moe-router-topk-scaling-factor",
        "2.5",
        "--moe-shared-expert-intermediate-size",
        "32",
        "--moe-ffn-hidden-size",
        "32",
        "--moe-layer-freq",
        "([0]*1+[1]*2)",
        "--rope-type",
        "yarn",
        "--rotary-scaling-factor",
        "4",
    ],
    "multi-latent attention without latent norms or a q latent": SHAPE
    + LLAMA
    + [
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--multi-latent-attention",
        "--kv-lora-rank",
        "32",
        "--qk-head-dim",
        "16",
        "--qk-pos-emb-head-dim",
        "8",
        "--v-head-dim",
        "16",
    ],
    "GLM-4.5: half-rotary GQA, q/k/v biases, q/k norms, sigmoid routing with groups, a shared expert": SHAPE
    + LLAMA
    + [
        "--num-experts",
        "8",
        "--moe-router-topk",
        "4",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--kv-channels",
        "24",
        "--rotary-percent",
        "0.5",
        "--add-qkv-bias",
        "--qk-layernorm",
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-num-groups",
        "4",
        "--moe-router-group-topk",
        "2",
        "--moe-router-topk-scaling-factor",
        "2.5",
        "--moe-shared-expert-intermediate-size",
        "16",
        "--moe-ffn-hidden-size",
        "16",
        "--moe-layer-freq",
        "([0]*1+[1]*2)",
    ],
}
CASES["GPT-OSS: attention sinks, windows on every other layer, clamped quick GEGLU, biases"] = SHAPE + [
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups",
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
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "32",
]
CASES["DeepSeek-V3's routing and attention with two multi-token-prediction depths"] = CASES[
    "multi-latent attention with a q latent, DeepSeek-V3 routing"
] + ["--mtp-num-layers", "2"]
VOCAB = 128

# Megatron's module paths -> the groups tests/unit/test_megatron_shapes.py compares
GROUPS = [
    (r"^embedding\.word_embeddings\.", "embedding"),
    (r"^embedding\.position_embeddings\.", "position_embedding"),
    (r"^output_layer\.", "output"),
    (r"^decoder\.final_layernorm\.", "final_norm"),
    (r"^decoder\.layers\.(\d+)\.input_layernorm\.", r"layer\1.input_norm"),
    (r"^decoder\.layers\.(\d+)\.self_attention\.", r"layer\1.attention"),
    (r"^decoder\.layers\.(\d+)\.pre_mlp_layernorm\.", r"layer\1.mlp_norm"),
    (r"^decoder\.layers\.(\d+)\.mlp\.router\.", r"layer\1.router"),
    (r"^decoder\.layers\.(\d+)\.mlp\.experts\.", r"layer\1.experts"),
    (r"^decoder\.layers\.(\d+)\.mlp\.shared_experts\.", r"layer\1.shared_expert"),
    (r"^decoder\.layers\.(\d+)\.mlp\.linear_fc", r"layer\1.dense_mlp"),
    (r"^mtp\.layers\.(\d+)\.(enorm|hnorm|eh_proj)\.", r"mtp\1.\2"),
    (r"^mtp\.layers\.(\d+)\.final_layernorm\.", r"mtp\1.final_norm"),
    (r"^mtp\.layers\.(\d+)\.(?:transformer_layer|mtp_model_layer)\.input_layernorm\.", r"mtp\1.input_norm"),
    (r"^mtp\.layers\.(\d+)\.(?:transformer_layer|mtp_model_layer)\.self_attention\.", r"mtp\1.attention"),
    (r"^mtp\.layers\.(\d+)\.(?:transformer_layer|mtp_model_layer)\.pre_mlp_layernorm\.", r"mtp\1.mlp_norm"),
    (r"^mtp\.layers\.(\d+)\.(?:transformer_layer|mtp_model_layer)\.mlp\.router\.", r"mtp\1.router"),
    (r"^mtp\.layers\.(\d+)\.(?:transformer_layer|mtp_model_layer)\.mlp\.experts\.", r"mtp\1.experts"),
    (r"^mtp\.layers\.(\d+)\.(?:transformer_layer|mtp_model_layer)\.mlp\.shared_experts\.", r"mtp\1.shared_expert"),
    (r"^mtp\.layers\.(\d+)\.(?:transformer_layer|mtp_model_layer)\.mlp\.linear_fc", r"mtp\1.dense_mlp"),
]


def group_of(name):
    for pattern, group in GROUPS:
        if re.match(pattern, name):
            return re.sub(pattern + ".*", group, name)
    raise KeyError(name)


class _NoParamsCoreAttention(torch.nn.Module):
    """Stands in for softmax(QK^T)V, which holds no parameters, where megatron-core's local spec cannot build it."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def megatron_model(flags):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    from megatron.training import arguments
    from megatron.training.argument_utils import core_transformer_config_from_args

    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    args = parser.parse_args(flags + CPU_BUILD)
    if args.ffn_hidden_size is None:  # validate_args' derived defaults
        args.ffn_hidden_size = int(8 * args.hidden_size / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
    args.kv_channels = args.kv_channels or args.hidden_size // args.num_attention_heads
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    args.params_dtype, args.padded_vocab_size = torch.float32, VOCAB
    args.use_cpu_initialization, args.perform_initialization = True, False
    config_class = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    config = core_transformer_config_from_args(args, config_class)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    for layer in spec.layer_specs if args.multi_latent_attention else ():
        # the local DotProductAttention refuses MLA's arguments; it holds no parameters
        layer.submodules.self_attention.submodules.core_attention = _NoParamsCoreAttention
    # pretrain_gpt.py's: the MTP depths' layer spec is the decoder's last
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if args.mtp_num_layers else None
    return GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        mtp_block_spec=mtp,
    )


def main():
    from megatron.core import package_info, parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.cuda.current_device = lambda: "cpu"  # MLA's RoPE tables are placed on the GPU when built
    parallel_state.initialize_model_parallel(1, 1)
    cases = []
    for name, flags in CASES.items():
        counts = Counter()
        for param_name, param in megatron_model(flags).named_parameters():
            counts[group_of(param_name)] += param.numel()
        cases.append({"name": name, "flags": flags, "padded_vocab_size": VOCAB, "params": dict(sorted(counts.items()))})
    json.dump({"megatron_core": package_info.__version__, "cases": cases}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
