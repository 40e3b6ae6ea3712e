"""Alternating rounds and their spread: how every moezero benchmark reports a number.

These machines are shared and noisy, so systems run round by round, in alternating order, in one
process tree; a number is the median over rounds with its min-max, and a ratio between two
systems is the median of the per-round ratios (each round's pair ran back to back).
"""

import statistics
import sys
from typing import Callable, Dict, List, Sequence, Tuple

if __package__:  # imported as tools.bench.rounds, or with tools/bench on the path
    from .machine import describe
else:
    from machine import describe

System = Tuple[str, Callable[[], dict]]  # (label, run one configuration -> RESULT dict)
_named = [False]  # whether this process printed the machine line


def name_machine() -> None:
    """Print the machine line once per benchmark (before its first table: every figure holds for its CPU)."""
    if not _named[0]:
        print(f"Machine: {describe()}", flush=True)
        _named[0] = True


def alternate(systems: Sequence[System], rounds: int, name: str = "") -> Dict[str, List[dict]]:
    """Run every system once per round, in forward then reverse order; results by label."""
    results: Dict[str, List[dict]] = {label: [] for label, _ in systems}
    name_machine()
    for index in range(rounds):
        order = systems if index % 2 == 0 else list(reversed(systems))
        for label, run in order:
            result = run()
            results[label].append(result)
            status = (
                result.get("error")
                or f"{result.get('tokens_per_s', 0):.0f} tokens/s, {result.get('step_s', 0):.3f} s/step"
            )
            print(f"  {name} round {index + 1}/{rounds}: {label:38s} {status}", file=sys.stderr, flush=True)
    return results


def ok(results: List[dict]) -> List[dict]:
    return [r for r in results if "error" not in r]


def spread(values: Sequence[float], digits: int = 0, unit: str = "") -> str:
    """'median [min-max]' of the values."""
    if not values:
        return "n/a"
    f = f"{{:.{digits}f}}"
    med, lo, hi = statistics.median(values), min(values), max(values)
    if len(values) == 1:
        return f.format(med) + unit
    return f"{f.format(med)}{unit} [{f.format(lo)}-{f.format(hi)}]"


def ratios(results: List[dict], baseline: List[dict], key: str = "tokens_per_s") -> List[float]:
    """Per-round ratios of `key` (rounds where both ran)."""
    return [a[key] / b[key] for a, b in zip(results, baseline) if "error" not in a and "error" not in b]


def error_of(results: List[dict]) -> str:
    failed = [r["error"] for r in results if "error" in r]
    return failed[-1] if failed else ""


def versus_cells(ours: List[dict], theirs: List[dict], memory: Callable[[dict], float]) -> str:
    """The cells of a moezero-vs-peer row: tokens/s of each, the ratio, `memory` of a run for each, or the
    errors where either failed (each cell ends with '|')."""
    if not ok(ours) or not ok(theirs):
        return f" {error_of(ours) or 'ok'} | {error_of(theirs) or 'ok'} | | | |"
    return (
        f" {spread([r['tokens_per_s'] for r in ok(ours)])} | {spread([r['tokens_per_s'] for r in ok(theirs)])} | "
        f"{spread(ratios(ours, theirs), 2, 'x')} | {spread([memory(r) for r in ok(ours)])} | "
        f"{spread([memory(r) for r in ok(theirs)])} |"
    )
