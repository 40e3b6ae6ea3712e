"""A config.json as transformers reads it: each field it omits takes the default its family's config class declares
(config_defaults.json, written by tools/hf_config_defaults.py)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Dict

_DEFAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config_defaults.json")


@functools.lru_cache(maxsize=1)
def _declared_defaults() -> Dict[str, Dict[str, Any]]:
    with open(_DEFAULTS) as f:
        return json.load(f)["families"]


def with_defaults(hf: Dict[str, Any], family) -> Dict[str, Any]:
    """The config as transformers reads it for `family`: each field it omits takes the default its config class
    declares, RoPE's base its `default_theta`; a derived field (head_dim) stays for the reader to derive."""
    defaults = _declared_defaults().get(family.model_type, {})
    aliases = defaults.get("attribute_map", {})
    named = set(hf) | {a for a, b in aliases.items() if b in hf} | {b for a, b in aliases.items() if a in hf}
    out = {k: v for k, v in defaults.items() if k not in ("default_theta", "attribute_map") and k not in named}
    out.update(hf)
    if "rope_theta" not in hf and not (hf.get("rope_parameters") or {}).get("rope_theta"):
        out["rope_theta"] = defaults.get("default_theta", 10000.0)
    return out


def attribute_aliases(family) -> Dict[str, str]:
    """Two names of one field in the family's config class (its attribute_map: alias -> attribute)."""
    return dict(_declared_defaults().get(family.model_type, {}).get("attribute_map", {}))
