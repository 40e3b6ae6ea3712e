#!/usr/bin/env python
"""ZeRO step time and peak memory against torch and DeepSpeed, in one run on 2 CPU processes.

    python tools/bench_zero.py [--quick]

Models: a dense GPT of ~50M params and a GPT-MoE (ep 1, so torch DDP applies). Systems: torch DDP
+ AdamW, torch ZeroRedundancyOptimizer, moezero stage 1 and 2, DeepSpeed stage 1 and 2 (when its
venv can be made). Systems alternate round by round; the best round counts. Ratios are against
DeepSpeed stage 2 (time and memory) and DDP (time).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

from runner import run_worker  # noqa: E402

SYSTEMS = [
    ("torch DDP + AdamW", "ddp", []),
    ("torch ZeroRedundancyOptimizer", "torch_zero", []),
    ("moezero stage 1", "moezero", ["--stage", "1"]),
    ("moezero stage 2", "moezero", ["--stage", "2"]),
    ("DeepSpeed stage 1", "deepspeed", ["--stage", "1"]),
    ("DeepSpeed stage 2", "deepspeed", ["--stage", "2"]),
]
MODELS = {
    "dense GPT ~50M": ["--layers", "12", "--hidden", "576", "--heads", "9", "--experts", "0", "--seq", "128",
                       "--mb", "2", "--vocab", "1024"],
    "GPT-MoE (E=8, k=2, ep 1)": ["--layers", "4", "--hidden", "256", "--heads", "4", "--experts", "8",
                                "--seq", "128", "--mb", "4", "--vocab", "1024"],
}


def run_model(name, model_args, args):
    best = {}
    for round_index in range(args.rounds):
        order = SYSTEMS if round_index % 2 == 0 else SYSTEMS[::-1]
        for label, system, extra in order:
            r = run_worker(system, model_args + extra + ["--steps", str(args.steps), "--warmup", "2"])
            status = r.get("error") or f"{r['step_s']:.3f} s/step"
            print(f"  {name} round {round_index + 1}: {label:30s} {status}", file=sys.stderr, flush=True)
            if "error" in r and label in best:
                continue
            if label not in best or "error" in best[label] or r["step_s"] < best[label]["step_s"]:
                best[label] = r
    return best


def print_table(name, best):
    print(f"\n## {name} (2 CPU processes, fp32)\n")
    print("| system | step time (s) | peak RSS/rank (MB) | time vs DeepSpeed-2 | memory vs DeepSpeed-2 | time vs DDP |")
    print("|---|---|---|---|---|---|")
    ds, ddp = best.get("DeepSpeed stage 2", {}), best.get("torch DDP + AdamW", {})
    for label, r in best.items():
        if "error" in r:
            print(f"| {label} | failed: {r['error']} | | | | |")
            continue
        rss = max(r["peak_rss_mb"])
        t_ds = f"{r['step_s'] / ds['step_s']:.2f}" if "step_s" in ds else "n/a"
        m_ds = f"{rss / max(ds['peak_rss_mb']):.2f}" if "peak_rss_mb" in ds else "n/a"
        t_ddp = f"{r['step_s'] / ddp['step_s']:.2f}" if "step_s" in ddp else "n/a"
        print(f"| {label} | {r['step_s']:.3f} | {rss:.0f} | {t_ds} | {m_ds} | {t_ddp} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="5 steps, one round")
    args = p.parse_args()
    if args.quick:
        args.steps, args.rounds = 5, 1
    for name, model_args in MODELS.items():
        print_table(name, run_model(name, model_args, args))


if __name__ == "__main__":
    main()
