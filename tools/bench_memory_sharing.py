#!/usr/bin/env python
"""What two ranks in lockstep pay for the host's memory: each memory-bound pass of a step alone and on 2 cores at once.

    python tools/bench_memory_sharing.py [--params 6.9] [--rounds 3] [--reps 15]

The ranks of one run reach the optimizer step (and every other pass over all params) at the same moment: the
collectives before it line them up. Two independent processes (bench_mfu's "2 alone at once") rarely do. This
runs the passes of a bf16 ZeRO step over `--params` million params, each a process of one thread, alone (the
other process waits) and on both processes at once (a barrier before every repetition), alternating rounds;
a bf16 GEMM is the compute-bound control. Median [min-max] over rounds of each round's median repetition.
Docs: docs/benchmarks.md#distribution.
"""

import argparse
import os
import queue
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from moezero import ops  # noqa: E402
from tools.bench.machine import describe  # noqa: E402
from tools.bench.rounds import spread  # noqa: E402


def passes(numel: int):
    """(name, callable) of a step's memory-bound passes over `numel` params, and the GEMM control."""
    master, grad = torch.randn(numel), torch.randn(numel)
    exp_avg, exp_avg_sq, count = torch.zeros(numel), torch.zeros(numel), torch.zeros(())
    param, bf16_grad = torch.empty(numel, dtype=torch.bfloat16), torch.randn(numel).bfloat16()
    a, b = torch.randn(512, 1024, dtype=torch.bfloat16), torch.randn(1024, 1024, dtype=torch.bfloat16)

    def adamw():
        torch._fused_adamw_(
            [master],
            [grad],
            [exp_avg],
            [exp_avg_sq],
            [],
            [count],
            lr=1e-4,
            beta1=0.9,
            beta2=0.95,
            weight_decay=0.1,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )

    return [
        ("fused AdamW (fp32 master, grad, 2 moments)", adamw),
        ("gradient staging (fp32 += bf16)", lambda: ops.flatten_into(grad, [bf16_grad], [0], 1.0, accumulate=True)),
        ("gradient norm (sum of squares)", lambda: ops.sum_of_squares([grad])),
        ("publishing cast (bf16 <- fp32)", lambda: param.copy_(master)),
        ("control: bf16 GEMM 512 x 1024 x 1024", lambda: torch.mm(a, b)),
    ]


def worker(rank, numel, reps, rounds, barrier, results):
    torch.set_num_threads(1)
    work = passes(numel)
    out = {}
    for index in range(rounds):
        modes = ("alone", "at once") if index % 2 == 0 else ("at once", "alone")
        for name, run in work:
            run()
            for mode in modes:
                times = []
                for _ in range(reps):
                    barrier.wait()
                    if mode == "alone" and rank == 1:
                        continue
                    start = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - start)
                if times:
                    out.setdefault((name, mode), []).append(statistics.median(times))
    results.put((rank, out))


def _collect(results, procs):
    """Each worker's (rank, timings); raises as soon as a worker died without sending them (no hang)."""
    got = []
    while len(got) < len(procs):
        try:
            got.append(results.get(timeout=5))
        except queue.Empty:
            dead = [proc for proc in procs if proc.exitcode not in (None, 0)]
            if dead:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"a worker exited with code {dead[0].exitcode} before reporting")
    return got


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=6.9, help="millions of params (6.9: bench_mfu's lone bf16 rank)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    if args.params <= 0 or args.rounds < 1 or args.reps < 1:
        p.error("--params, --rounds and --reps must be positive")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, int(args.params * 1e6), args.reps, args.rounds, barrier, results))
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    by_rank = dict(_collect(results, procs))
    for proc in procs:
        proc.join(timeout=60)
    print(f"Machine: {describe()}; {args.params:g}M params, {args.rounds} rounds of {args.reps} repetitions\n")
    print("| pass | alone (ms) | 2 processes at once (ms) | at once / alone |")
    print("|---|---|---|---|")
    alone = by_rank[0]
    for name in dict.fromkeys(name for name, _ in alone):
        solo = alone[(name, "alone")]
        both = [statistics.mean(pair) for pair in zip(by_rank[0][(name, "at once")], by_rank[1][(name, "at once")])]
        print(
            f"| {name} | {spread([s * 1e3 for s in solo], 2)} | {spread([b * 1e3 for b in both], 2)} | "
            f"{spread([b / s for b, s in zip(both, solo)], 2)}x |"
        )


if __name__ == "__main__":
    main()
