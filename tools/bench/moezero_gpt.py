"""moezero's GPT(-MoE) at the benchmark's sizes: built by moezero's worker, and by DeepSpeed's worker
for the ZeRO-only comparison (the same model and MoE layer on both sides, only the optimizer differs)."""
import torch


def moezero_configs(args):
    """(GPTConfig, MoEConfig or None) of the benchmark model (tools/bench_mfu.py counts its FLOPs from them)."""
    from moezero.config import GPTConfig, MoEConfig

    gpt = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    seq_length=args.seq, vocab_size=args.vocab, ffn_hidden_size=args.ffn_mult * args.hidden,
                    untie_embeddings_and_output_weights=True, moe_layer_freq=2,
                    hidden_dropout=0.0, attention_dropout=0.0,   # as DeepSpeed's worker model: no dropout
                    no_bias_gelu_fusion=True)                    # and its nn.GELU(), the exact one
    moe = None
    if args.experts:
        moe = MoEConfig(hidden_size=args.hidden, num_experts=args.experts, top_k=args.k, aux_loss_coeff=args.aux,
                        ffn_hidden_size=getattr(args, "expert_ffn", None) or None,
                        delay_wgrad_compute=getattr(args, "delay_wgrad_compute", False))
    return gpt, moe


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
