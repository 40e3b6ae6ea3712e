#!/usr/bin/env python
"""How cost grows with the model: moezero vs DeepSpeed-MoE at three sizes, ZeRO-2, ep 2, 2 processes.

    python tools/bench_growth.py [--rounds 2] [--dtype fp32,bf16] [--sizes small,medium,large] [--quick]

The sizes run from the end-to-end benchmark's GPT-MoE (docs/benchmarks.md) to one whose DeepSpeed run takes most
of a 24 GiB machine's memory on 2 ranks (fp32 Adam states included): widths 256 / 1024 / 2048, 8 / 16 / 16
experts (top-2, FFN 4h), sequence 128 / 512 / 1024. The fairness rules are bench_vs_peers.py's (the same worker,
init, data, fused AdamW, true dropless top-2, no overlap for DeepSpeed on the CPU). Each row: tokens/s and peak
RSS per rank of each system, medians over alternating rounds with [min-max], and moezero's ratio (the median of
per-round ratios), so a reader sees whether the ratio holds as the model grows. ZeRO-3 has no row: DeepSpeed
refuses its native MoE at stage 3 ("Native DeepSpeed MoE is not supported with ZeRO Stage 3");
tools/bench_stage3.py compares moezero's stages 3 and 2.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

from rounds import alternate, name_machine, versus_cells  # noqa: E402
from runner import run_worker  # noqa: E402
from synthetic import bf16_native  # noqa: E402

SIZES = {  # name: (layers, hidden, experts, seq, micro-batch, timed steps)
    "small": (4, 256, 8, 128, 4, 10),
    "medium": (4, 1024, 16, 512, 1, 4),
    "large": (2, 2048, 16, 1024, 1, 3),  # sized so that DeepSpeed fits a 24 GiB machine on 2 ranks
}


def size_args(name, dtype):
    layers, hidden, experts, seq, mb, steps = SIZES[name]
    return [
        "--layers",
        str(layers),
        "--hidden",
        str(hidden),
        "--heads",
        str(hidden // 64),
        "--seq",
        str(seq),
        "--mb",
        str(mb),
        "--experts",
        str(experts),
        "--k",
        "2",
        "--vocab",
        "1024",
        "--steps",
        str(steps),
        "--warmup",
        "1",
        "--dtype",
        dtype,
        "--bucket",
        "2000000",
        "--stage",
        "2",
        "--ep",
        "2",
    ]


def systems(name, dtype):
    argv = size_args(name, dtype)
    return [
        (f"moezero {name} {dtype}", lambda: run_worker("moezero", argv)),
        (f"DeepSpeed {name} {dtype}", lambda: run_worker("deepspeed", argv + ["--no-overlap"])),
    ]


def print_rows(results, sizes, dtypes):
    print(
        "| size | dtype | moezero tokens/s | DeepSpeed tokens/s | moezero vs DeepSpeed | "
        "moezero peak RSS/rank (MB) | DeepSpeed peak RSS/rank (MB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in sizes:
        layers, hidden, experts, seq, mb, _ = SIZES[name]
        label = f"{name}: {layers} layers, hidden {hidden}, E={experts}, seq {seq}, mb {mb}"
        for dtype in dtypes:
            ours, theirs = results[f"moezero {name} {dtype}"], results[f"DeepSpeed {name} {dtype}"]
            print(f"| {label} | {dtype} |" + versus_cells(ours, theirs, lambda r: max(r["peak_rss_mb"])))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: " + ", ".join(SIZES))
    p.add_argument("--quick", action="store_true", help="the small size, fp32, one round (a smoke test)")
    args = p.parse_args()
    name_machine()
    sizes, dtypes = args.sizes.split(","), args.dtype.split(",")
    if args.quick:
        sizes, dtypes, args.rounds = ["small"], ["fp32"], 1
    results = {}
    for name in sizes:
        for dtype in dtypes:
            results.update(alternate(systems(name, dtype), args.rounds, f"{name} {dtype}"))
    print(
        f"\n#### moezero vs DeepSpeed as the model grows (ZeRO-2, ep 2, 2 processes, {args.rounds} rounds; "
        f"bf16 GEMMs {'native' if bf16_native() else 'emulated'} on this CPU)\n"
    )
    print_rows(results, sizes, dtypes)


if __name__ == "__main__":
    main()
