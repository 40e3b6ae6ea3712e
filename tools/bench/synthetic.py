"""Shared by every benchmark worker (moezero's venv and DeepSpeed's): data, FLOPs, GEMM peak.

No moezero import here, so the DeepSpeed worker can use it from its own environment.
"""
import time

import torch


def batch(args, step, rank, seed=1234):
    """A learnable stream: arithmetic progressions mod vocab, keyed by (seed, step, rank)."""
    g = torch.Generator().manual_seed(seed * 1000003 + rank * 7919 + step)
    start = torch.randint(0, args.vocab, (args.mb, 1), generator=g)
    stride = torch.randint(1, 9, (args.mb, 1), generator=g)
    seq = (start + stride * torch.arange(args.seq + 1)) % args.vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def model_flops_per_token(args) -> float:
    """Training FLOPs per token (3x forward): attention, dense and routed MLPs, router, output layer."""
    D, S, V, F = args.hidden, args.seq, args.vocab, args.ffn_mult * args.hidden
    attention = 2 * 4 * D * D + 2 * 2 * S * D  # qkv + proj, then QK^T and AV (causal counted in full)
    dense_mlp = 2 * 2 * D * F
    moe_layers = (args.layers + 1) // 2 if args.experts else 0
    routed = args.k * 2 * 2 * D * F + 2 * D * args.experts
    forward = args.layers * attention + (args.layers - moe_layers) * dense_mlp + moe_layers * routed + 2 * D * V
    return 3.0 * forward


def gemm_peak_flops(n: int = 1536, dtype=torch.float32, repeats: int = 5) -> float:
    """FLOP/s of torch.mm at a large square size on this process's threads (best of `repeats`)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best
