#!/usr/bin/env python
"""Host memory over a long run: does RSS stay flat after warm-up, and how does it compare to DeepSpeed?

    python tools/bench_memory.py [--steps 200] [--bf16-steps 200 with bf16 units, else 30]

GPT-MoE (4 layers, hidden 256, seq 128, micro-batch 4, E=8, k=2), 2 processes, ep 2, the same
fairness rules as bench_vs_peers.py. For every system: resident set (RSS) at a few steps and its
growth after warm-up, and, for moezero, where the bytes are: the optimizer's own accounting, the
heap in use (every live allocation) and the heap held free (holes: fragmentation). The "before"
row is moezero without its heap trimming (MOEZERO_KEEP_MALLOC=1): glibc's default behaviour, what
moezero did before moezero/training/host_memory.py.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

from rounds import name_machine  # noqa: E402
from runner import run_worker  # noqa: E402
from synthetic import bf16_native  # noqa: E402

MODEL = [
    "--layers",
    "4",
    "--hidden",
    "256",
    "--heads",
    "4",
    "--seq",
    "128",
    "--mb",
    "4",
    "--experts",
    "8",
    "--k",
    "2",
    "--vocab",
    "1024",
    "--ep",
    "2",
    "--warmup",
    "2",
]


def systems(dtype):
    out = [(f"moezero ZeRO-{s}", "moezero", ["--stage", str(s)], None) for s in (1, 2, 3)]
    out.append(("moezero ZeRO-2, before the allocator fix", "moezero", ["--stage", "2"], {"MOEZERO_KEEP_MALLOC": "1"}))
    out += [(f"DeepSpeed ZeRO-{s}", "deepspeed", ["--stage", str(s), "--no-overlap"], None) for s in (1, 2)]
    bf16 = ("moezero ZeRO-2", "DeepSpeed ZeRO-2")  # emulated bf16 GEMMs are slow on CPUs without bf16 units
    return out if dtype == "fp32" else [s for s in out if s[0] in bf16]


def report(dtype, steps):
    marks = [m for m in (10, 50, 100, 200) if m <= steps] or [steps]
    print(f"\n#### RSS per rank (MB), {dtype}, {steps} steps\n")
    print(
        "| system | " + " | ".join(f"step {m}" for m in marks) + " | growth after step 10 | heap in use | "
        "heap held free | optimizer's accounting |"
    )
    print("|---|" + "---|" * (len(marks) + 4))
    for label, system, extra, env in systems(dtype):
        r = run_worker(system, MODEL + extra + ["--steps", str(steps), "--dtype", dtype], env_extra=env)
        if "error" in r:
            print(f"| {label} | failed: {r['error']} |")
            continue
        memory = r["memory"]
        rss = [memory[m - 1]["rss_mb"] for m in marks]
        last = memory[-1]
        owned = r.get("optimizer_bytes")
        owned = f"{sum(owned.values()) / 2**20:.0f} MB" if owned else "n/a"
        print(
            f"| {label} | "
            + " | ".join(f"{v:.0f}" for v in rss)
            + f" | {last['rss_mb'] - memory[min(9, len(memory) - 1)]['rss_mb']:+.0f} | "
            f"{last['heap_used_mb']:.0f} | {last['heap_free_mb']:.0f} | {owned} |",
            flush=True,
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--bf16-steps",
        type=int,
        default=None,
        help="default: 200 where bf16 GEMMs are native, else 30 (emulated bf16 GEMMs take many times the fp32 time)",
    )
    args = p.parse_args()
    name_machine()
    if args.bf16_steps is None:
        args.bf16_steps = 200 if bf16_native() else 30
    report("fp32", args.steps)
    report("bf16", args.bf16_steps)


if __name__ == "__main__":
    main()
