"""The generated reference pages of the docs site cannot drift from the code: docs/flags.md is what
tools/flag_reference.py writes from the flags' declarations and names every flag of the script's parser and of
Megatron's; docs/api.md shows the public objects, each with every argument of its signature described."""

import importlib.util
import os
import re

from moezero.recipe import CONFIG_CLASSES
from moezero.training.args import build_parser
from moezero.training.configs import DESCRIPTION
from moezero.training.megatron_flags import megatron_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(page: str) -> str:
    with open(os.path.join(REPO, "docs", page)) as f:
        return f.read()


def _flag_reference():
    spec = importlib.util.spec_from_file_location("flag_reference", os.path.join(REPO, "tools", "flag_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_flag_page_is_the_generators_output():
    assert _read("flags.md") == _flag_reference().reference(), (
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
