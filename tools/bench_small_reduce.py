"""A short all-reduce on gloo: gloo's own against moezero's (an all-gather each rank reduces, small_reduce.py).

    python tools/bench_small_reduce.py [--rounds 5] [--ranks 2] [--calls 500]

Per size (an agreement message's 97 integers, a flag, StepTotals-sized float64 messages), alternating rounds
of `--calls` calls each on one process group: process CPU (every thread) and wall time per call on rank 0, and
moezero's over gloo's, median [min-max] over the rounds; moezero's on gloo (ranks on several hosts) and through
pipes (ranks on one host: the dp and control groups' short all-reduces, `local_channel.py`). Then, for the agreement
message, the all-gather it
travels as against point-to-point sends and receives with every peer (not used by moezero). Last, a whole
agreement message (`Agreement(...).check()`, records compared) on gloo, as between hosts, against the pipes
ranks on one host use (`local_channel.py`), the MoE layers' count exchange the same two ways, and their token
all-to-all on gloo against shared memory (`local_exchange.py`).
Docs: docs/benchmarks.md#small-reduce.
"""

import argparse
import os
import queue as queues
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from moezero.parallel import comm, local_channel, local_exchange  # noqa: E402
from moezero.parallel.local_transport import LocalTransport  # noqa: E402
from moezero.parallel.transport import release, serve, transport_of  # noqa: E402
from moezero.parallel.agreement import Agreement  # noqa: E402
from moezero.torch_internals import all_gather_single  # noqa: E402
from tools.bench.machine import describe  # noqa: E402
from tools.bench.rounds import spread  # noqa: E402

SIZES = [
    ("a flag (1 x float64)", 1, torch.float64),
    ("an agreement message (97 x int64)", 97, torch.int64),
    ("512 x float64", 512, torch.float64),
    ("4096 x float32", 4096, torch.float32),
]


def _per_call(run, calls, group):
    for _ in range(20):
        run()
    dist.barrier(group=group)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        run()
    return (time.process_time() - cpu) / calls * 1e3, (time.perf_counter() - wall) / calls * 1e3


def _alternate(systems, rounds, calls, group):
    """Each (name, run) of `systems` timed in `rounds` rounds, their order reversed every other round."""
    found = {name: [] for name, _ in systems}
    for index in range(rounds):
        for name, run in systems if index % 2 == 0 else list(reversed(systems)):
            found[name].append(_per_call(run, calls, group))
    return found


class _PointToPoint:
    """One message to every peer and from every peer (isend / irecv, a tag per message), checked as the agreement
    checks its all-gather: a gloo receive reports completion only once waited for, so a waiter thread waits and
    reports it (what `arrived()` needs)."""

    def __init__(self, group):
        self.group, self.tag = group, 0
        self.jobs = queues.SimpleQueue()
        threading.Thread(target=self._wait_forever, daemon=True).start()

    def _wait_forever(self):
        while True:
            works, done = self.jobs.get()
            for work in works:
                work.wait()
            done.set()

    def launch(self, mine, every):
        me, rows = dist.get_rank(self.group), every.view(dist.get_world_size(self.group), -1)
        rows[me].copy_(mine)
        peers = [p for p in range(len(rows)) if p != me]
        self.tag += 1
        works = [dist.irecv(rows[p], group=self.group, group_src=p, tag=self.tag) for p in peers]
        works += [dist.isend(mine, group=self.group, group_dst=p, tag=self.tag) for p in peers]
        done = threading.Event()
        self.jobs.put((works, done))
        return done


def _transports(group, world, rounds, calls):
    """An agreement message (97 x int64) as gloo's all-gather (moezero's) and as point-to-point messages."""
    mine = torch.ones(97, dtype=torch.int64)
    every = torch.empty(world * mine.numel(), dtype=torch.int64)
    p2p = _PointToPoint(group)
    systems = [
        ("all-gather", lambda: all_gather_single(every, mine, group=group, async_op=True).wait()),
        ("point-to-point", lambda: p2p.launch(mine, every).wait()),
    ]
    return _alternate(systems, rounds, calls, group)


def _agreement_transports(group, world, rounds, calls):
    """A whole agreement message (one record, checked) on gloo (`group`) and through a pipe channel."""
    piped = dist.new_group(list(range(world)))
    serve(piped, LocalTransport(piped, local_channel.connect(piped)))
    record = [1, 3, 5, 7, 0, 1]
    systems = [
        ("gloo", lambda: Agreement([record], group, str).check()),
        ("pipes", lambda: Agreement([record], piped, str).check()),
    ]
    found = _alternate(systems, rounds, calls, group)
    release(piped)
    return found


def _count_exchanges(group, piped, world, rounds, calls):
    """The MoE layer's count exchange (comm.launch_exchange_counts: each rank's row per expert-parallel peer, a
    record riding along) on gloo's all-to-all (ranks on several hosts) and through the pipes (one host)."""
    table = torch.arange(world * 10, dtype=torch.int64).view(world, 10)  # 4 local experts' counts + a record
    systems = [
        ("gloo", lambda: comm.launch_exchange_counts(table, group).wait()),
        ("pipes", lambda: comm.launch_exchange_counts(table, piped).wait()),
    ]
    return _alternate(systems, rounds, calls, group)


def _token_exchanges(group, piped, world, rounds, calls):
    """The MoE layer's token all-to-all (comm.launch_all_to_all: 256 rows of 256 bf16 to every rank) on gloo's
    all-to-all and through shared memory (local_exchange.py: ranks on one host)."""
    pipes = transport_of(piped).pipes
    rings = local_exchange.connect(piped, pipes)
    serve(piped, LocalTransport(piped, pipes, rings))
    rows = torch.randn(256 * world, 256).bfloat16()
    splits = [256] * world
    systems = [
        ("gloo", lambda: comm.launch_all_to_all(rows, splits, splits, group).wait()),
        ("shared memory", lambda: comm.launch_all_to_all(rows, splits, splits, piped).wait()),
    ]
    found = _alternate(systems, rounds, calls, group)
    if rings is not None:
        rings.close()
    return found


def _worker(rank, world, port, rounds, calls, queue):
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    piped = dist.new_group(list(range(world)))
    serve(piped, LocalTransport(piped, local_channel.connect(piped)))
    rows = []
    for label, numel, dtype in SIZES:
        x = torch.ones(numel, dtype=dtype)
        systems = [
            ("gloo", lambda: dist.all_reduce(x, group=group, op=dist.ReduceOp.MAX)),
            ("moezero", lambda: comm.all_reduce(x, group, op=dist.ReduceOp.MAX)),
            ("moezero, pipes", lambda: comm.all_reduce(x, piped, op=dist.ReduceOp.MAX)),
        ]
        rows.append((label, _alternate(systems, rounds, calls, group)))
    transports = _transports(group, world, rounds, calls)
    agreements = _agreement_transports(group, world, rounds, calls)
    counts = _count_exchanges(group, piped, world, rounds, calls)
    tokens = _token_exchanges(group, piped, world, rounds, calls)
    if rank == 0:
        queue.put((rows, transports, agreements, counts, tokens))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(args.ranks, 29000 + os.getpid() % 1000, args.rounds, args.calls, queue), nprocs=args.ranks)
    print(f"Machine: {describe()}")
    print(f"{args.ranks} ranks, {args.rounds} alternating rounds of {args.calls} MAX all-reduces; rank 0, ms per call")
    print("| message | gloo CPU | moezero CPU | moezero / gloo CPU | gloo wall | moezero wall | moezero / gloo wall |")
    print("|---|---|---|---|---|---|---|")
    rows, transports, agreements, counts, tokens = queue.get()
    for label, found in rows:
        print(_row(label, found["gloo"], found["moezero"]))
    print("\nThe same, ranks on one host: moezero's through pipes (local_channel.py) against gloo's own")
    print("| message | gloo CPU | pipes CPU | pipes / gloo CPU | gloo wall | pipes wall | pipes / gloo wall |")
    print("|---|---|---|---|---|---|---|")
    for label, found in rows:
        print(_row(label, found["gloo"], found["moezero, pipes"]))
    print("\nAn agreement message (97 x int64): gloo's all-gather (moezero's) against point-to-point messages")
    print(
        "| message | all-gather CPU | point-to-point CPU | p2p / all-gather CPU | all-gather wall | "
        "point-to-point wall | p2p / all-gather wall |"
    )
    print("|---|---|---|---|---|---|---|")
    print(_row("an agreement message (97 x int64)", transports["all-gather"], transports["point-to-point"]))
    print(
        "\nA whole agreement message (records compared): on gloo (ranks on several hosts) against the pipes (one host)"
    )
    print("| message | gloo CPU | pipes CPU | pipes / gloo CPU | gloo wall | pipes wall | pipes / gloo wall |")
    print("|---|---|---|---|---|---|---|")
    print(_row("Agreement([record]).check()", agreements["gloo"], agreements["pipes"]))
    print("\nThe MoE layers' count exchange (a rank x 10 int64 table): gloo's all-to-all against the pipes (one host)")
    print("| message | gloo CPU | pipes CPU | pipes / gloo CPU | gloo wall | pipes wall | pipes / gloo wall |")
    print("|---|---|---|---|---|---|---|")
    print(_row("comm.launch_exchange_counts(...).wait()", counts["gloo"], counts["pipes"]))
    print("\nThe MoE layers' token all-to-all (256 rows of 256 bf16 to every rank): gloo's against shared memory")
    print(
        "| message | gloo CPU | shared memory CPU | shm / gloo CPU | gloo wall | shared memory wall | shm / gloo wall |"
    )
    print("|---|---|---|---|---|---|---|")
    print(_row("comm.launch_all_to_all(...).wait()", tokens["gloo"], tokens["shared memory"]))


def _row(label, base, other):
    """A table row: CPU and wall per call of `base` and `other` (lists of (cpu, wall) per round), and ratios."""
    base_cpu, base_wall = zip(*base)
    other_cpu, other_wall = zip(*other)
    cpu_ratio = [o / b for o, b in zip(other_cpu, base_cpu)]
    wall_ratio = [o / b for o, b in zip(other_wall, base_wall)]
    return (
        f"| {label} | {spread(base_cpu, 2)} | {spread(other_cpu, 2)} | {spread(cpu_ratio, 2)}x | "
        f"{spread(base_wall, 2)} | {spread(other_wall, 2)} | {spread(wall_ratio, 2)}x |"
    )


if __name__ == "__main__":
    main()
