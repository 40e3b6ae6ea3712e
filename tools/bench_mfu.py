#!/usr/bin/env python
"""Model FLOPs utilisation (MFU) on this CPU: the FLOP/s a training run achieves against the GEMM peak.

    python tools/bench_mfu.py [--hidden 256,1024] [--dtype fp32,bf16] [--steps 10] [--rounds 3] [--quick]

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
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

import torch  # noqa: E402

from moezero.training.throughput import flops_per_batch, tflops_per_rank  # noqa: E402
from moezero_gpt import moezero_configs  # noqa: E402
from rounds import alternate, error_of, ok, spread  # noqa: E402
from runner import run_worker  # noqa: E402
from synthetic import common_parser, gemm_peak_flops, kernel_paths  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WORLD = 2
GEMM_STEPS = 3


def worker_args(hidden, dtype, steps):
    """The peer configuration of bench_vs_peers.py at width `hidden`."""
    return ["--layers", "4", "--hidden", str(hidden), "--heads", str(hidden // 64), "--seq", "128", "--mb", "4",
            "--experts", "8", "--k", "2", "--vocab", "1024", "--ep", "2", "--stage", "2", "--steps", str(steps),
            "--warmup", "2", "--dtype", dtype, "--bucket", "2000000", "--gemm-steps", str(GEMM_STEPS)]


def step_flops(argv):
    """Megatron's FLOPs of one step of the worker run with `argv` (the global batch: a micro-batch per rank)."""
    args, _ = common_parser().parse_known_args(argv)   # the worker's own flags (--gemm-steps) aside
    gpt, moe = moezero_configs(args)
    return flops_per_batch(gpt, moe, args.vocab, args.mb * WORLD)


def peak_gflops(dtypes, size):
    torch.set_num_threads(1)
    return {dtype: gemm_peak_flops(size, DTYPES[dtype]) / 1e9 for dtype in dtypes}


def print_cpu(paths):
    units = paths["bf16_units"]
    bf16 = f"native ({', '.join(units)})" if units else "emulated (no avx512_bf16 / amx_bf16)"
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()} kernels; bf16 GEMMs {bf16}; a bf16 torch.mm takes "
          f"{paths['bf16_gemm_slowdown']:.2f}x the fp32 time")


def print_table(configs, results, peaks, steps):
    print("\n| dtype | hidden | peak GFLOP/s per core | model GFLOP/s per rank | MFU | products' share | MFU ceiling "
          "| tokens/s | step (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (dtype, hidden), argv in configs.items():
        runs = ok(results[f"{dtype} h{hidden}"])
        if not runs:
            print(f"| {dtype} | {hidden} | {peaks[dtype]:.0f} | failed: {error_of(results[f'{dtype} h{hidden}'])} |")
            continue
        flops = step_flops(argv)
        rates = [tflops_per_rank(flops, r["step_s"], WORLD) * 1e3 for r in runs]
        products = [statistics.mean(r["matrix_product_s_per_rank"]) for r in runs]
        ceilings = [tflops_per_rank(flops, s, WORLD) * 1e3 / peaks[dtype] for s in products]
        print(f"| {dtype} | {hidden} | {peaks[dtype]:.0f} | {spread(rates)} | "
              f"{spread([rate / peaks[dtype] for rate in rates], 3)} | "
              f"{spread([s / r['step_s'] for s, r in zip(products, runs)], 2)} | {spread(ceilings, 3)} | "
              f"{spread([r['tokens_per_s'] for r in runs])} | {spread([r['step_s'] for r in runs], 3)} |")
    print(f"\n{steps} steps per run (the first 2 not timed), {WORLD} processes of one thread each; matrix-product "
          f"time from {GEMM_STEPS} more steps under torch.profiler, averaged over the ranks.")
    print_step_split(configs, results)


def ms(seconds):
    return spread([s * 1e3 for s in seconds])


def print_step_split(configs, results):
    """Each rank's step in ms: products, the main thread's other CPU time, the main thread off its core
    (waiting for a peer or a transfer, or waiting for a core), and the CPU of the other threads (gloo's)."""
    print("\n| dtype | hidden | step (ms) | products | other main-thread CPU | main thread off-CPU "
          "| other threads' CPU |")
    print("|---|---|---|---|---|---|---|")
    for (dtype, hidden) in configs:
        runs = [r for r in ok(results[f"{dtype} h{hidden}"]) if "main_thread_cpu_s_per_rank" in r]
        if not runs:
            continue
        main = [statistics.mean(r["main_thread_cpu_s_per_rank"]) for r in runs]
        products = [statistics.mean(r["matrix_product_s_per_rank"]) for r in runs]
        print(f"| {dtype} | {hidden} | {ms([r['step_s'] for r in runs])} | {ms(products)} | "
              f"{ms([m - p for m, p in zip(main, products)])} | "
              f"{ms([r['step_s'] - m for r, m in zip(runs, main)])} | "
              f"{ms([statistics.mean(r['other_threads_cpu_s_per_rank']) for r in runs])} |")
    print("\nMedians over the timed steps of each rank's thread CPU clocks (no profiler), averaged over the ranks; "
          "products from the profiled steps. Off-CPU: the main thread waits for a peer (the slower rank, a "
          "transfer) or for a core (two ranks and gloo's threads share the cores).")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", default="256", help="model widths, comma-separated (e.g. 256,1024)")
    p.add_argument("--dtype", default="fp32,bf16", help="dtypes, comma-separated: fp32, bf16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peak-size", type=int, default=2048, help="side of the square matrices of the peak GEMM")
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 steps, 1 round, a 1024 peak GEMM")
    args = p.parse_args()
    if args.quick:
        args.steps, args.rounds, args.peak_size = 4, 1, 1024
    dtypes = args.dtype.split(",")
    unknown = set(dtypes) - set(DTYPES)
    if unknown:
        p.error(f"--dtype {','.join(sorted(unknown))}: must be among {', '.join(DTYPES)}")
    print_cpu(kernel_paths())
    peaks = peak_gflops(dtypes, args.peak_size)
    configs = {(dtype, int(h)): worker_args(int(h), dtype, args.steps) for dtype in dtypes
               for h in args.hidden.split(",")}
    systems = [(f"{dtype} h{hidden}", lambda argv=argv: run_worker("moezero", argv))
               for (dtype, hidden), argv in configs.items()]
    print_table(configs, alternate(systems, args.rounds, "mfu"), peaks, args.steps)


if __name__ == "__main__":
    main()
