"""The one argparse of the training script, generated from the config dataclasses.

Each config field declares its flag once (`moezero.config.option`); the argparse dest is
"<section>.<field>", so turning parsed arguments into configs is a loop with no renames.

Megatron's conventions: `@args.txt` reads flags from a file (whitespace-separated, `#` comments, any
number per line), and a bad command line costs one line: the error, a did-you-mean for a misspelled
flag, and "see --help" (no 80-line usage dump).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import shlex
import sys
import typing
from typing import Any, Dict, Iterable, List, Optional, Sequence, Type

from moezero.config import ConfigError
from moezero.training.megatron_flags import megatron_table


class ArgumentParser(argparse.ArgumentParser):
    """argparse with @file arguments and one-line errors; under torchrun only rank 0 prints them."""

    def __init__(self, **kwargs):
        kwargs.setdefault("usage", "%(prog)s [--flag value ...] [@flags.txt ...]")
        super().__init__(fromfile_prefix_chars="@", allow_abbrev=False, **kwargs)

    def convert_arg_line_to_args(self, arg_line: str) -> List[str]:
        return shlex.split(arg_line, comments=True)

    def error(self, message: str):
        if os.environ.get("RANK", "0") != "0":
            sys.exit(2)
        self.exit(2, f"{self.prog}: error: {self._explained(message)} (see --help)\n")

    def _explained(self, message: str) -> str:
        """Megatron-LM flags (or values) moezero lacks are named as such; a misspelling gets a did-you-mean."""
        choice = re.match(r"argument (--[\w-]+).*: invalid choice: '?([^' ]+)'?", message)
        if choice and choice[2] in [str(c) for c in megatron_table()["flags"].get(choice[1], {}).get("choices") or []]:
            return f"{choice[1]} {choice[2]}: not supported by moezero ({message.split('(', 1)[-1].rstrip(')')})"
        if not message.startswith("unrecognized arguments:"):
            return message
        megatron = megatron_table()["flags"]
        unsupported, unknown, owner_is_megatron = [], [], False
        for word in message.split(":", 1)[1].split():   # a value belongs to the flag before it
            if word.startswith("--"):
                owner_is_megatron = word.split("=", 1)[0] in megatron
                (unsupported if owner_is_megatron else unknown).append(word.split("=", 1)[0] if owner_is_megatron
                                                                       else word)
            elif not owner_is_megatron:
                unknown.append(word)
        parts = []
        if unsupported:
            parts.append(f"not supported by moezero: {', '.join(unsupported)} (Megatron-LM flags; see the README, "
                         "'Coming from Megatron-LM')")
        if unknown:
            parts.append(f"unrecognized arguments: {' '.join(unknown)}{self._did_you_mean(unknown)}")
        return "; ".join(parts)

    def _did_you_mean(self, words: List[str]) -> str:
        known = [s for s in self._option_string_actions if s.startswith("--")]
        hints = {}
        for word in words:
            flag = word.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75) if flag.startswith("--") else []
            if close:
                hints[flag] = close[0]
        if len(hints) == 1:
            return f"; did you mean {next(iter(hints.values()))}?"
        return f"; did you mean {', '.join(f'{v} (for {k})' for k, v in hints.items())}?" if hints else ""


class _Switch(argparse.BooleanOptionalAction):
    """--flag / --no-flag with the default in its help once (Python 3.10 appends one of its own)."""

    def __init__(self, *args, help: str = "", default: bool = False, **kwargs):
        super().__init__(*args, default=default, help=help, **kwargs)
        self.help = f"{help} (default: {'on' if default else 'off'})"


def _base_type(annotation: Any) -> Any:
    """int / float / str / bool from an annotation like Optional[int] (List[str]: str, each word's, with nargs)."""
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0]
    return annotation


def flag_fields(config_cls: Type) -> Iterable[tuple]:
    """(field, flag) of every field of `config_cls` that is on the command line."""
    for f in dataclasses.fields(config_cls):
        flag = f.metadata.get("flag", "")
        if flag is not None:
            yield f, flag or "--" + f.name.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: Type,
                         only: Optional[Sequence[str]] = None) -> None:
    """One argument per field that has a flag (or the fields named in `only`), in a group named after the config."""
    group = parser.add_argument_group(config_cls.__name__, (config_cls.__doc__ or "").strip().splitlines()[0])
    hints = typing.get_type_hints(config_cls)
    for f, flag in flag_fields(config_cls):
        if only is not None and f.name not in only:
            continue
        kind = _base_type(hints[f.name])
        dest = f"{config_cls.section}.{f.name}"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f.metadata.get("help", "")
        flags = (flag,) + tuple(f.metadata.get("aliases") or ())
        if kind is bool and (flag.startswith("--no-") or len(flags) > 1):
            # a negative switch (Megatron's --no-load-optim): on when given. As a --flag/--no-flag pair its own
            # name would read as the negation and set it off (argparse's BooleanOptionalAction)
            group.add_argument(*flags, dest=dest, action="store_true", default=default,
                               help=f"{help_text} (default: off)")
            continue
        if kind is bool:
            group.add_argument(flag, dest=dest, action=_Switch, default=default, help=help_text)
            continue
        if default is not None and "default" not in help_text:
            help_text += f" (default: {default})"
        metavar = None if f.metadata.get("choices") else flag.lstrip("-").replace("-", "_").upper()
        group.add_argument(*flags, dest=dest, type=f.metadata.get("parse") or kind, default=default,
                           choices=f.metadata.get("choices"), metavar=metavar, help=help_text,
                           nargs=f.metadata.get("nargs"))


def build_parser(config_classes: Sequence[Type], description: str) -> ArgumentParser:
    parser = ArgumentParser(description=description)
    for cls in config_classes:
        add_config_arguments(parser, cls)
    return parser


def configs_from_args(namespace: argparse.Namespace, config_classes: Sequence[Type]) -> Dict[str, Any]:
    """{section: config instance}; validation errors (ConfigError) name the flag."""
    values: Dict[str, Dict[str, Any]] = {cls.section: {} for cls in config_classes}
    for dest, value in vars(namespace).items():
        section, _, name = dest.partition(".")
        if section in values:
            values[section][name] = value
    for cls in config_classes:   # Megatron's reading of the command line, where a config alone cannot tell
        if hasattr(cls, "check_command_line"):
            cls.check_command_line(values[cls.section])
    return {cls.section: cls(**values[cls.section]) for cls in config_classes}


def flag_values(configs: Iterable[Any]) -> Dict[str, Any]:
    """{flag: value} of every command-line field of the given config objects (what a run was given)."""
    return {flag: getattr(cfg, f.name) for cfg in configs for f, flag in flag_fields(type(cfg))}


def parse_configs(argv: Optional[List[str]], config_classes: Sequence[Type], description: str) -> Dict[str, Any]:
    """Parse argv into configs; a bad value exits with one line naming the flag."""
    parser = build_parser(config_classes, description)
    namespace = parser.parse_args(argv)
    try:
        return configs_from_args(namespace, config_classes)
    except ConfigError as exc:
        parser.error(str(exc))
