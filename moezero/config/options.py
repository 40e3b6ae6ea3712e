"""How a config field declares its flag, help and validation: option(), Validated, ConfigError."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import field
from typing import Any, List, Optional, Sequence, Tuple


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag and what is allowed (a line per problem).
    `refused`: the fields whose values moezero refuses outright; the config is otherwise valid without them (so a
    command line's other checks can still run, and one launch lists every refusal)."""

    def __init__(self, message: str, refused: Tuple[str, ...] = ()):
        super().__init__(message)
        self.refused = refused


_REFUSAL = re.compile(r"--[\w-]+[^:]*: not (supported|tested)")  # a flag or value moezero refuses, not a mistake


def problem_lines(problems: Sequence[str]) -> List[str]:
    """The lines of one error for a launch line's problems: one problem alone as it is; several under a first line
    saying how many ('3 flags of this launch line are not supported:' where each is a refused flag or value)."""
    if len(problems) < 2:
        return list(problems)
    if all(_REFUSAL.match(line) for line in problems):
        return [f"{len(problems)} flags of this launch line are not supported:", *problems]
    return [f"{len(problems)} problems with this launch line:", *problems]


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: Optional[str] = "",
    choices: Optional[tuple] = None,
    default_factory: Any = dataclasses.MISSING,
    defines_model: bool = False,
    derived_when_none: bool = False,
    parse: Optional[Any] = None,
    nargs: Optional[Any] = None,
    aliases: Tuple[str, ...] = (),
) -> Any:
    """A config field with its command-line flag.

    flag="" derives the flag from the field name (`top_k` -> `--top-k`); flag=None keeps the
    field off the command line (it is filled in by code, e.g. MoEConfig.hidden_size).
    defines_model=True: the field decides what a checkpoint's weights mean, so a resume checks it
    against the checkpoint's value and --use-checkpoint-args takes it from there. derived_when_none: None
    means the code derives the value (a resume then compares it only where both sides give one); elsewhere
    None is a setting of its own (no shared expert, no window), compared like any value.
    parse: how the command line's text becomes the value (default: the field's type); nargs: values it takes
    (argparse's); aliases: other spellings of the flag (Megatron's --override-opt_param-scheduler has two).
    """
    metadata = {
        "flag": flag,
        "help": help,
        "choices": choices,
        "defines_model": defines_model,
        "parse": parse,
        "nargs": nargs,
        "aliases": aliases,
        "derived_when_none": derived_when_none,
    }
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def flag_of(cls_or_obj: Any, name: str) -> str:
    """The command-line flag of field `name` (or the bare name when it has none)."""
    for f in dataclasses.fields(cls_or_obj):
        if f.name == name:
            flag = f.metadata.get("flag", "")
            if flag is None:
                return name
            return flag or "--" + name.replace("_", "-")
    raise KeyError(name)


def model_defining_fields(cls_or_obj: Any) -> Tuple[str, ...]:
    """The names of the fields declared with defines_model=True."""
    return tuple(f.name for f in dataclasses.fields(cls_or_obj) if f.metadata.get("defines_model"))


def derived_when_none_fields(cls_or_obj: Any) -> Tuple[str, ...]:
    """The names of the fields whose None the code derives a value for."""
    return tuple(f.name for f in dataclasses.fields(cls_or_obj) if f.metadata.get("derived_when_none"))


def check_experts_divide(num_experts: int, expert_parallel_size: int) -> None:
    """Each ep rank holds num_experts / ep experts (the one check of it: training, MoELayer, inference)."""
    if num_experts % expert_parallel_size:
        raise ConfigError(
            f"--num-experts={num_experts}: must be divisible by --expert-model-parallel-size ({expert_parallel_size})"
        )


class Validated:
    """Mixin: helpers for `__post_init__` checks whose messages name the flag."""

    def _fail(self, name: str, message: str) -> None:
        value = getattr(self, name)
        raise ConfigError(f"{flag_of(self, name)}={value!r}: {message}")

    def _require(self, condition: bool, name: str, message: str) -> None:
        if not condition:
            self._fail(name, message)

    def _refuse(self, names: Sequence[str], message: str) -> None:
        """One ConfigError naming every field of `names` with its value, a line each (`message`: why moezero
        refuses them), so one launch lists them all."""
        if names:
            lines = [f"{flag_of(self, name)}={getattr(self, name)!r}: {message}" for name in names]
            raise ConfigError("\n".join(lines), refused=tuple(names))

    def _check_choice(self, name: str) -> None:
        choices = next(f.metadata["choices"] for f in dataclasses.fields(self) if f.name == name)
        value = getattr(self, name)
        if any(v not in choices for v in (value if isinstance(value, (list, tuple)) else [value])):
            self._fail(name, f"must be one of {', '.join(map(str, choices))}")

    def _check_all_choices(self) -> None:
        for f in dataclasses.fields(self):
            if f.metadata.get("choices") and getattr(self, f.name) is not None:
                self._check_choice(f.name)
