"""Gradient-accumulation fusion on this CPU: would a bf16 weight gradient computed straight into fp32 pay?

    python tools/bench_wgrad_gemm.py [--rounds 5]

Megatron's --gradient-accumulation-fusion computes each bf16 weight gradient with a GEMM that accumulates
into the fp32 main-grad buffer: no bf16 .grad, no pass that widens it into the bucket. On a CPU that needs a
bf16 x bf16 -> fp32 GEMM. torch's CPU build has none as an op (torch.mm's out_dtype has no CPU kernel), but
the MKL inside it exports cblas_gemm_bf16bf16f32. Per weight-gradient shape (the peer GPT-MoE's, hidden 256,
and one of hidden 1024), this times what a bf16 run does today (a bf16 torch.mm, then the widening add into
an fp32 buffer, as the gradient staging does) and MKL's fused GEMM (beta 1: it accumulates), one thread,
alternating rounds, and prints their ratio: below 1 the fusion would pay on this CPU. Docs:
docs/benchmarks.md#mfu.
"""

import argparse
import ctypes
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tools.bench.machine import bf16_units, cpu_model  # noqa: E402
from tools.bench.rounds import spread  # noqa: E402

# (label, tokens, in features, out features): dW = dY^T X is (out x in), summed over the tokens
SHAPES = [
    ("expert fc1, hidden 256 (256 tokens)", 256, 256, 1024),
    ("expert fc2, hidden 256 (256 tokens)", 256, 1024, 256),
    ("attention qkv, hidden 256 (512 tokens)", 512, 256, 768),
    ("output head, vocab 1024 (512 tokens)", 512, 256, 1024),
    ("expert fc1, hidden 1024 (2048 tokens)", 2048, 1024, 4096),
]
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # cblas enums


def mkl_gemm():
    """MKL's cblas_gemm_bf16bf16f32 from torch's library, or None where this build has none."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        gemm = lib.cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    gemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    gemm.restype = None
    return gemm


def fused(gemm, x, dy, main_grad):
    """main_grad (out x in, fp32) += dy^T x, from bf16 x (tokens x in) and dy (tokens x out)."""
    tokens, fin = x.shape
    fout = dy.shape[1]
    gemm(
        ROW_MAJOR,
        TRANS,
        NO_TRANS,
        fout,
        fin,
        tokens,
        1.0,
        dy.data_ptr(),
        fout,
        x.data_ptr(),
        fin,
        1.0,
        main_grad.data_ptr(),
        fin,
    )


def staged(x, dy, main_grad):
    main_grad.add_(dy.t() @ x)  # a bf16 GEMM, then the bf16 gradient widened into the fp32 buffer


def per_call(fn, calls):
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gemm = mkl_gemm()
    print(f"{cpu_model()} ({', '.join(bf16_units()) or 'no bf16 units'}), torch {torch.__version__}, one thread")
    if gemm is None:
        print("this torch build exports no cblas_gemm_bf16bf16f32: nothing to compare")
        return
    print("| weight gradient | bf16 mm + widening add (ms) | MKL bf16 -> fp32 GEMM (ms) | fused / today | max error |")
    print("|---|---|---|---|---|")
    for label, tokens, fin, fout in SHAPES:
        x = torch.randn(tokens, fin, dtype=torch.bfloat16)
        dy = torch.randn(tokens, fout, dtype=torch.bfloat16)
        exact = dy.double().t() @ x.double()
        check = torch.zeros(fout, fin)
        fused(gemm, x, dy, check)
        error = (check.double() - exact).abs().max().item() / exact.abs().max().item()
        main_grad = torch.zeros(fout, fin)
        calls = max(3, int(4e8 / (tokens * fin * fout)))
        times = {"today": [], "fused": []}
        runs = [("today", lambda: staged(x, dy, main_grad)), ("fused", lambda: fused(gemm, x, dy, main_grad))]
        for index in range(args.rounds):
            for name, run in runs if index % 2 == 0 else list(reversed(runs)):
                times[name].append(per_call(run, calls))
        ratios = [f / t for f, t in zip(times["fused"], times["today"])]
        print(
            f"| {label} | {spread(times['today'], 3)} | {spread(times['fused'], 3)} | {spread(ratios, 2)}x | "
            f"{error:.1e} |"
        )


if __name__ == "__main__":
    main()
