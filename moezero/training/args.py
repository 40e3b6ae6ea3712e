"""The one argparse of the training script, generated from the config dataclasses.

Each config field declares its flag once (`moezero.config.option`); the argparse dest is
"<section>.<field>", so turning parsed arguments into configs is a loop with no renames.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import Any, Dict, List, Optional, Sequence, Type

from moezero.config import ConfigError


def _base_type(annotation: Any) -> Any:
    """int / float / str / bool from an annotation like Optional[int]."""
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: Type) -> None:
    """One argument per field that has a flag, in a group named after the config."""
    group = parser.add_argument_group(config_cls.__name__, (config_cls.__doc__ or "").strip().splitlines()[0])
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        flag = f.metadata.get("flag", "")
        if flag is None:
            continue
        flag = flag or "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        dest = f"{config_cls.section}.{f.name}"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f.metadata.get("help", "")
        if kind is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            group.add_argument(flag, dest=dest, type=kind, default=default, choices=f.metadata.get("choices"),
                               help=f"{help_text} (default: {default})")


def build_parser(config_classes: Sequence[Type], description: str) -> argparse.ArgumentParser:
    parser = _Rank0ArgumentParser(description=description, allow_abbrev=False)
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
    return {cls.section: cls(**values[cls.section]) for cls in config_classes}


class _Rank0ArgumentParser(argparse.ArgumentParser):
    """Under torchrun every rank parses the same flags; only rank 0 prints the usage error."""

    def error(self, message):
        if os.environ.get("RANK", "0") != "0":
            sys.exit(2)
        super().error(message)


def parse_configs(argv: Optional[List[str]], config_classes: Sequence[Type], description: str) -> Dict[str, Any]:
    """Parse argv into configs; a bad value exits with one line naming the flag (argparse's usage error)."""
    parser = build_parser(config_classes, description)
    namespace = parser.parse_args(argv)
    try:
        return configs_from_args(namespace, config_classes)
    except ConfigError as exc:
        parser.error(str(exc))
