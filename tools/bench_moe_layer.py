#!/usr/bin/env python
"""One MoE layer, forward + backward: moezero vs DeepSpeed vs a dense MLP of the same active FLOPs.

    python tools/bench_moe_layer.py [--rounds 5] [--tokens 8192]

E=8, k=2, hidden 512, FFN 2048, fp32, ep 1 (one process) and ep 2 (two), at two routings:
balanced (a fresh router) and skewed (a trained router's imbalance: the first experts popular).
DeepSpeed's dropless layer computes every expert padded to the most loaded expert's rows; the table
names that padding (E x max load / assignments) next to the measured load imbalance. Medians over
alternating rounds with [min-max].
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

from rounds import alternate, error_of, name_machine, ok, ratios, spread  # noqa: E402
from runner import HERE, REPO, deepspeed_python  # noqa: E402


def run(system, nproc, args, python, skew):
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        os.path.join(HERE, "layer_worker.py"),
        "--system",
        system,
        "--tokens",
        str(args.tokens),
        "--reps",
        str(args.reps),
        "--skew",
        str(skew),
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            return dict(result, tokens_per_s=result["tokens_per_s_per_rank"])
    return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}


def systems(args, ds, skew):
    rows = [
        ("dense MLP, same active FLOPs", "dense", 1, sys.executable),
        ("moezero ep 1", "moezero", 1, sys.executable),
        ("moezero ep 2", "moezero", 2, sys.executable),
    ]
    if ds:
        rows += [("DeepSpeed ep 1", "deepspeed", 1, ds), ("DeepSpeed ep 2", "deepspeed", 2, ds)]
    return [(label, lambda s=system, n=n, py=py: run(s, n, args, py, skew)) for label, system, n, py in rows]


def print_table(title, results):
    print(f"\n#### {title}\n")
    print(
        "| layer | tokens/s per process | vs DeepSpeed (same ep) | vs dense MLP | max/mean expert load | "
        "DeepSpeed's padding |"
    )
    print("|---|---|---|---|---|---|")
    dense = results["dense MLP, same active FLOPs"]
    for label, runs in results.items():
        good = ok(runs)
        if not good:
            print(f"| {label} | failed: {error_of(runs)} | | | | |")
            continue
        peer = results.get(label.replace("moezero", "DeepSpeed"), []) if label.startswith("moezero") else []
        vs_ds = spread(ratios(runs, peer), 2, "x") if ok(peer) else ""
        load = f"{good[0]['max_mean_load']:.2f}" if "max_mean_load" in good[0] else ""
        padding = f"{good[0]['deepspeed_padding']:.2f}x rows" if label.startswith("DeepSpeed") else ""
        print(
            f"| {label} | {spread([r['tokens_per_s'] for r in good])} | {vs_ds} | "
            f"{spread(ratios(runs, dense), 2, 'x')} | {load} | {padding} |"
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-deepspeed", action="store_true")
    args = p.parse_args()
    name_machine()
    ds = None if args.no_deepspeed else deepspeed_python()
    for title, skew in (("balanced routing (a fresh router)", 0.0), ("skewed routing (a trained router)", 0.1)):
        results = alternate(systems(args, ds, skew), args.rounds, title.split()[0])
        print_table(
            f"MoE layer fwd+bwd, {args.tokens} tokens per process, E=8 k=2, hidden 512, FFN 2048, fp32: "
            f"{title}, {args.rounds} rounds",
            results,
        )


if __name__ == "__main__":
    main()
