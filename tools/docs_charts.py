"""The charts of the docs site, drawn from measurements already in the repo: the tables of docs/benchmarks.md
(each chart above the table it draws) and the demo's loss curve from the TensorBoard events `make train` writes.
Each chart names the CPU and the command of its measurements. SVG, text kept as text, no timestamps: a chart
redrawn from the same table is the same file.

matplotlib is a docs tool, not a requirement of moezero:

    .venv/bin/pip install matplotlib
    make train   # once, for the loss curve (runs/gpt_moe_small)
    PYTHONPATH=. .venv/bin/python tools/docs_charts.py

Redraw after changing a table that a chart draws (tests/unit/test_docs_reference.py checks every chart's
table is still where the chart reads it, with the columns it reads).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO, "docs", "benchmarks.md")
IMAGES = os.path.join(REPO, "docs", "images")
EVENTS = os.path.join(REPO, "runs", "gpt_moe_small")
NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


# ---- the tables of benchmarks.md ------------------------------------------------------------------------


def section(text: str, anchor: str) -> str:
    """The text under the heading `{#anchor}`, to the next heading."""
    match = re.search(rf"^#+ .*\{{#{re.escape(anchor)}\}}\n(.*?)(?=^#)", text + "\n#", re.S | re.M)
    if not match:
        raise KeyError(f"docs/benchmarks.md has no section {{#{anchor}}}")
    return match[1]


def tables(text: str) -> List[List[List[str]]]:
    """The Markdown tables of `text`, each a list of rows of cells, the header row first (no separator)."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.lstrip().startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
            if not all(re.fullmatch(r"-+", c) for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found


def value(cell: str) -> Optional[Tuple[float, float, float]]:
    """(median, min, max) of a cell like `1.75x [1.63-1.78]` or `**3274** [3210-3371]` (None: no number)."""
    numbers = [float(n.replace(",", "")) for n in NUMBER.findall(cell.replace("**", ""))]
    if not numbers:
        return None
    spread = re.search(r"\[([\d.,]+)-([\d.,]+)\]", cell)
    low, high = (float(spread[1].replace(",", "")), float(spread[2].replace(",", ""))) if spread else (numbers[0],) * 2
    return numbers[0], low, high


@dataclass
class Table:
    """One table of a benchmarks.md section, the columns a chart reads by their header."""

    anchor: str
    index: int  # the section's n-th table
    label: Sequence[str]  # header(s) of the columns naming a row (an empty cell repeats the row above's)
    columns: Sequence[str]  # headers of the columns drawn
    keep: str = ""  # only rows whose label matches this regular expression
    name: str = ""  # the panel's (or series') name

    def rows(self, text: str) -> List[Tuple[str, List[Optional[Tuple[float, float, float]]]]]:
        found = tables(section(text, self.anchor))
        if self.index >= len(found):
            raise KeyError(f"{{#{self.anchor}}}: no table {self.index}")
        header, *body = found[self.index]
        missing = [h for h in [*self.label, *self.columns] if h not in header]
        if missing:
            raise KeyError(f"{{#{self.anchor}}} table {self.index}: no column {missing} in {header}")
        rows, previous = [], {}
        for cells in body:
            names = []
            for h in self.label:
                cell = cells[header.index(h)] or previous.get(h, "")
                previous[h] = cell
                names.append(cell.replace("`", "").replace("**", ""))
            label = ", ".join(n for n in names if n)
            if re.search(self.keep, label):
                rows.append((label, [value(cells[header.index(c)]) for c in self.columns]))
        return rows


@dataclass
class Chart:
    """A chart: horizontal bars of one column per table (a panel each), or lines (x: the label column)."""

    image: str
    title: str
    caption: str  # the CPU and the command
    tables: Sequence[Table]
    kind: str = "bars"
    xlabel: str = ""
    reference: Optional[float] = None  # a vertical line (1.0: parity)
    extra: Dict[str, str] = field(default_factory=dict)


E2E = "python tools/bench_vs_peers.py [--large] --rounds 3"
CHARTS = [
    Chart(
        "summary.svg",
        "moezero's tokens/s over DeepSpeed-MoE's, end to end (ZeRO-2, 2 ranks)",
        f"median and [min-max] of alternating rounds; three CPUs, one per panel - {E2E}",
        [
            Table("end-to-end", 0, ["system"], ["vs DeepSpeed (same ep)"], "^moezero ZeRO", "AMD EPYC, AVX-512 BF16"),
            Table("end-to-end", 1, ["system"], ["vs DeepSpeed"], "^moezero", "AMD EPYC, AVX-512 BF16 (bf16)"),
            Table("end-to-end", 3, ["system"], ["vs DeepSpeed (same ep)"], "^moezero ZeRO", "AMD EPYC Zen 5"),
            Table("end-to-end", 4, ["system"], ["vs DeepSpeed"], "^moezero", "AMD EPYC, AVX2 (hidden 1024)"),
        ],
        xlabel="moezero / DeepSpeed tokens/s",
        reference=1.0,
    ),
    Chart(
        "growth.svg",
        "moezero's tokens/s over DeepSpeed-MoE's as the model grows",
        "Intel Xeon, AMX-BF16; ZeRO-2, ep 2 - python tools/bench_growth.py --rounds 2",
        [Table("growth", 0, ["size", "dtype"], ["moezero vs DeepSpeed"])],
        xlabel="moezero / DeepSpeed tokens/s",
        reference=1.0,
    ),
    Chart(
        "stage3.svg",
        "Stage-3 step time over stage 2's (the script's default units)",
        "2 ranks, ep 2; the CPU in each row - python tools/bench_stage3.py --rounds 5",
        [
            Table(
                "stage3",
                0,
                ["model (2 ranks, ep 2)", "CPU"],
                ["layers under 100,000 params with the root (the script's default)"],
            )
        ],
        xlabel="stage 3 / stage 2 step time",
        reference=1.0,
    ),
    Chart(
        "optimizer.svg",
        "The data-parallel optimizer alone: step time (moezero's model on every side)",
        "AMD EPYC, AVX2, fp32, 2 ranks - python tools/bench_zero.py",
        [
            Table("optimizer", 0, ["system"], ["step time (s)"], r"^(?!DeepSpeed stage 3)", "GPT-MoE, hidden 256"),
            Table("optimizer", 1, ["system"], ["step time (s)"], "", "dense GPT ~30M"),
        ],
        xlabel="step time (s), lower is faster",
    ),
    Chart(
        "moe_layer.svg",
        "One MoE layer, forward + backward: tokens/s per process",
        "AMD EPYC, AVX2, fp32, E=8 top-2 - python tools/bench_moe_layer.py",
        [Table("moe-layer", 0, ["routing", "layer"], ["tokens/s per process"])],
        xlabel="tokens/s per process",
    ),
    Chart(
        "scaling.svg",
        "Tokens/s as the expert count grows (the same active FLOPs)",
        "AMD EPYC, AVX2, fp32, ZeRO-2, ep 2 - python tools/bench_scaling.py",
        [Table("scaling", 0, ["experts"], ["moezero tokens/s", "DeepSpeed tokens/s"])],
        kind="lines",
        xlabel="experts",
        extra={"ylabel": "tokens/s", "xscale": "log"},
    ),
    Chart(
        "memory.svg",
        "Host memory (RSS per rank) over 200 steps",
        "ep 2; the CPU in each panel - python tools/bench_memory.py --steps 10 --bf16-steps 200",
        [
            Table(
                "memory",
                0,
                ["system"],
                ["step 10", "step 50", "step 100", "step 200"],
                "",
                "bf16, AMD EPYC, AVX-512 BF16",
            ),
            Table("memory", 1, ["system"], ["step 10", "step 50", "step 100", "step 200"], "", "fp32, AMD EPYC, AVX2"),
        ],
        kind="steps",
        xlabel="step",
        extra={"ylabel": "RSS per rank (MB)"},
    ),
]


# ---- drawing ------------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "moezero", "font.size": 9})
    import matplotlib.pyplot as plt

    return plt


def _save(fig, chart_title: str, caption: str, path: str) -> None:
    fig.suptitle(chart_title, fontsize=10, fontweight="bold")
    fig.text(0.01, 0.005, caption, fontsize=7.5, color="#555555", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, metadata={"Date": None})


def _colors(rows) -> List[str]:
    """moezero's rows blue, the others' grey (all blue where no row names a system)."""
    if not any("moezero" in label for label, _ in rows):
        return ["#3f7fbf"] * len(rows)
    return ["#3f7fbf" if "moezero" in label else "#a0a0a0" for label, _ in rows]


def draw_bars(plt, chart: Chart, text: str, path: str) -> None:
    panels = [(t, t.rows(text)) for t in chart.tables]
    heights = [max(len(rows), 1) * 0.32 + 0.6 for _, rows in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, sum(heights) + 0.9), height_ratios=heights, squeeze=False)
    for ax, (table, rows) in zip(axes[:, 0], panels):
        rows = [(label, v[0]) for label, v in rows if v[0] is not None][::-1]
        medians = [v[0] for _, v in rows]
        errors = [[m - v[1] for m, (_, v) in zip(medians, rows)], [v[2] - m for m, (_, v) in zip(medians, rows)]]
        ax.barh(range(len(rows)), medians, xerr=errors, color=_colors(rows), ecolor="#333333", capsize=2, height=0.6)
        ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
        for y, (_, (median, _, high)) in enumerate(rows):
            ax.text(high, y, f"  {median:g}", va="center", ha="left", fontsize=7.5)
        if chart.reference is not None:
            ax.axvline(chart.reference, color="#bf3f3f", linewidth=0.8)
        ax.set_title(table.name, fontsize=8.5, loc="left")
        ax.margins(x=0.12)
    axes[-1, 0].set_xlabel(chart.xlabel)
    _save(fig, chart.title, chart.caption, path)


def draw_lines(plt, chart: Chart, text: str, path: str) -> None:
    """One line per column, x the label (a number)."""
    table = chart.tables[0]
    rows = table.rows(text)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    xs = [float(label) for label, _ in rows]
    for i, name in enumerate(table.columns):
        ys = [v[i] for _, v in rows]
        ax.errorbar(
            xs,
            [y[0] for y in ys],
            yerr=[[y[0] - y[1] for y in ys], [y[2] - y[0] for y in ys]],
            marker="o",
            capsize=2,
            label=name,
        )
    ax.set_xscale(chart.extra.get("xscale", "linear"), base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel(chart.xlabel)
    ax.set_ylabel(chart.extra.get("ylabel", ""))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, chart.title, chart.caption, path)


def draw_steps(plt, chart: Chart, text: str, path: str) -> None:
    """One panel per table, a line per row over the columns (steps)."""
    fig, axes = plt.subplots(1, len(chart.tables), figsize=(8, 3.4), squeeze=False)
    for ax, table in zip(axes[0], chart.tables):
        steps = [float(NUMBER.search(c)[0]) for c in table.columns]
        for label, values in table.rows(text):
            ax.plot(steps, [v[0] for v in values], marker="o", label=label)
        ax.set_title(table.name, fontsize=8.5, loc="left")
        ax.set_xlabel(chart.xlabel)
        ax.set_ylabel(chart.extra.get("ylabel", ""))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    _save(fig, chart.title, chart.caption, path)


def this_cpu() -> str:
    """This machine's CPU as the benchmarks name it (model, bf16 units)."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench.machine import bf16_units, cpu_model

    units = ", ".join(u.replace("_", "-").upper() for u in bf16_units()) or "bf16 emulated"
    return f"{cpu_model()}, {units}"


def draw_loss(plt, events: str, cpu: str, path: str) -> None:
    """The lm loss of `make train`, training and validation, from its TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: Dict[str, List[Tuple[int, float]]] = {}
    for file in sorted(glob.glob(os.path.join(events, "events.out.tfevents.*"))):
        accumulator = EventAccumulator(file)
        accumulator.Reload()
        for tag in ("lm loss", "lm loss validation"):
            if tag in accumulator.Tags()["scalars"]:
                series.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    if "lm loss" not in series:
        raise SystemExit(f"--events {events}: no 'lm loss' in its TensorBoard files (run `make train` first)")
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for tag, points in series.items():
        steps, losses = zip(*sorted(dict(points).items()))
        ax.plot(steps, losses, marker="o" if "validation" in tag else None, label=tag)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(
        fig,
        "make train: a small GPT-MoE on 2 CPU processes (ep 2, ZeRO-2)",
        f"{cpu}, fp32, 200 iterations - make train (its TensorBoard files in runs/gpt_moe_small)",
        path,
    )


DRAW = {"bars": draw_bars, "lines": draw_lines, "steps": draw_steps}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", default=EVENTS, help="make train's TensorBoard folder (the loss curve)")
    parser.add_argument("--cpu", default=None, help="the CPU that ran make train (default: this machine's)")
    parser.add_argument("--output", default=IMAGES, help="the folder the charts are written to")
    args = parser.parse_args(argv)
    plt = _pyplot()
    os.makedirs(args.output, exist_ok=True)
    with open(BENCHMARKS) as f:
        text = f.read()
    for chart in CHARTS:
        DRAW[chart.kind](plt, chart, text, os.path.join(args.output, chart.image))
        plt.close("all")
    draw_loss(plt, args.events, args.cpu or this_cpu(), os.path.join(args.output, "loss.svg"))


if __name__ == "__main__":
    main()
