"""A short all-reduce on gloo: gloo's own against moezero's (an all-gather each rank reduces, small_reduce.py).

    python tools/bench_small_reduce.py [--rounds 5] [--ranks 2] [--calls 500]

Per size (an agreement message's 97 integers, a flag, StepTotals-sized float64 messages), alternating rounds
of `--calls` calls each on one process group: process CPU (every thread) and wall time per call on rank 0, and
moezero's over gloo's, median [min-max] over the rounds. Docs: docs/benchmarks.md#small-reduce.
"""
import argparse
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from moezero.parallel import comm   # noqa: E402
from tools.bench.rounds import spread   # noqa: E402

SIZES = [("a flag (1 x float64)", 1, torch.float64), ("an agreement message (97 x int64)", 97, torch.int64),
         ("512 x float64", 512, torch.float64), ("4096 x float32", 4096, torch.float32)]


def _per_call(run, calls, group):
    for _ in range(20):
        run()
    dist.barrier(group=group)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        run()
    return (time.process_time() - cpu) / calls * 1e3, (time.perf_counter() - wall) / calls * 1e3


def _worker(rank, world, port, rounds, calls, queue):
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    rows = []
    for label, numel, dtype in SIZES:
        x = torch.ones(numel, dtype=dtype)
        systems = [("gloo", lambda: dist.all_reduce(x, group=group, op=dist.ReduceOp.MAX)),
                   ("moezero", lambda: comm.all_reduce(x, group, op=dist.ReduceOp.MAX))]
        found = {name: [] for name, _ in systems}
        for index in range(rounds):
            for name, run in systems if index % 2 == 0 else list(reversed(systems)):
                found[name].append(_per_call(run, calls, group))
        rows.append((label, found))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(args.ranks, 29000 + os.getpid() % 1000, args.rounds, args.calls, queue),
             nprocs=args.ranks)
    print(f"{args.ranks} ranks, {args.rounds} alternating rounds of {args.calls} MAX all-reduces; rank 0, ms per call")
    print("| message | gloo CPU | moezero CPU | moezero / gloo CPU | gloo wall | moezero wall | moezero / gloo wall |")
    print("|---|---|---|---|---|---|---|")
    for label, found in queue.get():
        gloo_cpu, gloo_wall = zip(*found["gloo"])
        ours_cpu, ours_wall = zip(*found["moezero"])
        cpu_ratio = [o / g for o, g in zip(ours_cpu, gloo_cpu)]
        wall_ratio = [o / g for o, g in zip(ours_wall, gloo_wall)]
        print(f"| {label} | {spread(gloo_cpu, 2)} | {spread(ours_cpu, 2)} | {spread(cpu_ratio, 2)}x | "
              f"{spread(gloo_wall, 2)} | {spread(ours_wall, 2)} | {spread(wall_ratio, 2)}x |")


if __name__ == "__main__":
    main()
