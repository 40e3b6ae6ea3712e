"""The generated parts of the docs site cannot drift from the code: docs/flags.md is what tools/flag_reference.py
writes from the flags' declarations and names every flag of the script's parser and of Megatron's; the charts of
docs/images are drawn from the benchmark tables they stand above; docs/api.md shows the public objects, each with
every argument of its signature described (a config's field by its flag's row)."""

import dataclasses
import glob
import importlib.util
import inspect
import os
import re
import sys

from moezero.recipe import CONFIG_CLASSES
from moezero.training.args import build_parser, flag_fields
from moezero.training.configs import DESCRIPTION
from moezero.training.megatron_flags import megatron_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(page: str) -> str:
    with open(os.path.join(REPO, "docs", page)) as f:
        return f.read()


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_flag_page_is_the_generators_output():
    assert _read("flags.md") == _tool("flag_reference").reference(), (
        "docs/flags.md is stale: python tools/flag_reference.py --output docs/flags.md"
    )


def _rows(page: str):
    """{flag: its row} of the page's tables (a row names its flags in its first cell)."""
    rows = {}
    for line in page.splitlines():
        cells = line.strip().split(" | ")
        if line.strip().startswith("| `"):
            for flag in re.findall(r"`(--[\w.-]+)`", cells[0]):
                rows[flag] = cells
    return rows


def test_every_flag_of_the_parser_and_of_megatrons_has_a_row():
    rows = _rows(_read("flags.md"))
    parser = build_parser(CONFIG_CLASSES, DESCRIPTION)
    ours = {s for action in parser._actions for s in action.option_strings if s.startswith("--")} - {"--help"}
    assert not sorted(ours - set(rows)), "flags of the script missing from docs/flags.md"
    assert not sorted(set(megatron_table()["flags"]) - set(rows) - {"--help"}), (
        "Megatron flags missing from docs/flags.md"
    )
    assert rows["--tp-comm-overlap"][4] == "refused"  # the script's checks refuse it whenever it is typed
    assert rows["--use-flash-attn"][4] == "accepted" and rows["--num-experts"][4] == "honoured"
    assert rows["--moe-router-score-function"][4] == "honoured; refused values: `sqrtsoftplus`"


def _described(doc: str) -> set:
    """The names of a Google-style docstring's Args / Attributes entries (`name:` or `name (type):`)."""
    return set(re.findall(r"^ {4,}\**(\w+)(?: \([^)]*\))?: ", doc or "", re.M))


def test_every_argument_of_the_api_pages_objects_is_described():
    """Each object docs/api.md shows: every argument of its signature is an entry of its docstring's Args (or,
    for a dataclass, Attributes); a config's fields with a flag are that flag's row of the flag reference."""
    import importlib

    shown = re.findall(r"^::: (moezero[\w.]+)\.(\w+)$", _read("api.md"), re.M)
    assert len(shown) >= 10
    flags = _rows(_read("flags.md"))
    objects = [getattr(importlib.import_module(module), name) for module, name in shown]
    from moezero.parallel import ParallelGroups

    missing = []
    for obj in objects + [ParallelGroups.build]:
        described = _described(obj.__doc__)
        for name in inspect.signature(obj).parameters:
            flag = _flag_of(obj, name)
            if name.startswith("_") or name in described or (flag and flag in flags):
                continue
            missing.append(f"{obj.__qualname__}({name})")
    assert not missing, f"describe in the docstring: {missing}"


def _flag_of(obj, name: str):
    """The command-line flag of a config's field (None: not a config field on the command line)."""
    if not (dataclasses.is_dataclass(obj) and hasattr(obj, "section")):
        return None
    return dict((f.name, flag) for f, flag in flag_fields(obj)).get(name)


def test_every_chart_reads_its_table_and_stands_above_it():
    """tools/docs_charts.py draws from benchmarks.md's tables (matplotlib is not needed to read them): each
    chart's tables are where it reads them, with its columns and a number in every cell drawn; each chart is
    shown on the page, and every image a page shows exists."""
    charts = _tool("docs_charts")
    page = _read("benchmarks.md")
    for chart in charts.CHARTS:
        for table in chart.tables:
            rows = table.rows(page)
            assert rows and all(v is not None for _, values in rows for v in values), (chart.image, table)
        assert f"](images/{chart.image})" in page, f"benchmarks.md does not show images/{chart.image}"
    for name in sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))):
        with open(name) as f:
            for image in re.findall(r"\]\((images/[^)]+)\)", f.read()):
                assert os.path.exists(os.path.join(REPO, "docs", image)), f"{name}: {image} (tools/docs_charts.py)"


def test_the_package_diagram_draws_real_imports_and_every_package():
    """The home page's Mermaid picture of the packages: each arrow is an import the source has (the graph
    tests/unit/test_architecture.py reads), and every package folder of moezero is a box, config aside (it sits
    below all of them, as the page says)."""
    from tests.unit.test_architecture import _graph

    block = re.search(r"^```mermaid\n(flowchart.*?)^```", _read("index.md"), re.S | re.M)
    assert block, "docs/index.md has no Mermaid flowchart of the packages"
    edges = re.findall(r"^\s*(\w+) --> (\w+)$", block[1], re.M)
    boxes = set(re.findall(r"^\s*(\w+)\[", block[1], re.M))
    graph = _graph()
    assert edges and not [e for e in edges if f"moezero.{e[1]}" not in graph.get(f"moezero.{e[0]}", ())], edges
    packages = {
        name
        for name in os.listdir(os.path.join(REPO, "moezero"))
        if os.path.exists(os.path.join(REPO, "moezero", name, "__init__.py"))
    }
    assert packages - {"config"} == boxes - {"recipe"} and {a for e in edges for a in e} <= boxes


def _prose_words_per_section(text):
    """{heading: words of prose under it} (code blocks, tables and indented collapsible blocks left out)."""
    words, heading, in_code = {}, "(top)", False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif re.match(r"#{1,6} ", line) and not in_code:
            heading = line
        elif not in_code and not line.startswith(("|", "    ")):
            words[heading] = words.get(heading, 0) + len(line.split())
    return words


def test_no_page_runs_on_for_more_than_about_800_words_without_a_heading():
    """A reader finds a section by the table of contents: every stretch of prose has a subheading within ~800
    words."""
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs")
    long = []
    for page in sorted(glob.glob(os.path.join(docs, "*.md"))):
        with open(page) as f:
            for heading, count in _prose_words_per_section(f.read()).items():
                if count > 850:
                    long.append(f"{os.path.basename(page)} {heading}: {count} words")
    assert not long, f"give these sections subheadings: {long}"
