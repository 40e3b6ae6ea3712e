#!/usr/bin/env python
"""How cost grows with the number of experts, at constant active FLOPs: moezero vs DeepSpeed.

    python tools/bench_scaling.py [--rounds 3]

GPT-MoE, 4 layers (MoE on 2), hidden 256, seq 128, micro-batch 4, ZeRO-2, ep 2, fp32, 2 processes:
  - E = 4 ... 128 experts, top-2, each expert the same size (so every token does the same work and
    only the total parameter count grows); time and memory per doubling of E;
  - fine-grained experts: 64 experts of a quarter the width, top-8, against 8 experts, top-2 (the same
    active FLOPs, DeepSeek-style).
Same fairness rules as bench_vs_peers.py (fused AdamW on both, true top-k, dropless). Medians over
alternating rounds with [min-max].
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

from rounds import alternate, error_of, name_machine, ok, ratios, spread, versus_cells  # noqa: E402
from runner import run_worker  # noqa: E402

BASE = [
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
    "--vocab",
    "1024",
    "--stage",
    "2",
    "--ep",
    "2",
    "--warmup",
    "2",
]


def pair(label, extra, steps):
    args = BASE + ["--steps", str(steps)] + extra
    return [
        (f"moezero {label}", lambda: run_worker("moezero", args)),
        (f"DeepSpeed {label}", lambda: run_worker("deepspeed", args + ["--no-overlap"])),
    ]


def print_sweep(results, experts):
    print(
        "\n| experts (top-2, same size) | moezero tokens/s | DeepSpeed tokens/s | moezero vs DeepSpeed | "
        "moezero step vs half the experts | DeepSpeed step vs half | moezero RSS/rank (MB) | "
        "DeepSpeed RSS/rank (MB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    previous = None
    for e in experts:
        ours, theirs = results[f"moezero E={e}"], results[f"DeepSpeed E={e}"]
        if not ok(ours) or not ok(theirs):
            print(f"| {e} | {error_of(ours) or 'ok'} | {error_of(theirs) or 'ok'} | | | | | |")
            previous = None
            continue
        growth = ["", ""]
        if previous is not None:
            growth = [spread(ratios(previous[i], run, "tokens_per_s"), 2, "x") for i, run in enumerate((ours, theirs))]
        print(
            f"| {e} | {spread([r['tokens_per_s'] for r in ok(ours)])} | "
            f"{spread([r['tokens_per_s'] for r in ok(theirs)])} | {spread(ratios(ours, theirs), 2, 'x')} | "
            f"{growth[0]} | {growth[1]} | {spread([r['rss_end_mb'] for r in ok(ours)])} | "
            f"{spread([r['rss_end_mb'] for r in ok(theirs)])} |"
        )
        previous = (ours, theirs)


def print_fine_grained(results):
    print(
        "\n| experts | moezero tokens/s | DeepSpeed tokens/s | moezero vs DeepSpeed | moezero RSS/rank (MB) | "
        "DeepSpeed RSS/rank (MB) |"
    )
    print("|---|---|---|---|---|---|")
    for label in ("8 x FFN 1024, top-2", "64 x FFN 256, top-8"):
        ours, theirs = results[f"moezero {label}"], results[f"DeepSpeed {label}"]
        print(f"| {label} |" + versus_cells(ours, theirs, lambda r: r["rss_end_mb"]))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-experts", type=int, default=128)
    args = p.parse_args()
    name_machine()
    experts = [e for e in (4, 8, 16, 32, 64, 128) if e <= args.max_experts]
    systems = [s for e in experts for s in pair(f"E={e}", ["--experts", str(e), "--k", "2"], args.steps)]
    sweep = alternate(systems, args.rounds, "experts")
    print(f"\n#### Experts at constant active FLOPs (2 processes, ZeRO-2, ep 2, fp32, {args.rounds} rounds)")
    print_sweep(sweep, experts)
    fine = pair("8 x FFN 1024, top-2", ["--experts", "8", "--k", "2", "--expert-ffn", "1024"], args.steps) + pair(
        "64 x FFN 256, top-8", ["--experts", "64", "--k", "8", "--expert-ffn", "256"], args.steps
    )
    print(f"\n#### Fine-grained experts, the same active FLOPs ({args.rounds} rounds)")
    print_fine_grained(alternate(fine, args.rounds, "fine-grained"))


if __name__ == "__main__":
    main()
