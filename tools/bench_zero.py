#!/usr/bin/env python
"""The optimizer alone: moezero's ZeroOptimizer vs DeepSpeed's ZeRO engine vs torch, on moezero's model.

    python tools/bench_zero.py [--rounds 5] [--quick]

Every system trains moezero's own GPTModel (moezero's MoE layer, ep 1), built identically (keyed
init: the same weights on every side), on the same data, with torch AdamW fused=True: only the
data-parallel optimizer differs. Systems: torch DDP + AdamW, torch ZeroRedundancyOptimizer, moezero
stages 1-3, DeepSpeed stages 1-3. Step time and the optimizer step alone are medians over alternating
rounds with [min-max]; memory is the resident set at the end of the run and the optimizer's own
accounting (moezero). DeepSpeed's ZeRO-3 runs the dense model; on the MoE model it fails in backward
(the router reads its gate weight inside the op, which DeepSpeed's per-module gathering does not see).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

from rounds import alternate, error_of, name_machine, ok, ratios, spread  # noqa: E402
from runner import run_worker  # noqa: E402

MODELS = {  # name: (model flags, DeepSpeed stages that run it)
    "GPT-MoE (E=8, k=2, ep 1)": (
        [
            "--layers",
            "4",
            "--hidden",
            "256",
            "--heads",
            "4",
            "--experts",
            "8",
            "--seq",
            "128",
            "--mb",
            "4",
            "--vocab",
            "1024",
        ],
        (1, 2),
    ),
    "dense GPT ~30M": (
        [
            "--layers",
            "8",
            "--hidden",
            "576",
            "--heads",
            "9",
            "--experts",
            "0",
            "--seq",
            "128",
            "--mb",
            "2",
            "--vocab",
            "1024",
        ],
        (1, 2, 3),
    ),
}


def deepspeed(common, stage):
    return run_worker("deepspeed", common + ["--stage", str(stage), "--model", "moezero", "--no-overlap"])


def systems(common, ds_stages):
    out = [
        ("torch DDP + AdamW", lambda: run_worker("ddp", common)),
        ("torch ZeroRedundancyOptimizer", lambda: run_worker("torch_zero", common)),
    ]
    for stage in (1, 2, 3):
        out.append((f"moezero stage {stage}", lambda s=stage: run_worker("moezero", common + ["--stage", str(s)])))
        if stage in ds_stages:
            out.append((f"DeepSpeed stage {stage}", lambda s=stage: deepspeed(common, s)))
    return out


def print_table(name, results, rounds):
    print(f"\n#### {name}: 2 processes, fp32, {rounds} rounds\n")
    print(
        "| system | step time (s) | vs DeepSpeed (same stage) | vs DDP | RSS/rank at end (MB) | optimizer bytes/rank "
        "(MB) | final loss |"
    )
    print("|---|---|---|---|---|---|---|")
    ddp = results.get("torch DDP + AdamW", [])
    for label, runs in results.items():
        good = ok(runs)
        if not good:
            print(f"| {label} | failed: {error_of(runs)[:120]} | | | | | |")
            continue
        stage = label.rsplit(" ", 1)[-1]
        peer = results.get(f"DeepSpeed stage {stage}", []) if label.startswith("moezero") else []
        vs_ds = spread(ratios(runs, peer), 2, "x") if ok(peer) else "n/a"
        owned = good[-1].get("optimizer_bytes")
        owned = f"{sum(owned.values()) / 2**20:.0f}" if owned else ""
        print(
            f"| {label} | {spread([r['step_s'] for r in good], 3)} | {vs_ds} | {spread(ratios(runs, ddp), 2, 'x')} "
            f"| {spread([r['rss_end_mb'] for r in good])} | {owned} | {good[-1]['final_loss']:.4f} |"
        )
    print("\n(ratios: this system's tokens/s over the other's, per round; above 1 means this system is faster)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="4 steps, 2 rounds (a smoke test)")
    args = p.parse_args()
    name_machine()
    if args.quick:
        args.steps, args.rounds = 4, 2
    for name, (model_args, ds_stages) in MODELS.items():
        common = model_args + ["--steps", str(args.steps), "--warmup", "2", "--ep", "1"]
        results = alternate(systems(common, ds_stages), args.rounds, name)
        if 3 not in ds_stages:  # tried once, to show how it fails
            results["DeepSpeed stage 3"] = [deepspeed(common, 3)]
        print_table(name, results, args.rounds)


if __name__ == "__main__":
    main()
