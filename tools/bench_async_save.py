#!/usr/bin/env python
"""What a checkpoint costs the training loop: --async-save against a blocking save and no save at all.

    python tools/bench_async_save.py [--rounds 3] [--steps 12] [--save-interval 3]

One process trains a GPT-MoE (4 layers, hidden 256, 8 experts, 4 micro-batches of 4 x 128 tokens per step) for
--steps steps on the built-in corpus, three ways in alternating rounds (this machine is noisy): no --save,
--save every --save-interval steps, and the same with --async-save. Printed: the median over rounds of the
wall time per step (ms), each saving run's extra time per save over the run without saving, and how long the
loop stood still per save (median over the saves after a run's first: a process's first background save also
starts DCP's writer; the wait for the last save before exit is in the extra time, not here). The CPU model is
named: a figure holds for the CPU it ran on.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from moezero.recipe import parse, pretraining  # noqa: E402
from tools.bench.machine import cpu_model  # noqa: E402

MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "128",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "16",
    "--num-experts",
    "8",
    "--moe-router-topk",
    "2",
    "--lr",
    "1e-3",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--log-interval",
    "1000",
    "--eval-interval",
    "0",
    "--num-workers",
    "0",
]


def timed_run(steps: int, cache: str, save_flags):
    """(seconds of run.train() for `steps` steps, build excluded; seconds the loop stood in each save call)."""
    run = pretraining(parse(MODEL + ["--train-iters", str(steps), "--data-cache-path", cache] + save_flags))
    stood, save = [], run._save

    def timed_save():
        start = time.perf_counter()
        save()
        stood.append(time.perf_counter() - start)

    run._save = timed_save
    start = time.perf_counter()
    run.train()
    elapsed = time.perf_counter() - start
    run.groups.destroy()
    return elapsed, stood


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-interval", type=int, default=3)
    args = parser.parse_args()
    saves = args.steps // args.save_interval
    times = {"no save": [], "blocking save": [], "--async-save": []}
    stood = {label: [] for label in times}
    with tempfile.TemporaryDirectory() as cache:
        timed_run(2, cache, [])  # the corpus and dataset indices, built once
        for round_ in range(args.rounds):
            for label in times:
                flags = (
                    []
                    if label == "no save"
                    else [
                        "--save",
                        os.path.join(cache, f"ckpt{round_}{len(label)}"),
                        "--save-interval",
                        str(args.save_interval),
                    ]
                )
                elapsed, stops = timed_run(args.steps, cache, flags + (["--async-save"] if "async" in label else []))
                times[label].append(elapsed)
                stood[label] += stops[1:]
    base = statistics.median(times["no save"])
    print(f"\n{cpu_model()}, 1 process, {args.steps} steps, {saves} saves, median of {args.rounds} rounds\n")
    print("| run | ms per step | extra ms per save | loop stands still per save (ms) |")
    print("|---|---|---|---|")
    extra, still = {}, {}
    for label, values in times.items():
        median = statistics.median(values)
        extra[label] = (median - base) * 1000 / saves
        still[label] = statistics.median(stood[label]) * 1000 if stood[label] else 0.0
        cells = (
            ["", ""]
            if label == "no save"
            else [f"{extra[label]:.1f}", f"{still[label]:.1f}" if stood[label] else "(one save: none after the first)"]
        )
        print(f"| {label} | {median * 1000 / args.steps:.1f} | {cells[0]} | {cells[1]} |")
    if extra["blocking save"] > 0 and still["blocking save"] > 0:
        print(
            f"\nasync / blocking: extra time per save {extra['--async-save'] / extra['blocking save']:.2f}, "
            f"standing still per save {still['--async-save'] / still['blocking save']:.2f}"
        )


if __name__ == "__main__":
    main()
