#!/usr/bin/env python
"""Tensor and context parallelism's exchanges: their share of a step on 2 CPU ranks, against the same work on one
rank.

    python tools/tp_cp_bench.py [--rounds 3] [--quick]

- tensor parallelism (tools/bench/tp_worker.py): a transformer MLP block (norm, GLU fc1 column-parallel, fc2
  row-parallel, residual) and the vocab-parallel output layer with its loss, forward and backward, hidden 512, ffn
  2048, vocab 8192, batch 2 x sequence 512, fp32: tp 2 with and without sequence parallelism against the same layers
  at one rank. exchange: the time inside the layers' collectives (all-reduces; under SP all-gathers and
  reduce-scatters; the loss's max and sum all-reduces), the slowest rank's.
- context parallelism (tools/bench/pipeline_worker.py, the pretraining script's training step): a GPT-MoE (4
  layers, hidden 256, 8 heads, 8 experts top-2, ZeRO 1, fp32) on one sequence of 2048 tokens per step, at cp 2
  (--cp-comm-type all_gather, and a2a) against one rank; exchange: the time inside moezero/context_parallel.py's
  collectives (attention's K/V all-gathers and their gradients' reduce-scatters, or a2a's all-to-alls).

Runs alternate round by round (tools/bench/rounds.py); figures are medians with [min-max]. A one-rank run does
the whole work in one process; 2 ranks split it, so the ideal speed-up is 2x less the exchanges.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

from rounds import error_of, name_machine, ok, spread  # noqa: E402
from runner import REPO, run_worker  # noqa: E402

TP_LAYOUTS = {  # label: (ranks, worker flags)
    "1 rank": (1, []),
    "tp 2": (2, []),
    "tp 2 + sequence parallel": (2, ["--sequence-parallel"]),
}
TP_QUICK = ["--hidden", "128", "--ffn", "256", "--vocab", "1024", "--seq", "128", "--steps", "3"]

CORPUS = os.path.join(REPO, "tests", "assets", "corpus", "corpus_text_document")
CP_MODEL = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 2048 --max-position-embeddings 2048 "
    "--micro-batch-size 1 --global-batch-size 1 --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 "
    "--hidden-dropout 0 --attention-dropout 0 --lr 1e-3 --zero-stage 1 --eval-interval 0 --log-interval 1000 "
    f"--data-path {CORPUS} --split 98,2,0 --num-workers 0 --distributed-backend gloo"
).split()
CP_QUICK = {"--seq-length": "256", "--max-position-embeddings": "256", "--hidden-size": "64"}
CP_LAYOUTS = {  # label: (ranks, flags)
    "1 rank": (1, []),
    "cp 2 (all_gather)": (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]),
    "cp 2 (a2a)": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
}


def run_cp(label: str, quick: bool, iters: int) -> dict:
    ranks, layout = CP_LAYOUTS[label]
    flags = list(CP_MODEL)
    for name, value in (CP_QUICK if quick else {}).items():
        flags[flags.index(name) + 1] = value
    worker = ["--warmup", "2", "--time-collectives-of", "moezero.context_parallel", "--"]
    return run_worker(
        "moezero", worker + flags + layout + ["--train-iters", str(iters)], nproc=ranks, script="pipeline_worker.py"
    )


def run_tp(label: str, quick: bool) -> dict:
    ranks, flags = TP_LAYOUTS[label]
    return run_worker("moezero", flags + (TP_QUICK if quick else []), nproc=ranks, script="tp_worker.py")


def alternate(layouts, run, rounds: int, name: str) -> dict:
    results = {label: [] for label in layouts}
    for index in range(rounds):
        for label in list(layouts) if index % 2 == 0 else list(reversed(list(layouts))):
            result = run(label)
            results[label].append(result)
            status = result.get("error") or f"{result['step_s']:.3f} s/step"
            print(f"  {name} round {index + 1}/{rounds}: {label:28s} {status}", file=sys.stderr, flush=True)
    return results


def table(title: str, results: dict, base_label: str) -> None:
    base = ok(results[base_label])
    print(f"\n#### {title}\n")
    print("| layout | step (s) | speed-up vs 1 rank | exchanges (s) | exchanges' share of the step |")
    print("|---|---|---|---|---|")
    for label, runs in results.items():
        mine = ok(runs)
        if not mine:
            print(f"| {label} | {error_of(runs)} | | | |")
            continue
        speedups = [b["step_s"] / r["step_s"] for r, b in zip(mine, base)] if base else []
        shares = [r["exchange_s"] / r["step_s"] for r in mine]
        print(
            f"| {label} | {spread([r['step_s'] for r in mine], 3)} | {spread(speedups, 2, 'x') if speedups else '-'} "
            f"| {spread([r['exchange_s'] for r in mine], 3)} | {spread(shares, 2)} |"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smaller shapes, 1 round (a smoke run)")
    parser.add_argument("--iters", type=int, default=8, help="cp: steps per run (the first 2 are not timed)")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    name_machine()
    results = alternate(TP_LAYOUTS, lambda label: run_tp(label, args.quick), rounds, "tp")
    table("Tensor parallelism: an MLP block and the output layer, forward and backward", results, "1 rank")
    iters = 4 if args.quick else args.iters
    results = alternate(CP_LAYOUTS, lambda label: run_cp(label, args.quick, iters), rounds, "cp")
    table("Context parallelism: the pretraining script's step, one sequence per step", results, "1 rank")


if __name__ == "__main__":
    main()
