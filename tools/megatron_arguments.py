"""Megatron-LM's command-line flags, defaults and value counts (nargs) as JSON, read from its own argument parser: the
oracle of
tests/unit/test_megatron_flags.py (every flag moezero shares with Megatron has Megatron's default), and the
training script's list of Megatron flags it does not support (a one-line error naming them).

megatron-core 0.19 (whose wheel carries megatron/training/arguments.py) installs on Python >= 3.12 only, and
moezero's venv is 3.11; its Python files are read directly, with two stand-ins the parser never calls:

    pip download "megatron-core==0.19.2" --no-deps -d /tmp/mcore && unzip -q /tmp/mcore/*.whl -d /tmp/mcore/x
    PYTHONPATH=/tmp/mcore/x .venv/bin/python tools/megatron_arguments.py \
        > moezero/training/assets/megatron_arguments.json
"""

import argparse
import enum
import json
import sys


import megatron_wheel  # noqa: E402,F401  (before megatron-core)
from megatron.core import package_info  # noqa: E402
from megatron.training import arguments  # noqa: E402


def _plain(value):
    if isinstance(value, enum.Enum):  # an enum choice is typed by its name
        return value.name
    return value if isinstance(value, (int, float, str, bool, type(None), list)) else repr(value)


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    flags = {}
    for action in parser._actions:
        kind = type(action).__name__.lstrip("_").replace("Action", "").lower() or "store"
        for flag in action.option_strings:
            if flag.startswith("--"):
                flags[flag] = {
                    "dest": action.dest,
                    "default": _plain(action.default),
                    "action": kind,
                    "choices": [_plain(c) for c in action.choices] if action.choices else None,
                    "nargs": action.nargs,
                }
    json.dump({"megatron_core": package_info.__version__, "flags": flags}, sys.stdout, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
