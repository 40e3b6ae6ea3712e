"""Import the compiled kernels once, or say (one log line) why the reference path runs instead.

`moezero._C` holds the CPU kernels (built by setup.py whenever a C++ compiler is present) and
`moezero._C_cuda` their CUDA twins (built only when torch has CUDA). Environment:

- `MOEZERO_DISABLE_EXT=1` forces the pure-PyTorch reference (read at every call, so tests can flip it).
- `MOEZERO_REQUIRE_EXT=1` turns a missing extension into an error instead of a fallback, so CI
  cannot pass on a silently broken build.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType
from typing import Optional, Tuple

logger = logging.getLogger(__name__)

DISABLE_ENV = "MOEZERO_DISABLE_EXT"
REQUIRE_ENV = "MOEZERO_REQUIRE_EXT"
MODULES = {"cpu": "moezero._C", "cuda": "moezero._C_cuda"}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0") == "1"


@functools.lru_cache(maxsize=None)  # the one-time extension-load cache
def _import(module_name: str) -> Tuple[Optional[ModuleType], str]:
    """(module, "") or (None, why it failed); the failure is logged once per module."""
    try:
        return importlib.import_module(module_name), ""
    except (ImportError, OSError) as exc:
        logger.warning("moezero: %s unavailable (%s); using the PyTorch reference kernels", module_name, exc)
        return None, f"{type(exc).__name__}: {exc}"


def load(device_type: str) -> Optional[ModuleType]:
    """The compiled kernel module for `device_type` ('cpu' or 'cuda'), or None for the reference."""
    name = MODULES.get(device_type)
    if name is None or _env_flag(DISABLE_ENV):
        return None
    module, why = _import(name)
    if module is None and _env_flag(REQUIRE_ENV):
        raise RuntimeError(f"{REQUIRE_ENV}=1 but {name} failed to load ({why})")
    return module
