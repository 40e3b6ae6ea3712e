"""What the element-wise CPU kernels give a whole model: one process trains the peer GPT-MoE (4 layers, hidden 256,
4 experts top-2, 2 micro-batches of 2 sequences of 128 tokens, ZeRO-2) in a layer style, with the kernels and with
torch's ops in their place (bias + GELU, the experts' bias add, RMSNorm, SwiGLU, GPT-OSS's quick GEGLU), in
alternating rounds, and prints the step time, the peak RSS and the final loss of each.

    python tools/bench_model_kernels.py [--styles peer,llama,gpt-oss] [--dtypes bf16,fp32] [--rounds 3]

Styles: the peer model's layers (LayerNorm, exact GELU, biases), Llama's (RMSNorm, SwiGLU, no biases) and GPT-OSS's
(RMSNorm, quick GEGLU with offset 1 and clamp 7, biases); tools/bench/moezero_gpt.py STYLES. The losses differ
only by the kernels' roundings (bf16: where a sigmoid's or an rstd's last fp32 bit moves one). Docs:
docs/benchmarks.md#swiglu.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))
from rounds import alternate, error_of, ok, ratios, spread  # noqa: E402
from runner import run_worker  # noqa: E402


def worker_args(style, dtype, steps, warmup):
    return [
        "--layers",
        "4",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--seq",
        "128",
        "--mb",
        "4",
        "--k",
        "2",
        "--vocab",
        "1024",
        "--experts",
        "4",
        "--ep",
        "1",
        "--stage",
        "2",
        "--bucket",
        "2000000",
        "--micro-batches",
        "2",
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--dtype",
        dtype,
        "--style",
        style,
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--styles", default="peer,llama,gpt-oss")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10, help="steps not timed")
    args = p.parse_args()
    configs = [(style, dtype) for dtype in args.dtypes.split(",") for style in args.styles.split(",")]
    systems = []
    for style, dtype in configs:
        argv = worker_args(style, dtype, args.steps, args.warmup)
        systems.append((f"{style} {dtype} kernels", lambda argv=argv: run_worker("moezero", argv, nproc=1)))
        systems.append(
            (
                f"{style} {dtype} torch ops",
                lambda argv=argv: run_worker("moezero", argv + ["--torch-elementwise"], nproc=1),
            )
        )
    results = alternate(systems, args.rounds, "model kernels")
    print(
        f"\n{args.rounds} alternating rounds of {args.steps} steps (the first {args.warmup} not timed), one process, "
        "one thread; medians [min-max] over the rounds\n"
    )
    print(
        "| style | dtype | step, kernels (ms) | step, torch ops (ms) | torch ops / kernels | peak RSS, kernels / "
        "torch ops (MB) | final loss, kernels / torch ops |"
    )
    print("|---|---|---|---|---|---|---|")
    for style, dtype in configs:
        fused, plain = results[f"{style} {dtype} kernels"], results[f"{style} {dtype} torch ops"]
        if not ok(fused) or not ok(plain):
            print(f"| {style} | {dtype} | {error_of(fused) or 'ok'} | {error_of(plain) or 'ok'} | | | |")
            continue
        step = lambda runs: spread([r["step_s"] * 1e3 for r in ok(runs)], 1)
        rss = lambda runs: spread([max(r["peak_rss_mb"]) for r in ok(runs)])
        loss = lambda runs: f"{ok(runs)[-1]['final_loss']:.6f}"
        print(
            f"| {style} | {dtype} | {step(fused)} | {step(plain)} | {spread(ratios(plain, fused, 'step_s'), 3, 'x')}"
            f" | {rss(fused)} / {rss(plain)} | {loss(fused)} / {loss(plain)} |"
        )


if __name__ == "__main__":
    main()
