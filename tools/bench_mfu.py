#!/usr/bin/env python
"""Model FLOPs utilisation (MFU) on this CPU: the FLOP/s a training run achieves against the GEMM peak.

    python tools/bench_mfu.py [--hidden 256,1024] [--dtype fp32,bf16] [--steps 20] [--warmup 10] [--rounds 3]
                              [--micro-batches 1|2|4 [--overlap-moe-comm]] [--gloo-records] [--quick]

- Peak, per dtype: the best of a few torch.mm of two large square matrices on one thread, as each training
  process runs (OMP_NUM_THREADS=1), measured in this process while no training runs.
- Model FLOP/s per rank: Megatron's count of one step's FLOPs (moezero.training.throughput, what
  --log-throughput reports: every GEMM x 3 for forward and backward, active experts only, causal attention
  included) over the median step time of the peer GPT-MoE of bench_vs_peers.py (4 layers, seq 128,
  micro-batch 4, E=8 top-2, ZeRO-2, ep 2, 2 processes, the same worker), divided by the 2 ranks.
- MFU = model FLOP/s per rank / peak FLOP/s of one core. Rounds alternate the configurations; numbers are
  medians with [min-max].
- Where the rest goes: after the timed steps each run profiles a few more (torch.profiler) and reports the
  seconds per step each rank spends inside matrix-product kernels (mm, addmm, bmm; SDPA's fused attention).
  "products' share" is that time over the step; "MFU ceiling" is the MFU the run would have if everything
  else (softmax, GELU, norms, dispatch, waiting for the other rank, collectives, optimizer) took no time:
  the GEMMs' own efficiency at the model's shapes, measured in model FLOPs.
- Where each rank's step goes, from thread CPU clocks of the timed steps: the products, the rest of the main
  thread's CPU time, the main thread off its core (waiting for a peer or for a core), and the CPU time of the
  process's other threads (gloo's transport).
- What distributing costs: each configuration also runs one rank's share alone (one process, E / ep of the
  experts, its own micro-batch, no exchange: the same FLOPs per token and expert shapes), in the same rounds;
  its MFU is what a rank would reach without the other. With it, the busiest rank's expert rows over the mean
  (routing imbalance, which every other rank waits for at each MoE layer's all-to-all). The same lone share
  also runs as two processes started at once, each alone in its world: the 2-rank step over theirs is what
  distributing costs beyond sharing the host's cores, caches and memory.
- With --overlap-moe-comm, a third run per configuration: the 2 ranks with their micro-batches in interleaved
  pairs (--overlap-moe-expert-parallel-comm), against the same alone run.
- With --gloo-records, every 2-rank run also runs with the agreement records and the short all-reduces on
  gloo, as between ranks on several hosts, and a last table gives the step through pipes over that one.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

import torch  # noqa: E402

from moezero.training.throughput import flops_per_batch, tflops_per_rank  # noqa: E402
from moezero_gpt import moezero_configs  # noqa: E402
from rounds import alternate, error_of, name_machine, ok, ratios, spread  # noqa: E402
from runner import run_side_by_side, run_worker  # noqa: E402
from synthetic import common_parser, gemm_peak_flops, kernel_paths  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WORLD = 2
EXPERTS = 8
GEMM_STEPS = 3


def worker_args(hidden, dtype, steps, warmup, micro_batches=1, experts=EXPERTS, ep=WORLD):
    """The peer configuration of bench_vs_peers.py at width `hidden` (each rank's 4 sequences in `micro_batches`
    micro-batches); the first `warmup` steps not timed."""
    return [
        "--layers",
        "4",
        "--hidden",
        str(hidden),
        "--heads",
        str(hidden // 64),
        "--seq",
        "128",
        "--mb",
        "4",
        "--experts",
        str(experts),
        "--k",
        "2",
        "--vocab",
        "1024",
        "--ep",
        str(ep),
        "--stage",
        "2",
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--dtype",
        dtype,
        "--bucket",
        "2000000",
        "--gemm-steps",
        str(GEMM_STEPS),
        "--micro-batches",
        str(micro_batches),
    ]


def alone_args(hidden, dtype, steps, warmup, micro_batches=1):
    """One process doing one rank's share of the 2-rank run and nothing else: its micro-batches routed among its
    E / ep experts (the same expert sizes, top-k and so FLOPs per token), no other rank to exchange with."""
    return worker_args(hidden, dtype, steps, warmup, micro_batches, experts=EXPERTS // WORLD, ep=1)


# the runs of each (dtype, hidden): their name's suffix and what the tables call them
RUNS = {
    "": f"{WORLD} ranks",
    " overlapped": f"{WORLD} ranks, overlapped",
    " alone": "alone",
    " side by side": f"{WORLD} alone at once",
}


def step_flops(argv, world=WORLD):
    """Megatron's FLOPs of one step of the worker run with `argv` (the global batch: a micro-batch per rank)."""
    args, _ = common_parser().parse_known_args(argv)  # the worker's own flags (--gemm-steps) aside
    gpt, moe = moezero_configs(args)
    return flops_per_batch(gpt, moe, args.vocab, args.mb * world)


def model_gflops(runs, argv, world=WORLD):
    """Each run's model GFLOP/s per rank."""
    flops = step_flops(argv, world)
    return [tflops_per_rank(flops, r["step_s"], world) * 1e3 for r in runs]


def peak_gflops(dtypes, size):
    torch.set_num_threads(1)
    return {dtype: gemm_peak_flops(size, DTYPES[dtype]) / 1e9 for dtype in dtypes}


def print_cpu(paths):
    units = paths["bf16_units"]
    bf16 = f"native ({', '.join(units)})" if units else "emulated (no avx512_bf16 / amx_bf16)"
    print(
        f"CPU: {torch.backends.cpu.get_cpu_capability()} kernels; bf16 GEMMs {bf16}; a bf16 torch.mm takes "
        f"{paths['bf16_gemm_slowdown']:.2f}x the fp32 time"
    )


def print_table(configs, lone_configs, results, peaks, steps, warmup):
    print(
        "\n| dtype | hidden | peak GFLOP/s per core | model GFLOP/s per rank | MFU | products' share | MFU ceiling "
        "| tokens/s | step (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (dtype, hidden), argv in configs.items():
        runs = ok(results[f"{dtype} h{hidden}"])
        if not runs:
            print(f"| {dtype} | {hidden} | {peaks[dtype]:.0f} | failed: {error_of(results[f'{dtype} h{hidden}'])} |")
            continue
        flops = step_flops(argv)
        rates = model_gflops(runs, argv)
        products = [statistics.mean(r["matrix_product_s_per_rank"]) for r in runs]
        ceilings = [tflops_per_rank(flops, s, WORLD) * 1e3 / peaks[dtype] for s in products]
        print(
            f"| {dtype} | {hidden} | {peaks[dtype]:.0f} | {spread(rates)} | "
            f"{spread([rate / peaks[dtype] for rate in rates], 3)} | "
            f"{spread([s / r['step_s'] for s, r in zip(products, runs)], 2)} | {spread(ceilings, 3)} | "
            f"{spread([r['tokens_per_s'] for r in runs])} | {spread([r['step_s'] for r in runs], 3)} |"
        )
    print(
        f"\n{steps} steps per run (the first {warmup} not timed), {WORLD} processes of one thread each; "
        f"matrix-product time from {GEMM_STEPS} more steps under torch.profiler, averaged over the ranks."
    )
    print_step_split(configs, results)
    print_distribution_cost(configs, lone_configs, results, peaks)


def print_distribution_cost(configs, lone_configs, results, peaks):
    """The 2-rank run against one rank's share run alone: what distributing costs (the exchanges, waiting for the
    busiest rank's experts, sharing the cores with the other rank and gloo's threads), and that split in two by
    the lone share run twice at once: sharing the host, and the rest."""
    print(
        "\n| dtype | hidden | run | MFU, 2 ranks | MFU, one rank's share alone | step, 2 ranks / alone "
        f"| {WORLD} alone at once / alone | 2 ranks / {WORLD} alone at once | busiest rank's expert rows / mean |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (dtype, hidden), argv in configs.items():
        lone = results[f"{dtype} h{hidden} alone"]
        shared = results.get(f"{dtype} h{hidden} side by side", [])
        for suffix in ("", " overlapped"):
            runs = results.get(f"{dtype} h{hidden}{suffix}", [])
            if not ok(runs) or not ok(lone):
                continue
            mfu = [g / peaks[dtype] for g in model_gflops(ok(runs), argv)]
            lone_mfu = [g / peaks[dtype] for g in model_gflops(ok(lone), lone_configs[(dtype, hidden)], world=1)]
            print(
                f"| {dtype} | {hidden} | {RUNS[suffix]} | {spread(mfu, 3)} | {spread(lone_mfu, 3)} | "
                f"{spread(ratios(runs, lone, 'step_s'), 2)} | {spread(ratios(shared, lone, 'step_s'), 2)} | "
                f"{spread(ratios(runs, shared, 'step_s'), 2)} | "
                f"{spread([r['slowest_rank_expert_load'] for r in ok(runs)], 2)} |"
            )
    print(
        f"\nAlone: one process with {EXPERTS // WORLD} of the {EXPERTS} experts (a rank's share under ep "
        f"{WORLD}), its own micro-batch routed among them, no exchange (the same FLOPs per token). The expert "
        "rows: per MoE layer, the busiest rank's routed rows over the ranks' mean, averaged over the layers "
        "(medians over the timed steps); the other rank waits for that excess at the layer's all-to-all. "
        f"{WORLD} alone at once: {WORLD} such processes started together, each alone in its world (what sharing "
        "this host's cores, caches and memory costs without any exchange); step: the mean of theirs."
    )


def ms(seconds):
    return spread([s * 1e3 for s in seconds])


def print_step_split(configs, results):
    """Each rank's step in ms: products, the main thread's other CPU time, the main thread off its core
    (waiting for a peer or a transfer, or waiting for a core), and the CPU of the other threads (gloo's)."""
    print(
        "\n| dtype | hidden | run | step (ms) | products | other main-thread CPU | main thread off-CPU "
        "| other threads' CPU |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dtype, hidden in configs:
        for suffix, run in RUNS.items():
            runs = [r for r in ok(results.get(f"{dtype} h{hidden}{suffix}", [])) if "main_thread_cpu_s_per_rank" in r]
            if not runs:
                continue
            main = [statistics.mean(r["main_thread_cpu_s_per_rank"]) for r in runs]
            products = [statistics.mean(r["matrix_product_s_per_rank"]) for r in runs]
            print(
                f"| {dtype} | {hidden} | {run} | {ms([r['step_s'] for r in runs])} | {ms(products)} | "
                f"{ms([m - p for m, p in zip(main, products)])} | "
                f"{ms([max(0.0, r['step_s'] - m) for r, m in zip(runs, main)])} | "  # clocks' granularity
                f"{ms([statistics.mean(r['other_threads_cpu_s_per_rank']) for r in runs])} |"
            )
    print(
        "\nMedians over the timed steps of each rank's thread CPU clocks (no profiler), averaged over the ranks; "
        "products from the profiled steps. Off-CPU: the main thread waits for a peer (the slower rank, a "
        "transfer) or for a core (two ranks and gloo's threads share the cores)."
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", default="256", help="model widths, comma-separated (e.g. 256,1024)")
    p.add_argument("--dtype", default="fp32,bf16", help="dtypes, comma-separated: fp32, bf16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="steps not timed: a fresh router's first steps route much less evenly (the busiest rank's "
        "expert rows over the mean, bf16 hidden 256: 1.25 over steps 2-9, 1.11 over 10-19 and "
        "over 180-199)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peak-size", type=int, default=2048, help="side of the square matrices of the peak GEMM")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="each rank's 4 sequences per step in this many micro-batches (1, 2 or 4), in every run",
    )
    p.add_argument(
        "--overlap-moe-comm",
        action="store_true",
        help="also run the 2 ranks with their micro-batches "
        "in interleaved pairs (--overlap-moe-expert-parallel-comm; needs --micro-batches 2 or 4)",
    )
    p.add_argument(
        "--gloo-records",
        action="store_true",
        help="also run every 2-rank configuration with the "
        "agreement records and short all-reduces on gloo (as between hosts) and print the step ratio",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 steps (2 timed), 1 round, a 1024 peak GEMM")
    args = p.parse_args()
    name_machine()
    if args.micro_batches not in (1, 2, 4):
        p.error(f"--micro-batches {args.micro_batches}: must be 1, 2 or 4 (it splits 4 sequences)")
    if args.overlap_moe_comm and args.micro_batches == 1:
        p.error("--overlap-moe-comm: needs --micro-batches 2 or 4 (it interleaves pairs of micro-batches)")
    if args.quick:
        args.steps, args.warmup, args.rounds, args.peak_size = 4, 2, 1, 1024
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup {args.warmup}: must be at least 0 and below --steps ({args.steps})")
    dtypes = args.dtype.split(",")
    unknown = set(dtypes) - set(DTYPES)
    if unknown:
        p.error(f"--dtype {','.join(sorted(unknown))}: must be among {', '.join(DTYPES)}")
    print_cpu(kernel_paths())
    peaks = peak_gflops(dtypes, args.peak_size)
    configs = {
        (dtype, int(h)): worker_args(int(h), dtype, args.steps, args.warmup, args.micro_batches)
        for dtype in dtypes
        for h in args.hidden.split(",")
    }
    lone_configs = {
        (dtype, hidden): alone_args(hidden, dtype, args.steps, args.warmup, args.micro_batches)
        for dtype, hidden in configs
    }
    systems = []
    for (dtype, hidden), argv in configs.items():
        systems.append((f"{dtype} h{hidden}", lambda argv=argv: run_worker("moezero", argv)))
        if args.overlap_moe_comm:
            systems.append(
                (
                    f"{dtype} h{hidden} overlapped",
                    lambda argv=argv: run_worker("moezero", argv + ["--overlap-moe-comm"]),
                )
            )
        systems.append(
            (f"{dtype} h{hidden} alone", lambda a=lone_configs[(dtype, hidden)]: run_worker("moezero", a, nproc=1))
        )
        systems.append(
            (
                f"{dtype} h{hidden} side by side",
                lambda a=lone_configs[(dtype, hidden)]: run_side_by_side("moezero", a, copies=WORLD),
            )
        )
    if args.gloo_records:
        for label, run in [(label, run) for label, run in systems if _two_ranks(label)]:
            flags = ["--overlap-moe-comm"] if label.endswith("overlapped") else []
            argv = configs[_config_of(label)] + flags + ["--gloo-records"]
            systems.append((f"{label}, gloo records", lambda argv=argv: run_worker("moezero", argv)))
    results = alternate(systems, args.rounds, "mfu")
    print_table(configs, lone_configs, results, peaks, args.steps, args.warmup)
    if args.gloo_records:
        print_gloo_records(systems, results)


def _two_ranks(label):
    return not label.endswith(("alone", "side by side"))


def _config_of(label):
    dtype, hidden = label.split()[:2]
    return dtype, int(hidden[1:])


def print_gloo_records(systems, results):
    """The 2-rank step with the records and short all-reduces through pipes over the same on gloo, per round."""
    print("\n| run | step, pipes (ms) | step, gloo records (ms) | pipes / gloo records |")
    print("|---|---|---|---|")
    for label, _ in systems:
        if not _two_ranks(label) or label.endswith("gloo records"):
            continue
        pairs = [
            (a["step_s"], b["step_s"])
            for a, b in zip(results[label], results[f"{label}, gloo records"])
            if "error" not in a and "error" not in b
        ]
        if pairs:
            print(
                f"| {label} | {spread([1e3 * a for a, _ in pairs])} | {spread([1e3 * b for _, b in pairs])} | "
                f"{spread([a / b for a, b in pairs], 2)}x |"
            )


if __name__ == "__main__":
    main()
