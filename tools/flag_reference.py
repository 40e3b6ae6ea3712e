"""docs/flags.md, the reference of the training script's flags, written from their one declaration each: the
config fields' `option(...)` (moezero/config/, moezero/training/configs.py, megatron_flags.py) as the script's
parser builds them, and Megatron-LM's parser as recorded in moezero/training/assets/megatron_arguments.json.
tests/unit/test_docs_reference.py checks the committed page equals this output, so the page cannot drift:

    python tools/flag_reference.py --output docs/flags.md

A flag's status: honoured (moezero computes what it asks); accepted (a Megatron flag that picks an
implementation of the same numbers: its help says "accepted", ImplementationConfig's convention); refused (a
flag the script's checks refuse whenever it is given, or a Megatron flag or value the parser does not take).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import Any, Dict, List, Optional, Sequence
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moezero.config import ConfigError  # noqa: E402
from moezero.recipe import CONFIG_CLASSES, parse  # noqa: E402
from moezero.training.args import _base_type, build_parser, flag_fields  # noqa: E402
from moezero.training.configs import DESCRIPTION, validate  # noqa: E402
from moezero.training.megatron_flags import ImplementationConfig, megatron_table  # noqa: E402

SWITCHES = ("storetrue", "storefalse", "booleanoptional")
HEADER = """# Flag reference

<!-- Written by `python tools/flag_reference.py --output docs/flags.md` from the flags' declarations;
     tests/unit/test_docs_reference.py fails when this page and that output differ. -->

Every flag of `examples_moe/pretrain_gpt_moe.py`, one table per group as `--help` prints them, and the flags of
Megatron-LM's parser (megatron-core {version}) that moezero does not take. **Status**: *honoured*, moezero
computes what the flag asks; *accepted*, a Megatron flag that picks one of Megatron's implementations of the same
numbers (a fused kernel, a backend): the launch line runs unchanged and nothing changes; *refused*, the launch
stops with one line naming the flag and why. **Megatron** gives Megatron-LM's default where it differs from
moezero's ("required": Megatron has none and needs the flag), or says the flag is moezero's own. Switches are off
unless typed, as in Megatron, where the Default column does not say otherwise. How the flags map from a Megatron
launch script: [Coming from Megatron-LM](megatron.md).
"""


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def _value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) if value else "none"
    return f"`{value}`" if str(value) else '`""`'


def _type(field: dataclasses.Field, hint: Any) -> str:
    choices = field.metadata.get("choices")
    if choices:
        return "one of " + ", ".join(f"`{c}`" for c in choices)
    kind = _base_type(hint)
    name = "switch" if kind is bool else getattr(kind, "__name__", str(kind))
    return f"{name} ..." if field.metadata.get("nargs") else name


def _megatron_default(flag: str, default: Any, kind: Any, megatron: Dict[str, Dict]) -> str:
    theirs = megatron.get(flag)
    if theirs is None:
        return "moezero's own"
    if theirs["action"] in SWITCHES or kind is bool:
        return ""
    if theirs["default"] is None and default is not None:
        return "required"
    mine = list(default) if isinstance(default, tuple) else default
    return "" if mine == theirs["default"] else _value(theirs["default"])


def _refused_alone(flag: str) -> Optional[str]:
    """The line the script refuses a switch with when it is the only flag typed (None: taken). CUDA counts as
    absent, so the page is the same on any machine."""
    try:
        with mock.patch("torch.cuda.is_available", return_value=False):
            validate(parse([flag]), 1)
    except ConfigError as exc:
        return str(exc)
    return None


def _status(cls: type, field: dataclasses.Field, flag: str, kind: Any, megatron: Dict[str, Dict]) -> str:
    help_text = field.metadata.get("help", "")
    if cls is ImplementationConfig and help_text.startswith("accepted"):
        status = "accepted"
    elif cls is ImplementationConfig and kind is bool and not field.default and _refused_alone(flag):
        status = "refused"
    else:
        status = "honoured"
    ours = field.metadata.get("choices")
    theirs = (megatron.get(flag) or {}).get("choices")
    if ours and theirs:
        missing = [c for c in theirs if c not in [str(o) for o in ours] and c not in ours]
        if missing:
            status += "; refused values: " + ", ".join(f"`{c}`" for c in missing)
    return status


def _flags_cell(action: argparse.Action) -> str:
    return ", ".join(f"`{s}`" for s in action.option_strings)


def group_table(cls: type, actions: Dict[str, argparse.Action], megatron: Dict[str, Dict]) -> List[str]:
    hints = typing.get_type_hints(cls)
    title = (cls.__doc__ or "").strip().splitlines()[0]
    lines = [
        f"## {cls.__name__}",
        "",
        title,
        "",
        "| Flag | Type | Default | Megatron | Status | What it does |",
        "|---|---|---|---|---|---|",
    ]
    for field, flag in flag_fields(cls):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        kind = _base_type(hints[field.name])
        cells = [
            _flags_cell(actions[flag]),
            _type(field, hints[field.name]),
            _value(default),
            _megatron_default(flag, default, kind, megatron),
            _status(cls, field, flag, kind, megatron),
            _cell(field.metadata.get("help", "")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def refused_table(taken: Sequence[str], megatron: Dict[str, Dict]) -> List[str]:
    missing = sorted(set(megatron) - set(taken))
    lines = [
        "## Megatron-LM flags moezero refuses",
        "",
        f"The {len(missing)} flags of Megatron-LM's parser that moezero's does not take. Each stops the launch "
        "with one line, `--flag: not supported by moezero (a Megatron-LM flag; ...)`, not a did-you-mean.",
        "",
        '??? note "The table"',
        "",
        "    | Flag | Megatron's default |",
        "    |---|---|",
    ]
    for flag in missing:
        lines.append(f"    | `{flag}` | {_cell(_value(megatron[flag]['default']))} |")
    return lines + [""]


def reference() -> str:
    """The page's text."""
    table = megatron_table()
    megatron = table["flags"]
    parser = build_parser(CONFIG_CLASSES, DESCRIPTION)
    actions = {s: a for a in parser._actions for s in a.option_strings}
    lines = [HEADER.format(version=table["megatron_core"])]
    for cls in CONFIG_CLASSES:
        lines += group_table(cls, actions, megatron)
    lines += refused_table(list(actions), megatron)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="-", help="the page to write (default: standard output)")
    args = parser.parse_args(argv)
    text = reference()
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
