#!/usr/bin/env python
"""Stage 3 against stage 2: what sharding the params costs per step, on 2 processes with ep 2.

    python tools/bench_stage3.py [--rounds 4] [--quick] [--min-unit-params N]

Both stages train the same GPT-MoE (moezero's benchmark worker, keyed init, the same data) in
alternating rounds; a ratio is the median over rounds of stage 3's step time over stage 2's from
the same round. Models: the end-to-end benchmark's GPT-MoE (hidden 256, fp32 and bf16) and a small one
(hidden 64, fp32) where the per-step host work of stage 3 weighs most.

The agreement records' cost is shown two ways: their messages' CPU timed apart, after training (messages
per step x CPU per message, over the step's CPU), and in the step itself: each round also runs stage 3
with the records sending no message (the worker's --no-agreement-messages, a measurement switch), and
the ratio of the two stage-3 steps is what the messages cost there (waits, wake-ups and cache included).
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

from rounds import alternate, error_of, name_machine, ok, spread  # noqa: E402
from runner import run_worker  # noqa: E402

MODELS = {  # name: worker flags
    "peer GPT-MoE hidden 256, fp32": [
        "--layers",
        "4",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--experts",
        "8",
        "--seq",
        "128",
        "--mb",
        "4",
        "--dtype",
        "fp32",
    ],
    "peer GPT-MoE hidden 256, bf16": [
        "--layers",
        "4",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--experts",
        "8",
        "--seq",
        "128",
        "--mb",
        "4",
        "--dtype",
        "bf16",
    ],
    "small GPT-MoE hidden 64, fp32": [
        "--layers",
        "4",
        "--hidden",
        "64",
        "--heads",
        "2",
        "--experts",
        "8",
        "--seq",
        "64",
        "--mb",
        "4",
        "--dtype",
        "fp32",
    ],
}


def stage_ratios(results) -> list:
    """Per round: stage 3's step time over stage 2's."""
    pairs = zip(results["stage 3"], results["stage 2"])
    return [s3["step_s"] / s2["step_s"] for s3, s2 in pairs if "error" not in s3 and "error" not in s2]


def quiet_ratios(results) -> list:
    """Per round: the step of stage 3 whose records send no message over stage 2's."""
    pairs = zip(results["stage 3, no messages"], results["stage 2"])
    return [quiet["step_s"] / s2["step_s"] for quiet, s2 in pairs if "error" not in quiet and "error" not in s2]


def in_step_ratios(results) -> list:
    """Per round: stage 3's step time over that of stage 3 whose records send no message."""
    pairs = zip(results["stage 3"], results["stage 3, no messages"])
    return [s3["step_s"] / quiet["step_s"] for s3, quiet in pairs if "error" not in s3 and "error" not in quiet]


def agreement_share(result) -> float:
    """The CPU a rank spends on agreement messages per step over the CPU of its whole step (every thread)."""
    step_cpu = statistics.median(
        m + o for m, o in zip(result["main_thread_cpu_s_per_rank"], result["other_threads_cpu_s_per_rank"])
    )
    return result["agreement_messages_per_step"] * result["agreement_message_cpu_s"] / step_cpu


def agreement_rows(name, results) -> list:
    """Per stage: messages per step, CPU per message, their share of the step's CPU (medians over rounds); for
    stage 3 also the step over the same step without messages."""
    rows = []
    for stage in (2, 3):
        runs = [r for r in ok(results[f"stage {stage}"]) if "agreement_message_cpu_s" in r]
        in_step = in_step_ratios(results) if stage == 3 else []
        if runs:
            rows.append(
                f"| {name} | {stage} | {spread([r['agreement_messages_per_step'] for r in runs])} | "
                f"{spread([1e3 * r['agreement_message_cpu_s'] for r in runs], 2)} | "
                f"{spread([100 * agreement_share(r) for r in runs], 1, '%')} | "
                f"{spread(in_step, 2, 'x') if in_step else ''} |"
            )
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--models", nargs="*", default=list(MODELS), help="a subset of: " + ", ".join(MODELS))
    p.add_argument("--quick", action="store_true", help="3 steps, 2 rounds, the small model (a smoke test)")
    p.add_argument(
        "--min-unit-params",
        type=int,
        default=100_000,
        help="stage 3's min_unit_params (the training script's --zero-min-unit-params; 0: every layer a unit)",
    )
    args = p.parse_args()
    name_machine()
    if args.quick:
        args.steps, args.rounds, args.models = 3, 2, ["small GPT-MoE hidden 64, fp32"]
    print("| model | stage 2 step (s) | stage 3 step (s) | stage 3 / stage 2 | the same, records sending no message |")
    print("|---|---|---|---|---|")
    agreement = []
    for name in args.models:
        common = MODELS[name] + [
            "--steps",
            str(args.steps),
            "--warmup",
            "2",
            "--ep",
            "2",
            "--min-unit-params",
            str(args.min_unit_params),
        ]
        systems = [(f"stage {s}", lambda s=s: run_worker("moezero", common + ["--stage", str(s)])) for s in (2, 3)]
        systems.append(
            (
                "stage 3, no messages",
                lambda: run_worker("moezero", common + ["--stage", "3", "--no-agreement-messages"]),
            )
        )
        results = alternate(systems, args.rounds, name)
        if not (ok(results["stage 2"]) and ok(results["stage 3"])):
            print(f"| {name} | failed: {(error_of(results['stage 2']) or error_of(results['stage 3']))[:100]} | | | |")
            continue
        steps = {s: spread([r["step_s"] for r in ok(results[f"stage {s}"])], 3) for s in (2, 3)}
        quiet = quiet_ratios(results)
        print(
            f"| {name} | {steps[2]} | {steps[3]} | {spread(stage_ratios(results), 2, 'x')} | "
            f"{spread(quiet, 2, 'x') if quiet else 'failed'} |",
            flush=True,
        )
        agreement += agreement_rows(name, results)
    print(
        "\nAgreement records (every rank states what it does before collectives that pair by order): messages "
        "per step, each one's CPU (every thread of a rank, timed after training on the same group), their "
        "share of the rank's step CPU, and the stage-3 step over the same step whose records send no message"
    )
    print(
        "| model | stage | messages per step | CPU per message (ms) | share of step CPU | "
        "step / step without messages |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(agreement))


if __name__ == "__main__":
    main()
