"""The one argparse of the training script, generated from the config dataclasses.

Each config field declares its flag once (`moezero.config.option`); the argparse dest is
"<section>.<field>", so turning parsed arguments into configs is a loop with no renames.

Megatron's conventions: `@args.txt` reads flags from a file (whitespace-separated, `#` comments, any
number per line), and a bad command line costs one line per problem, all of them at once: the error, a
did-you-mean for a misspelled flag, and "see --help" (no 80-line usage dump).
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
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Type

from moezero.config import ConfigError
from moezero.config.options import problem_lines
from moezero.training.megatron_flags import megatron_table


_BAD = object()  # a value argparse could not read (its problem is recorded)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with @file arguments and errors that list every bad flag and value of a command line at once,
    one line each (argparse stops at the first); under torchrun only rank 0 prints them."""

    def __init__(self, **kwargs):
        kwargs.setdefault("usage", "%(prog)s [--flag value ...] [@flags.txt ...]")
        super().__init__(fromfile_prefix_chars="@", allow_abbrev=False, **kwargs)
        self._problems: Optional[List[str]] = None
        self._outside_choices: set = set()

    def convert_arg_line_to_args(self, arg_line: str) -> List[str]:
        return shlex.split(arg_line, comments=True)

    def parse_args(self, args=None, namespace=None):
        namespace, problems = self.parse_with_problems(args, namespace)
        self.fail(problems)
        return namespace

    def parse_with_problems(self, args=None, namespace=None) -> Tuple[argparse.Namespace, List[str]]:
        """The namespace (a value it could not read is _BAD) and every problem of the command line."""
        self._problems, self._outside_choices = [], set()
        try:
            namespace, extras = self.parse_known_args(args, namespace)
        finally:
            problems, self._problems = self._problems, None
        for dest in self._outside_choices:  # reported once, here, not again by its config
            setattr(namespace, dest, _BAD)
        if extras:
            problems.append("unrecognized arguments: " + " ".join(extras))
        return namespace, problems

    def _get_value(self, action, arg_string):
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as exc:  # a value of the wrong type: recorded, parsing goes on
            if self._problems is None:
                raise
            self._problems.append(str(exc))
            return _BAD

    def _check_value(self, action, value):
        if value is _BAD:
            return
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:  # a value outside the choices: recorded, parsing goes on
            if self._problems is None:
                raise
            self._problems.append(str(exc))
            self._outside_choices.add(action.dest)

    def error(self, message: str):
        self.fail([message])

    def fail(self, messages: Sequence[str]) -> None:
        """Exit 2 with one line per problem (nothing when there is none)."""
        lines = problem_lines([line for message in messages for line in self._explained(message)])
        if not lines:
            return
        if os.environ.get("RANK", "0") != "0":
            sys.exit(2)
        lines[-1] += " (see --help)"
        self.exit(2, "".join(f"{self.prog}: error: {line}\n" for line in lines))

    def _explained(self, message: str) -> List[str]:
        """Megatron-LM flags (or values) moezero lacks are named as such, one line each; a misspelling gets a
        did-you-mean."""
        choice = re.match(r"argument (--[\w-]+).*: invalid choice: '?([^' ]+)'?", message)
        if choice and choice[2] in [str(c) for c in megatron_table()["flags"].get(choice[1], {}).get("choices") or []]:
            return [f"{choice[1]} {choice[2]}: not supported by moezero ({message.split('(', 1)[-1].rstrip(')')})"]
        if not message.startswith("unrecognized arguments:"):
            return [message]
        megatron = megatron_table()["flags"]
        lines = []
        for flag, words in _by_flag(message.split(":", 1)[1].split()):
            if flag in megatron:
                lines.append(
                    f"{flag}: not supported by moezero (a Megatron-LM flag; see docs/megatron.md, "
                    "'Coming from Megatron-LM')"
                )
            else:
                lines.append(f"unrecognized arguments: {' '.join(words)}{self._did_you_mean(flag)}")
        return lines

    def _did_you_mean(self, flag: Optional[str]) -> str:
        opposite = flag and "--no-" + flag[2:]
        if opposite in self._option_string_actions:  # Megatron's store_false switches have only the --no- form
            return f"; that is on by default ({opposite} turns it off)"
        known = [s for s in self._option_string_actions if s.startswith("--")]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75) if flag else []
        if close and close[0].startswith("--no-") and not flag.startswith("--no-"):  # not the opposite meaning
            return f"; the nearest flag, {close[0]}, turns an option off"
        return f"; did you mean {close[0]}?" if close else ""


def _by_flag(words: List[str]) -> List[Tuple[Optional[str], List[str]]]:
    """(flag, its words) of an unrecognized stretch: a value belongs to the flag before it (None: no flag)."""
    groups: List[Tuple[Optional[str], List[str]]] = []
    for word in words:
        if word.startswith("--") or not groups:
            groups.append((word.split("=", 1)[0] if word.startswith("--") else None, []))
        groups[-1][1].append(word)
    return groups


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


def add_config_arguments(
    parser: argparse.ArgumentParser, config_cls: Type, only: Optional[Sequence[str]] = None
) -> None:
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
            group.add_argument(
                *flags, dest=dest, action="store_true", default=default, help=f"{help_text} (default: off)"
            )
            continue
        if kind is bool:
            group.add_argument(flag, dest=dest, action=_Switch, default=default, help=help_text)
            continue
        if default is not None and "default" not in help_text:
            help_text += f" (default: {default})"
        metavar = None if f.metadata.get("choices") else flag.lstrip("-").replace("-", "_").upper()
        group.add_argument(
            *flags,
            dest=dest,
            type=f.metadata.get("parse") or kind,
            default=default,
            choices=f.metadata.get("choices"),
            metavar=metavar,
            help=help_text,
            nargs=f.metadata.get("nargs"),
        )


def build_parser(config_classes: Sequence[Type], description: str) -> ArgumentParser:
    parser = ArgumentParser(description=description)
    for cls in config_classes:
        add_config_arguments(parser, cls)
    return parser


def configs_from_args(namespace: argparse.Namespace, config_classes: Sequence[Type]) -> Dict[str, Any]:
    """{section: config instance}; validation errors (one ConfigError, a line per problem) name the flag."""
    built, problems = build_sections(namespace, config_classes)
    if problems:
        raise ConfigError("\n".join(problems))
    return built


def build_sections(namespace: argparse.Namespace, config_classes: Sequence[Type]) -> Tuple[Dict[str, Any], List[str]]:
    """({section: config} of the sections that could be built, every problem): each section's first problem, or
    all the values it refuses, so one launch lists them all. A section refusing values (ConfigError.refused) is
    still built without them, so checks across sections see the rest of the command line."""
    values: Dict[str, Dict[str, Any]] = {cls.section: {} for cls in config_classes}
    for dest, value in vars(namespace).items():
        section, _, name = dest.partition(".")
        if section in values:
            values[section][name] = value
    problems, built = [], {}
    for cls in config_classes:
        if any(v is _BAD for v in values[cls.section].values()):
            continue  # the value argparse could not read is the problem reported
        try:
            if hasattr(cls, "check_command_line"):  # Megatron's reading, where a config alone cannot tell
                cls.check_command_line(values[cls.section])
            built[cls.section] = cls(**values[cls.section])
        except ConfigError as exc:
            problems.append(str(exc))
            if exc.refused:
                _build_without(cls, values[cls.section], exc.refused, built)
    return built, problems


def _build_without(cls: Type, values: Dict[str, Any], refused: Sequence[str], built: Dict[str, Any]) -> None:
    """`cls` built with the `refused` fields at their defaults (their refusal is reported already)."""
    defaults = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(cls)
        if f.name in refused
    }
    try:
        built[cls.section] = cls(**{**values, **defaults})
    except ConfigError:
        pass  # its problem is reported when the refused values are fixed (a dependent rule)


def flag_values(configs: Iterable[Any]) -> Dict[str, Any]:
    """{flag: value} of every command-line field of the given config objects (what a run was given)."""
    return {flag: getattr(cfg, f.name) for cfg in configs for f, flag in flag_fields(type(cfg))}


def parse_configs(
    argv: Optional[List[str]],
    config_classes: Sequence[Type],
    description: str,
    refusals: Optional[Callable[[Dict[str, Any]], List[str]]] = None,
) -> Dict[str, Any]:
    """Parse argv into configs; bad flags and values exit with one line each, naming the flag, all of them at once.
    The checkpoint section records which fields the command line set (`given_fields`: --use-checkpoint-args lets
    an imported model's training values stand in for the others). `refusals`: what the script refuses of the
    sections together (its lines join the others'), asked once every section is built."""
    parser = build_parser(config_classes, description)
    namespace, problems = parser.parse_with_problems(argv)
    configs, config_problems = build_sections(namespace, config_classes)
    problems += [line for problem in config_problems for line in problem.splitlines()]
    if len(configs) == len(config_classes):  # every value read (argparse's problems leave a section unbuilt)
        if hasattr(configs.get("checkpoint"), "given_fields"):
            configs["checkpoint"].given_fields = tuple(sorted(given_dests(parser, argv)))
        if refusals is not None:
            problems += refusals(configs)
    parser.fail(problems)
    return configs


def given_dests(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> Set[str]:
    """The 'section.field' dests the command line sets (a flag typed, whatever its value): argv parsed again
    with every default suppressed, so only what was typed lands in the namespace."""
    actions = [a for a in parser._actions if a.default is not argparse.SUPPRESS]
    saved = [a.default for a in actions]
    for action in actions:
        action.default = argparse.SUPPRESS
    try:
        namespace, _ = argparse.ArgumentParser.parse_known_args(parser, argv)
    finally:
        for action, default in zip(actions, saved):
            action.default = default
    return set(vars(namespace)) - set(parser._defaults)


def prepare_output_file(path: str, flag: str = "--output") -> None:
    """A tool's output file, checked before the work: not a folder; its parent folder created."""
    if os.path.isdir(path):
        raise ConfigError(f"{flag}={path}: is a folder; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag}={path}: cannot create {parent} ({exc.strerror})") from None
