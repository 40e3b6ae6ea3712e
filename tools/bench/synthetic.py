"""Shared by every benchmark worker (moezero's venv and DeepSpeed's): data, FLOPs, GEMM peak.

No moezero import here, so the DeepSpeed worker can use it from its own environment.
"""

import argparse
import time

import torch

from machine import bf16_units
from moezero_gpt import STYLES  # plain data: moezero_gpt imports moezero only inside its functions


def common_parser() -> argparse.ArgumentParser:
    """The model, run and ZeRO flags every training worker shares (same meaning on every system)."""
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mb", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8, help="0 = dense GPT")
    p.add_argument("--ffn-mult", type=int, default=4)
    p.add_argument("--expert-ffn", type=int, default=0, help="routed experts' FFN width (0: ffn-mult x hidden)")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--aux", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bucket", type=int, default=2_000_000)
    p.add_argument(
        "--min-unit-params",
        type=int,
        default=100_000,
        help="stage 3: smaller blocks are gathered with the root (the training script's default)",
    )
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument(
        "--no-fused",
        action="store_true",
        help="the per-tensor AdamW loop instead of torch's fused kernel (every system gets the same one)",
    )
    p.add_argument("--peak", action="store_true", help="also measure the GEMM peak for MFU")
    p.add_argument("--tag", default="")
    return p


def adamw_kwargs(args) -> dict:
    """torch AdamW's settings on every system: the same implementation everywhere (fused unless --no-fused)."""
    return dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=not args.no_fused)


def kernel_paths() -> dict:
    """Which GEMM paths this CPU has: bf16 runs on dedicated units (AVX-512 BF16 / AMX) or is emulated."""
    hardware = bf16_units()
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(384, 384, dtype=dtype), torch.randn(384, 384, dtype=dtype)
        torch.mm(a, b)
        start = time.perf_counter()
        for _ in range(3):
            torch.mm(a, b)
        seconds[dtype] = time.perf_counter() - start
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_units": hardware or None,
        "bf16_gemm_slowdown": seconds[torch.bfloat16] / seconds[torch.float32],
    }


def bf16_native() -> bool:
    """bf16 GEMMs run on dedicated units here (bf16 runs are then as long as fp32 ones, not many times longer:
    kernel_paths()'s bf16_gemm_slowdown says how many here)."""
    return kernel_paths()["bf16_units"] is not None


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
    style = STYLES[getattr(args, "style", "peer")]
    gemms = 3 if style.get("swiglu") or style.get("quick_geglu") else 2  # a gated fc1 is 2F wide
    dense_mlp = gemms * 2 * D * F
    moe_layers = (args.layers + 1) // 2 if args.experts else 0
    routed = args.k * gemms * 2 * D * (args.expert_ffn or F) + 2 * D * args.experts
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
    return 2.0 * n**3 / best
