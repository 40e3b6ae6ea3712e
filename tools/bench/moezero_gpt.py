"""moezero's GPT(-MoE) at the benchmark's sizes: built by moezero's worker, and by DeepSpeed's worker
for the ZeRO-only comparison (the same model and MoE layer on both sides, only the optimizer differs)."""

import dataclasses

import torch


def moezero_configs(args):
    """(GPTConfig, MoEConfig or None) of the benchmark model (tools/bench_mfu.py counts its FLOPs from them)."""
    from moezero.config import GPTConfig, MoEConfig

    gpt = GPTConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.seq,
        vocab_size=args.vocab,
        ffn_hidden_size=args.ffn_mult * args.hidden,
        untie_embeddings_and_output_weights=True,
        moe_layer_freq=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,  # as DeepSpeed's worker model: no dropout
        no_bias_gelu_fusion=True,
    )  # and its nn.GELU(), the exact one
    gpt = dataclasses.replace(gpt, **STYLES[getattr(args, "style", "peer")])
    moe = None
    if args.experts:
        moe = MoEConfig(
            hidden_size=args.hidden,
            num_experts=args.experts,
            top_k=args.k,
            aux_loss_coeff=args.aux,
            ffn_hidden_size=getattr(args, "expert_ffn", None) or None,
            delay_wgrad_compute=getattr(args, "delay_wgrad_compute", False),
        )
    return gpt, moe


# the peer model's layers (LayerNorm, GELU, biases: DeepSpeed's worker model) or a family's (the MoE layers take
# the GPT's activation and biases), at the same widths: a gated MLP's fc1 is 2F wide (1.5x the MLPs' FLOPs)
STYLES = {
    "peer": {},
    "llama": dict(normalization="RMSNorm", swiglu=True, disable_bias_linear=True),
    "gpt-oss": dict(normalization="RMSNorm", quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0),
}


def use_torch_elementwise_ops():
    """Measurement only: the element-wise CPU kernels off (bias + GELU, the experts' bias add, RMSNorm, SwiGLU and
    the quick GEGLU), torch's ops in their place, to time a model with and without them."""
    from moezero.moe import experts
    from moezero.ops import bias_add, rms_norm

    experts.fused_gelu_applies = experts.fused_glu_applies = lambda *args: False
    bias_add.fused_bias_add_applies = rms_norm.fused_rms_norm_applies = lambda *args: False


def build_moezero_gpt(args, groups=None):
    from moezero.models import GPTModel
    from moezero.moe import expert_parallel
    from moezero.parallel import ParallelGroups

    gpt, moe = moezero_configs(args)
    model = GPTModel(gpt, moe, seed=1234, moe_layer=expert_parallel(groups or ParallelGroups.single()))
    return model.bfloat16() if args.dtype == "bf16" else model


def lm_loss(model_output, labels):
    """Cross-entropy plus the MoE aux losses, from moezero's GPT output (logits, [MoEStats])."""
    from moezero.models import language_model_loss

    logits, stats = model_output
    ce = language_model_loss(logits, labels, torch.ones_like(labels, dtype=torch.float32))
    return ce, ce + sum((s.aux_loss for s in stats), torch.zeros(()))
