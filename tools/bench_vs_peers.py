#!/usr/bin/env python
"""moezero vs DeepSpeed-MoE, end to end: the same GPT-MoE trained by each, fp32 and bf16, on 2 processes.

    python tools/bench_vs_peers.py [--rounds 5] [--quick]

What each side runs (the fairness rules of these benchmarks):
- the same GPT (pre-norm, learned positions, untied head, GELU MLP 4h, MoE on every other layer, E=8,
  k=2, aux coefficient 0.01), the same init rule (Megatron's), the same synthetic data;
- the same optimizer implementation: torch AdamW with fused=True (moezero's ZeroOptimizer, and the
  client optimizer DeepSpeed wraps);
- dropless routing with true top-2 on both (DeepSpeed: drop_tokens=False, use_rts=False,
  top2_2nd_expert_sampling=False). DeepSpeed's dropless MoE computes every expert padded to the
  largest expert's load (bench_moe_layer.py measures that); moezero computes the real rows;
- ZeRO-2, gradient bucket 2e6 elements, DeepSpeed without overlap_comm (on CPU it has no reduction
  stream; moezero reduces during backward as it does everywhere).
Systems alternate round by round; each number is the median over rounds with [min-max]; a ratio is
the median of per-round ratios. The kernel paths of the machine (bf16 units or emulated bf16 GEMM)
are printed with the tables.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

from rounds import alternate, error_of, name_machine, ok, ratios, spread  # noqa: E402
from runner import run_worker  # noqa: E402
from synthetic import bf16_native  # noqa: E402


def model_args(args, dtype):
    steps = args.steps if dtype == "fp32" else args.bf16_steps
    return [
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--heads",
        str(args.hidden // 64),
        "--seq",
        str(args.seq),
        "--mb",
        str(args.mb),
        "--experts",
        "8",
        "--k",
        "2",
        "--vocab",
        "1024",
        "--steps",
        str(steps),
        "--warmup",
        "2",
        "--dtype",
        dtype,
        "--bucket",
        "2000000",
    ]


def systems(args, dtype, eps):
    out = []
    for ep in eps:
        out.append(
            (
                f"moezero ZeRO-2 ep{ep}",
                lambda ep=ep: run_worker("moezero", model_args(args, dtype) + ["--stage", "2", "--ep", str(ep)]),
            )
        )
        out.append(
            (
                f"DeepSpeed ZeRO-2 ep{ep}",
                lambda ep=ep: run_worker(
                    "deepspeed", model_args(args, dtype) + ["--stage", "2", "--ep", str(ep), "--no-overlap"]
                ),
            )
        )
    if dtype == "fp32":
        out.append(
            (
                "moezero stage 0 ep2 (no ZeRO)",
                lambda: run_worker("moezero", model_args(args, dtype) + ["--stage", "0", "--ep", "2"]),
            )
        )
    return out


def print_table(title, results):
    print(f"\n#### {title}\n")
    print("| system | tokens/s | vs DeepSpeed (same ep) | step time (s) | RSS/rank at end (MB) | final loss |")
    print("|---|---|---|---|---|---|")
    for label, runs in results.items():
        good = ok(runs)
        if not good:
            print(f"| {label} | failed: {error_of(runs)} | | | | |")
            continue
        ep = good[0]["ep"]
        peer = results.get(f"DeepSpeed ZeRO-2 ep{ep}", [])
        ratio = "1.00x" if label.startswith("DeepSpeed") else spread(ratios(runs, peer), 2, "x")
        print(
            f"| {label} | {spread([r['tokens_per_s'] for r in good])} | {ratio} | "
            f"{spread([r['step_s'] for r in good], 3)} | {spread([r['rss_end_mb'] for r in good])} | "
            f"{good[-1]['final_loss']:.4f} |"
        )


def print_kernel_paths(results):
    paths = next((r["kernel_paths"] for runs in results.values() for r in ok(runs)), None)
    if paths:
        units = ", ".join(paths["bf16_units"]) if paths["bf16_units"] else "none (bf16 GEMMs are emulated)"
        print(
            f"\nKernel paths: CPU capability {paths['cpu_capability']}; bf16 GEMM units: {units}; a bf16 "
            f"torch.mm takes {paths['bf16_gemm_slowdown']:.1f}x the fp32 time here."
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mb", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--bf16-steps", type=int, default=None, help="default: 25 where bf16 GEMMs are native, else 6")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--large", action="store_true", help="also hidden 1024, seq 1024 (fp32, ep 2)")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 rounds (a smoke test)")
    args = p.parse_args()
    name_machine()
    if args.bf16_steps is None:
        args.bf16_steps = 25 if bf16_native() else 6
    if args.quick:
        args.layers, args.hidden, args.seq, args.steps, args.bf16_steps, args.rounds = 2, 128, 64, 4, 3, 2
    fp32 = alternate(systems(args, "fp32", (1, 2)), args.rounds, "fp32")
    print_table(
        f"GPT-MoE {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch {args.mb}, "
        f"E=8 k=2, fp32, 2 processes, {args.rounds} rounds",
        fp32,
    )
    bf16 = alternate(systems(args, "bf16", (2,)), args.rounds, "bf16")
    print_table(f"the same, bf16 (fp32 masters), ep 2, {args.rounds} rounds", bf16)
    print_kernel_paths(fp32)
    if args.large:
        args.hidden, args.seq, args.mb, args.layers, args.steps = 1024, 1024, 1, 2, 5
        large = alternate(systems(args, "fp32", (2,))[:2], args.rounds, "large")
        print_table(
            f"GPT-MoE 2 layers, hidden 1024, seq 1024, micro-batch 1, E=8 k=2, fp32, ep 2, {args.rounds} rounds", large
        )


if __name__ == "__main__":
    main()
