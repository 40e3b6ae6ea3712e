"""Benchmark worker for DeepSpeed (run with DeepSpeed's venv under torchrun, DS_ACCELERATOR=cpu).

--model native (end to end): the same GPT as moezero's worker (pre-norm blocks, learned positions,
untied output layer, MLP 4h with GELU, the same init rule) with DeepSpeed's MoE layer
(deepspeed.moe.layer.MoE) on layers 0, 2, ... with the same E, k and aux coefficient, dropless
(drop_tokens=False), true top-k (no random token selection, no sampled second expert).
--model moezero (ZeRO only): moezero's own GPTModel and MoE layer (ep 1), so only the optimizer differs.
Either way torch AdamW (fused unless --no-fused, as on every system) under DeepSpeed ZeRO, the same
synthetic data. Prints one RESULT json line.
"""

import json
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from memtrace import sample as memory_sample  # noqa: E402
from synthetic import (
    adamw_kwargs,
    batch,
    common_parser,
    gemm_peak_flops,
    kernel_paths,  # noqa: E402
    model_flops_per_token,
)


def parse():
    p = common_parser()
    p.add_argument("--local_rank", type=int, default=-1)  # the DeepSpeed launcher passes it
    p.add_argument("--model", choices=["native", "moezero"], default="native")
    return p.parse_args()


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, S, D))


def mlp(hidden, ffn):
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


class Block(nn.Module):
    def __init__(self, args, moe):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.norm1, self.norm2 = nn.LayerNorm(args.hidden), nn.LayerNorm(args.hidden)
        self.attn = Attention(args.hidden, args.heads)
        self.moe = moe
        ffn = args.ffn_mult * args.hidden
        if moe:
            self.mlp = MoE(
                hidden_size=args.hidden,
                expert=mlp(args.hidden, args.expert_ffn or ffn),
                num_experts=args.experts,
                ep_size=args.ep,
                k=args.k,
                capacity_factor=1.0,
                eval_capacity_factor=1.0,
                drop_tokens=False,
                use_rts=False,
                top2_2nd_expert_sampling=False,
            )
        else:
            self.mlp = mlp(args.hidden, ffn)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        if self.moe:
            y, aux, _ = self.mlp(self.norm2(x))
        else:
            y, aux = self.mlp(self.norm2(x)), x.new_zeros(())
        return x + y, aux


class GPT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.hidden)
        self.pos = nn.Embedding(args.seq, args.hidden)
        self.blocks = nn.ModuleList([Block(args, moe=bool(args.experts) and i % 2 == 0) for i in range(args.layers)])
        self.norm = nn.LayerNorm(args.hidden)
        self.head = nn.Linear(args.hidden, args.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        aux = x.new_zeros(())
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        return self.head(self.norm(x)), aux


def megatron_init(model, layers, std=0.02):
    """The init moezero's GPT uses (Megatron's): N(0, std) weights, output projections scaled by
    1/sqrt(2L), zero biases, unit norms - so both sides start from equally scaled models."""
    for name, p in model.named_parameters():
        if p.ndim == 1:
            if name.endswith("bias"):
                nn.init.zeros_(p)
            continue
        scale = std / (2.0 * layers) ** 0.5 if name.endswith(("attn.proj.weight", "2.weight")) else std
        nn.init.normal_(p, 0.0, scale)


def build(args):
    """(model, loss function (model output, labels) -> (ce, loss), param groups for the optimizer)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    if args.model == "moezero":
        from moezero_gpt import build_moezero_gpt, lm_loss

        model = build_moezero_gpt(args)
        return model, lm_loss, [{"params": list(model.parameters())}]
    torch.manual_seed(1234)
    model = GPT(args)
    megatron_init(model, args.layers)

    def loss_fn(output, labels):
        logits, aux = output
        ce = F.cross_entropy(logits.float().view(-1, args.vocab), labels.view(-1))
        return ce, ce + args.aux * aux

    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "all", "weight_decay": 0.0}
    )
    return model, loss_fn, groups


def main():
    args = parse()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    peak = gemm_peak_flops() if args.peak else None
    model, loss_fn, groups = build(args)
    opt = torch.optim.AdamW(groups, **adamw_kwargs(args))
    config = {
        "train_micro_batch_size_per_gpu": args.mb,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": args.dtype == "bf16"},
        "zero_optimization": {
            "stage": args.stage,
            "reduce_bucket_size": args.bucket,
            "allgather_bucket_size": args.bucket,
            "overlap_comm": not args.no_overlap,
            "contiguous_gradients": True,
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    losses, times, memory = [], [], []
    for step in range(args.steps):
        tokens, labels = batch(args, step, rank)
        dist.barrier()
        start = time.perf_counter()
        ce, loss = loss_fn(engine(tokens), labels)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        memory.append(memory_sample())
        ce = ce.detach().float().clone()
        dist.all_reduce(ce)
        losses.append(ce.item() / world)
    step_s = statistics.median(times[args.warmup :] if len(times) > args.warmup else times)
    rss = [None] * world
    dist.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    rss_end = [None] * world
    dist.all_gather_object(rss_end, memory[-1]["rss_mb"])
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    result = {
        "tag": args.tag,
        "system": "deepspeed",
        "model": args.model,
        "stage": args.stage,
        "ep": args.ep,
        "world": world,
        "step_s": step_s,
        "tokens_per_s": args.mb * args.seq * world / step_s,
        "peak_rss_mb": rss,
        "rss_end_mb": max(rss_end),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "losses": losses,
        "times": times,
        "memory": memory if rank == 0 else None,
        "flops_per_token": model_flops_per_token(args),
        "kernel_paths": kernel_paths(),
    }
    if peak is not None:
        result["gemm_peak_flops"] = sum(peaks)
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's comm threads sometimes abort at interpreter teardown (see shared/peers)


if __name__ == "__main__":
    main()
