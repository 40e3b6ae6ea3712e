"""Benchmark worker (under torchrun): forward+backward of one MoE layer, or a dense MLP of the same
active FLOPs, or DeepSpeed's MoE layer (with DeepSpeed's venv). Prints a RESULT json line."""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=["moezero", "dense", "deepspeed"], default="moezero")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="imbalanced routing as a trained router has: expert e's logit gets skew * (1 - e/(E-1))",
    )
    return p.parse_args()


def gate_weight(layer, system):
    if system == "deepspeed":
        return layer.deepspeed_moe.gate.wg.weight
    return layer.router.wg.weight


def skew_router(layer, system, args, direction):
    """Tokens share a direction; adding it to the gate rows with decreasing weight makes the first experts
    popular (the same rule on both systems, so both see the same load pattern)."""
    with torch.no_grad():
        bonus = args.skew * (1 - torch.arange(args.experts, dtype=torch.float32) / max(args.experts - 1, 1))
        gate_weight(layer, system).add_(bonus[:, None].to(gate_weight(layer, system).dtype) * direction)


def load_stats(layer, system, x, args, world):
    """max/mean expert load over the ep group, and DeepSpeed's dropless padding factor (every expert runs
    as many rows as the most loaded one: E * max load / assignments)."""
    logits = x.float() @ gate_weight(layer, system).float().t()
    counts = torch.bincount(logits.topk(args.k, dim=-1).indices.reshape(-1), minlength=args.experts).float()
    if world > 1:
        dist.all_reduce(counts)
    return {
        "max_mean_load": (counts.max() / counts.mean()).item(),
        "deepspeed_padding": (args.experts * counts.max() / counts.sum()).item(),
    }


def build(args, world):
    if args.system == "dense":  # the same active FLOPs: k experts' worth of FFN per token
        return nn.Sequential(
            nn.Linear(args.hidden, args.k * args.ffn, bias=False),
            nn.GELU(),
            nn.Linear(args.k * args.ffn, args.hidden, bias=False),
        ), lambda out: out
    if args.system == "deepspeed":
        import deepspeed
        from deepspeed.moe.layer import MoE

        deepspeed.init_distributed(dist_backend="gloo")
        expert = nn.Sequential(
            nn.Linear(args.hidden, args.ffn, bias=False), nn.GELU(), nn.Linear(args.ffn, args.hidden, bias=False)
        )
        layer = MoE(
            hidden_size=args.hidden,
            expert=expert,
            num_experts=args.experts,
            ep_size=world,
            k=args.k,
            drop_tokens=False,
            use_rts=False,
        )
        layer.set_deepspeed_parallelism()  # what deepspeed.initialize would do: create and attach the ep group
        return layer, lambda out: out[0]
    from moezero.moe import MoEConfig, MoELayer
    from moezero.parallel import ParallelGroups

    groups = ParallelGroups.build(expert_parallel_size=world)
    layer = MoELayer(
        MoEConfig(hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_experts=args.experts, top_k=args.k), groups
    )
    return layer, lambda out: out[0]


def main():
    args = parse()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and args.system != "deepspeed":
        dist.init_process_group("gloo")
    layer, output = build(args, world)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    layer = layer.to(dtype)
    rank = dist.get_rank() if dist.is_initialized() else 0
    direction = torch.randn(args.hidden, generator=torch.Generator().manual_seed(9))
    direction = direction / direction.norm()
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank), dtype=dtype)
    x = x + (4.0 * direction).to(dtype) if args.skew else x
    loads = {}
    if args.system != "dense":
        if args.skew:
            skew_router(layer, args.system, args, direction)
        loads = load_stats(layer, args.system, x, args, world)
    times = []
    for _ in range(args.reps + 1):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        xi = x.clone().requires_grad_(True)
        output(layer(xi)).float().square().mean().backward()
        times.append(time.perf_counter() - start)
    step = statistics.median(times[1:])
    if rank == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "system": args.system,
                    "world": world,
                    "step_s": step,
                    "times": times[1:],
                    "tokens_per_s_per_rank": args.tokens / step,
                    **loads,
                }
            ),
            flush=True,
        )
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
