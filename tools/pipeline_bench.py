#!/usr/bin/env python
"""Pipeline parallelism's cost: a 1F1B and an interleaved run on 2 CPU ranks against the same model at pp 1 on one
rank, the measured bubble against the theory's, and each stage's memory against its share of the layers.

    python tools/pipeline_bench.py [--rounds 3] [--micro-batches 4,8] [--quick]

Every configuration is the pretraining script (its entry point in each rank, tools/bench/pipeline_worker.py) on the
same GPT-MoE (8 layers, all MoE, 8 experts top-2, hidden 256, sequence 256, micro-batch 2), ZeRO stage 1, one
pipeline (dp 1): the step's m micro-batches on 1 rank at pp 1, or split over 2 stages. Runs alternate round by
round (tools/bench/rounds.py); figures are medians with [min-max].

- step: the training step's wall time (the slowest rank's); speed-up = pp 1's step / the pipeline's (2 ranks: at
  most 2x, less the bubble and the sends).
- bubble: per rank, 1 - (time in the rank's own chunk forwards and backwards) / (time in the schedule), per stage
  and their mean; theory: (p - 1) / (m + p - 1), and (p - 1) / (v m + p - 1) with v virtual stages per rank
  (the idle share of a schedule whose forward and backward of a chunk take the same time on every stage).
- memory: each stage's peak resident set less the process's before the model was built (the interpreter and torch),
  against pp 1's; a stage holds half the layers (the embedding on the first, the output layer on the last).
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

from rounds import error_of, name_machine, ok, spread  # noqa: E402
from runner import REPO, run_worker  # noqa: E402

CORPUS = os.path.join(REPO, "tests", "assets", "corpus", "corpus_text_document")
MODEL = (
    "--num-layers 8 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --micro-batch-size 2 "
    "--num-experts 8 --moe-router-topk 2 --moe-layer-freq 1 --moe-aux-loss-coeff 1e-2 "
    "--hidden-dropout 0 --attention-dropout 0 --lr 1e-3 --zero-stage 1 --eval-interval 0 --log-interval 1000 "
    f"--data-path {CORPUS} --split 98,2,0 --num-workers 0 --distributed-backend gloo"
).split()
QUICK_MODEL = {"--num-layers": "4", "--hidden-size": "64", "--seq-length": "64"}
LAYOUTS = {  # label: (ranks, flags, stages p, virtual stages v)
    "pp 1 (1 rank)": (1, [], 1, 1),
    "1F1B pp 2": (2, ["--pipeline-model-parallel-size", "2"], 2, 1),
    "interleaved pp 2 x v 2": (
        2,
        ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"],
        2,
        2,
    ),
}


def model_flags(quick: bool):
    flags = list(MODEL)
    for name, value in (QUICK_MODEL if quick else {}).items():
        flags[flags.index(name) + 1] = value
    return flags


def run(label: str, micro_batches: int, iters: int, quick: bool) -> dict:
    ranks, layout, _, _ = LAYOUTS[label]
    global_batch = micro_batches * 2  # micro-batch 2, one pipeline
    flags = model_flags(quick) + layout + ["--global-batch-size", str(global_batch), "--train-iters", str(iters)]
    return run_worker("moezero", ["--warmup", "2", "--"] + flags, nproc=ranks, script="pipeline_worker.py")


def theory(p: int, v: int, m: int) -> float:
    return (p - 1) / (v * m + p - 1)


def table(micro_batches: int, results: dict) -> None:
    base = ok(results["pp 1 (1 rank)"])
    print(f"\n#### {micro_batches} micro-batches per step\n")
    print(
        "| layout | step (s) | speed-up vs pp 1 | bubble per stage | bubble measured (mean) | bubble theory "
        "| measured / theory |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, (_, _, p, v) in LAYOUTS.items():
        mine = ok(results[label])
        if not mine:
            print(f"| {label} | {error_of(results[label])} | | | | | |")
            continue
        speedups = [b["step_s"] / r["step_s"] for r, b in zip(mine, base)]
        bubbles = [statistics.mean(rank["bubble"] for rank in r["per_rank"]) for r in mine]
        expected = theory(p, v, micro_batches)
        ratio = spread([b / expected for b in bubbles], 2) if p > 1 else "-"
        stages = " / ".join(
            f"{statistics.median(r['per_rank'][k]['bubble'] for r in mine):.3f}"
            for k in range(len(mine[0]["per_rank"]))
        )
        print(
            f"| {label} | {spread([r['step_s'] for r in mine], 3)} | {spread(speedups, 2, 'x')} | {stages} | "
            f"{spread(bubbles, 3)} | {expected:.3f} | {ratio} |"
        )


def memory_table(results: dict) -> None:
    print("\n#### Memory per stage (the first micro-batch count's runs)\n")
    print("| layout | rank | params | share of pp 1's params | peak RSS (MB) | RSS above base (MB) | share of pp 1's |")
    print("|---|---|---|---|---|---|---|")
    base = ok(results["pp 1 (1 rank)"])
    if not base:
        return
    base_params = base[0]["per_rank"][0]["params"]
    base_above = statistics.median(r["per_rank"][0]["rss_mb"] - r["per_rank"][0]["base_mb"] for r in base)
    for label in LAYOUTS:
        mine = ok(results[label])
        if not mine:
            continue
        for rank in range(len(mine[0]["per_rank"])):
            above = statistics.median(r["per_rank"][rank]["rss_mb"] - r["per_rank"][rank]["base_mb"] for r in mine)
            peak = statistics.median(r["per_rank"][rank]["rss_mb"] for r in mine)
            params = mine[0]["per_rank"][rank]["params"]
            print(
                f"| {label} | {rank} | {params:,} | {params / base_params:.2f} | {peak:.0f} | {above:.0f} | "
                f"{above / base_above:.2f} |"
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batches", default="4,8")
    parser.add_argument("--iters", type=int, default=8, help="steps per run (the first 2 are not timed)")
    parser.add_argument("--quick", action="store_true", help="a smaller model, 1 round (a smoke run)")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    name_machine()
    first = True
    for m in (int(x) for x in args.micro_batches.split(",")):
        results = {label: [] for label in LAYOUTS}
        for index in range(rounds):
            order = list(LAYOUTS) if index % 2 == 0 else list(reversed(LAYOUTS))
            for label in order:
                result = run(label, m, args.iters, args.quick)
                results[label].append(result)
                status = result.get("error") or f"{result['step_s']:.3f} s/step"
                print(f"  m={m} round {index + 1}/{rounds}: {label:24s} {status}", file=sys.stderr, flush=True)
        table(m, results)
        if first:
            memory_table(results)
            first = False


if __name__ == "__main__":
    main()
