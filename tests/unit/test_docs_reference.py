"""The generated reference pages of the docs site cannot drift from the code: docs/flags.md is what
tools/flag_reference.py writes from the flags' declarations and names every flag of the script's parser and of
Megatron's; docs/api.md shows the public objects, each with every argument of its signature described (a config's field
by its flag's row)."""

import dataclasses
import importlib.util
import inspect
import os
import re

from moezero.recipe import CONFIG_CLASSES
from moezero.training.args import build_parser, flag_fields
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
