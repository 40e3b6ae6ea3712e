#!/usr/bin/env python
"""moezero vs DeepSpeed-MoE training throughput on the same GPT-MoE, in one run (2 CPU processes).

    python tools/bench_vs_peers.py                 # the comparison, MFU, scaling tables and a PNG chart
    python tools/bench_vs_peers.py --quick         # fewer steps and rounds

Systems alternate round by round (these machines are noisy; ratios within one run are what count):
moezero ZeRO-2 at ep 1 and 2, DeepSpeed ZeRO-2 with its MoE layer at ep 1 and 2 (dropless,
random token selection off, same k and aux coefficient, same data), and moezero stage 0 as the
no-ZeRO baseline. MFU divides achieved training FLOP/s by the torch.mm peak measured in the same
run on the same processes. DeepSpeed's venv is created on first use (../shared/peers recipe).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

from runner import REPO, run_worker  # noqa: E402

SYSTEMS = [  # (label, system, extra worker args)
    ("moezero ZeRO-2 ep1", "moezero", ["--stage", "2", "--ep", "1"]),
    ("moezero ZeRO-2 ep2", "moezero", ["--stage", "2", "--ep", "2"]),
    ("DeepSpeed ZeRO-2 ep1", "deepspeed", ["--stage", "2", "--ep", "1"]),
    ("DeepSpeed ZeRO-2 ep2", "deepspeed", ["--stage", "2", "--ep", "2"]),
    ("moezero stage 0 ep2 (no ZeRO)", "moezero", ["--stage", "0", "--ep", "2"]),
]


def model_args(args):
    return ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.hidden // 64),
            "--seq", str(args.seq), "--mb", str(args.mb), "--experts", "8", "--k", "2", "--vocab", "1024",
            "--steps", str(args.steps), "--warmup", "2"]


def comparison(args):
    runs = {label: [] for label, _, _ in SYSTEMS}
    for round_index in range(args.rounds):
        order = SYSTEMS if round_index % 2 == 0 else SYSTEMS[::-1]
        for label, system, extra in order:
            result = run_worker(system, model_args(args) + extra + ["--peak"])
            runs[label].append(result)
            status = result.get("error") or f"{result['tokens_per_s']:.0f} tokens/s"
            print(f"  round {round_index + 1}: {label:32s} {status}", file=sys.stderr, flush=True)
    return {label: _best(results) for label, results in runs.items()}


def _best(results):
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[-1]
    best = max(ok, key=lambda r: r["tokens_per_s"])
    best = dict(best, tokens_per_s_all=[r["tokens_per_s"] for r in ok])
    return best


def print_comparison(best):
    print("\n## moezero vs DeepSpeed (GPT-MoE, 2 CPU processes, fp32)\n")
    print("| system | tokens/s | step time (s) | peak RSS/rank (MB) | final loss | vs DeepSpeed (same ep) | MFU |")
    print("|---|---|---|---|---|---|---|")
    # one peak for every row: the best torch.mm FLOP/s any run measured (both processes, 1 thread each)
    peak = max((r.get("gemm_peak_flops", 0) for r in best.values() if "error" not in r), default=0)
    for label, r in best.items():
        if "error" in r:
            print(f"| {label} | failed: {r['error']} | | | | | |")
            continue
        ep = r["ep"]
        ds = best.get(f"DeepSpeed ZeRO-2 ep{ep}", {})
        ratio = f"{r['tokens_per_s'] / ds['tokens_per_s']:.2f}x" if "tokens_per_s" in ds else "n/a"
        mfu = r["flops_per_token"] * r["tokens_per_s"] / peak if peak else 0
        print(f"| {label} | {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | {max(r['peak_rss_mb']):.0f} | "
              f"{r['final_loss']:.4f} | {ratio} | {mfu:.1%} |")
    print(f"\nMFU = training FLOP/s (model FLOPs per token x tokens/s) / {peak / 1e9:.0f} GFLOP/s, the torch.mm "
          "fp32 peak of the 2 processes measured in this run.")


def scaling(args):
    """Step time as experts grow at constant active FLOPs, and as tokens grow (moezero ZeRO-2 ep2)."""
    print("\n## Scaling (moezero ZeRO-2, ep 2)\n")
    print("| experts (k=2, same expert size) | step time (s) | vs E=4 | forward+backward (s) | optimizer step (s) |")
    print("|---|---|---|---|---|")
    base = None
    for experts in (4, 8, 16, 32):
        extra = ["--stage", "2", "--ep", "2", "--experts", str(experts)]
        r = run_worker("moezero", model_args(args) + extra)
        if "error" in r:
            print(f"| {experts} | failed: {r['error']} | | | |")
            continue
        base = base or r["step_s"]
        print(f"| {experts} | {r['step_s']:.3f} | {r['step_s'] / base:.2f}x | {r['step_s'] - r['optimizer_s']:.3f} "
              f"| {r['optimizer_s']:.3f} |")
    print("\n| tokens per rank per step | step time (s) | time per token vs smallest |")
    print("|---|---|---|")
    base = None
    for mb in (1, 2, 4):
        extra = ["--stage", "2", "--ep", "2", "--mb", str(mb)]
        r = run_worker("moezero", model_args(args) + extra)
        if "error" in r:
            print(f"| {mb * args.seq} | failed: {r['error']} | |")
            continue
        per_token = r["step_s"] / (mb * args.seq)
        base = base or per_token
        print(f"| {mb * args.seq} | {r['step_s']:.3f} | {per_token / base:.2f}x |")


def overlap(args):
    """Communication overlap: ZeRO-2 with buckets reduced during backward vs only at its end."""
    print("\n## Gradient-reduction overlap (moezero ZeRO-2 ep2, 8 buckets)\n")
    print("| overlap | step time (s) |")
    print("|---|---|")
    bucket = ["--bucket", "500000"]
    for flag, label in (([], "during backward"), (["--no-overlap"], "after backward"),
                        (["--late-first-bucket"], "during backward, but bucket 0 is ready last")):
        r = run_worker("moezero", model_args(args) + ["--stage", "2", "--ep", "2"] + bucket + flag)
        print(f"| {label} | {r.get('step_s', float('nan')):.3f} |")


def chart(best, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, r in best.items() if "error" not in r]
    values = [best[label]["tokens_per_s"] for label in labels]
    colors = ["tab:orange" if label.startswith("DeepSpeed") else "tab:blue" for label in labels]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh(labels, values, color=colors)
    ax.set_xlabel("training tokens/s (2 CPU processes, higher is better)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nchart: {os.path.relpath(path, REPO)}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--mb", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smaller model, fewer steps, one round")
    p.add_argument("--skip-scaling", action="store_true")
    p.add_argument("--chart", default=os.path.join(REPO, "docs", "bench_vs_peers.png"))
    args = p.parse_args()
    if args.quick:
        args.layers, args.hidden, args.seq, args.steps, args.rounds = 4, 256, 128, 6, 1
    best = comparison(args)
    print_comparison(best)
    os.makedirs(os.path.dirname(args.chart), exist_ok=True)
    chart(best, args.chart)
    if not args.skip_scaling:
        scaling(args)
        overlap(args)


if __name__ == "__main__":
    main()
