#!/usr/bin/env python
"""Tensor and context parallelism's exchanges: their share of a step on 2 CPU ranks, against the same work on one
rank.

    python tools/tp_cp_bench.py [--rounds 3] [--quick]

- tensor parallelism (tools/bench/tp_worker.py): a transformer MLP block (norm, GLU fc1 column-parallel, fc2
  row-parallel, residual) and the vocab-parallel output layer with its loss, forward and backward, hidden 512, ffn
  2048, vocab 8192, batch 2 x sequence 512, fp32: tp 2 with and without sequence parallelism against the same layers
  at one rank. exchange: the time inside the layers' collectives (all-reduces; under SP all-gathers and
  reduce-scatters; the loss's max and sum all-reduces), the slowest rank's.
- context parallelism (tools/bench/pipeline_worker.py, the pretraining script's training step): a GPT-MoE at cp 2
  against cp 1 on one rank; exchange: the time inside the cp group's collectives (attention's K/V all-gathers and
  their gradients' reduce-scatters, the loss's token counts).

Runs alternate round by round (tools/bench/rounds.py); figures are medians with [min-max]. A one-rank run does
the whole work in one process; 2 ranks split it, so the ideal speed-up is 2x less the exchanges.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

from rounds import error_of, name_machine, ok, spread  # noqa: E402
from runner import run_worker  # noqa: E402

TP_LAYOUTS = {  # label: (ranks, worker flags)
    "1 rank": (1, []),
    "tp 2": (2, []),
    "tp 2 + sequence parallel": (2, ["--sequence-parallel"]),
}
TP_QUICK = ["--hidden", "128", "--ffn", "256", "--vocab", "1024", "--seq", "128", "--steps", "3"]


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
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    name_machine()
    results = alternate(TP_LAYOUTS, lambda label: run_tp(label, args.quick), rounds, "tp")
    table("Tensor parallelism: an MLP block and the output layer, forward and backward", results, "1 rank")


if __name__ == "__main__":
    main()
