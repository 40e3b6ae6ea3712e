#!/usr/bin/env python
"""MoE layer forward+backward throughput against a dense MLP of the same active FLOPs and DeepSpeed's
MoE layer, in one run: E=8, k=2, hidden 512, FFN 2048, 8k tokens per process, ep 1 and 2, fp32.

    python tools/bench_moe_layer.py [--tokens 8192] [--reps 5]
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

from runner import HERE, REPO, deepspeed_python  # noqa: E402

import json  # noqa: E402


def run(system, nproc, args, python):
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(HERE, "layer_worker.py"), "--system", system, "--tokens", str(args.tokens),
           "--reps", str(args.reps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-deepspeed", action="store_true")
    args = p.parse_args()
    ds = None if args.no_deepspeed else deepspeed_python()
    rows = [("dense MLP, same active FLOPs (FFN 2x2048)", "dense", 1, sys.executable),
            ("moezero MoELayer ep 1", "moezero", 1, sys.executable),
            ("moezero MoELayer ep 2 (2 processes)", "moezero", 2, sys.executable)]
    if ds:
        rows += [("DeepSpeed MoE ep 1", "deepspeed", 1, ds), ("DeepSpeed MoE ep 2 (2 processes)", "deepspeed", 2, ds)]
    results = [(label, run(system, n, args, py)) for label, system, n, py in rows]
    dense = results[0][1].get("tokens_per_s_per_rank")
    by_label = dict(results)
    print(f"\n## MoE layer fwd+bwd, {args.tokens} tokens per process, fp32\n")
    print("| layer | tokens/s per process | vs dense MLP | vs DeepSpeed (same ep) |")
    print("|---|---|---|---|")
    for label, r in results:
        if "error" in r:
            print(f"| {label} | failed: {r['error']} | | |")
            continue
        tps = r["tokens_per_s_per_rank"]
        peer = by_label.get(f"DeepSpeed MoE ep {r['world']}" + (" (2 processes)" if r["world"] == 2 else ""), {})
        vs_ds = "n/a"
        if r["system"] != "dense" and "tokens_per_s_per_rank" in peer:
            vs_ds = f"{tps / peer['tokens_per_s_per_rank']:.2f}x"
        print(f"| {label} | {tps:.0f} | {tps / dense:.2f}x | {vs_ds} |")


if __name__ == "__main__":
    main()
