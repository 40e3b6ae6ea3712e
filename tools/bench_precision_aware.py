#!/usr/bin/env python
"""Megatron's precision-aware optimizer here: the bytes per param on the process heap, and the loss curve.

    python tools/bench_precision_aware.py [--steps 60]

Memory: a bf16 model of 2.1M params (8 Linear 512 x 512) trains one step under ZeRO stage 1 on one process,
whose shard is everything (at dp N the gradient shard, masters and moments are 1/N of it); printed: what the
process heap (glibc's mallinfo2) grew by per param, next to the optimizer's own accounting by kind.
Loss: one process trains a GPT-MoE (2 layers, hidden 128, 8 experts, seq 64, 8 sequences a step: small, since
bf16 matrix products are emulated on CPUs without AVX-512 BF16) in bf16 on the built-in corpus for --steps
steps, with fp32 moments and with each narrow setting; printed: the loss every --steps / 5 steps and the
largest relative difference to the fp32-moment run. The CPU model is named.
"""

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from moezero.parallel import ParallelGroups  # noqa: E402
from moezero.recipe import parse, pretraining  # noqa: E402
from moezero.zero import PrecisionAwareAdam, ZeroOptimizer  # noqa: E402
from tests.heap import heap_bytes  # noqa: E402
from tools.bench.machine import cpu_model  # noqa: E402

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
OPTIMIZERS = {  # label: (optimizer class, ZeroOptimizer keyword arguments)
    "AdamW, fp32 grads, master and moments": (torch.optim.AdamW, {}),
    "precision-aware, all fp32 (remainder master)": (PrecisionAwareAdam, {}),
    "precision-aware, bf16 moments": (PrecisionAwareAdam, dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)),
    "precision-aware, bf16 moments and main grads": (
        PrecisionAwareAdam,
        dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16, grad_reduce_dtype=BF16, main_grads_dtype=BF16),
    ),
    "precision-aware, fp8 / fp16 moments, bf16 main grads": (
        PrecisionAwareAdam,
        dict(exp_avg_dtype=FP8, exp_avg_sq_dtype=FP16, grad_reduce_dtype=BF16, main_grads_dtype=BF16),
    ),
}
MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
    "--num-experts",
    "8",
    "--moe-router-topk",
    "2",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-warmup-iters",
    "10",
    "--lr-decay-style",
    "cosine",
    "--bf16",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--log-interval",
    "1000",
    "--eval-interval",
    "0",
    "--num-workers",
    "0",
]
CURVES = {
    "fp32 moments": [],
    "bf16 moments": ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
    "bf16 moments + main grads": [
        "--exp-avg-dtype",
        "bf16",
        "--exp-avg-sq-dtype",
        "bf16",
        "--main-grads-dtype",
        "bf16",
    ],
    "fp8 / fp16 moments": ["--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp16"],
}


def heap_per_param(cls, kwargs):
    torch.manual_seed(0)
    gc.collect()
    gc.disable()
    try:
        before = heap_bytes()
        model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(8)]).to(BF16)
        opt = ZeroOptimizer(model, cls, ParallelGroups.single(), stage=1, lr=1e-3, **kwargs)
        model(torch.randn(2, 512, dtype=BF16)).float().square().sum().backward()
        opt.step()
        opt.zero_grad()
        added = heap_bytes() - before
    finally:
        gc.enable()
    n = sum(p.numel() for p in model.parameters())
    return added / n, {k: v / n for k, v in opt.memory_bytes().items()}


def memory_table():
    heap_per_param(torch.optim.AdamW, {})  # one-time allocations
    print("| optimizer (bf16 params, one rank) | heap bytes / param | params | grads | master | moments |")
    print("|---|---|---|---|---|---|")
    for label, (cls, kwargs) in OPTIMIZERS.items():
        total, parts = heap_per_param(cls, kwargs)
        print(
            f"| {label} | {total:.2f} | {parts['params']:.1f} | {parts['grads']:.1f} | {parts['master']:.1f} | "
            f"{parts['optimizer_state']:.1f} |",
            flush=True,
        )


def loss_curves(steps, cache):
    curves = {}
    for label, flags in CURVES.items():
        argv = MODEL + ["--train-iters", str(steps), "--data-cache-path", cache]
        argv += ["--use-precision-aware-optimizer"] + flags if flags else []
        run = pretraining(parse(argv))
        run.train()
        run.groups.destroy()
        curves[label] = [h["lm_loss"] for h in run.history]
    base = curves["fp32 moments"]
    marks = list(range(steps // 5, steps + 1, max(1, steps // 5)))
    print("\n| moments | " + " | ".join(f"loss @{s}" for s in marks) + " | max rel. diff to fp32 |")
    print("|---|" + "---|" * (len(marks) + 1))
    for label, curve in curves.items():
        diff = max(abs(a - b) / b for a, b in zip(curve, base))
        print(f"| {label} | " + " | ".join(f"{curve[s - 1]:.4f}" for s in marks) + f" | {diff:.2e} |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--data-cache-path", default=os.path.expanduser("~/.cache/moezero"))
    args = p.parse_args()
    print(f"CPU: {cpu_model()}\n")
    memory_table()
    loss_curves(args.steps, args.data_cache_path)


if __name__ == "__main__":
    main()
