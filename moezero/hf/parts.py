"""The vocabulary of a family's declaration (family.py): each `Part` maps some config.json fields to some moezero
config fields and back, and may refuse config.json values moezero does not reproduce.

A moezero field is named as GPTConfig names it ("num_layers") or, prefixed "moe.", as MoEConfig does ("moe.top_k").
`refusal(hf)` names what of a config.json (completed with transformers' defaults) moezero would not reproduce, or
is None; `read(hf)` gives the moezero fields; `write(gpt, moe)` the config.json fields of a model. Nothing says
which models a family can hold: that is whatever survives a write and a read (Family.differences).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional


class Part:
    def refusal(self, hf: Dict[str, Any]) -> Optional[str]:
        return None

    def read(self, hf: Dict[str, Any]) -> Dict[str, Any]:
        return {}

    def write(self, gpt, moe) -> Dict[str, Any]:
        return {}


def value_of(gpt, moe, name: str) -> Any:
    """The value of the moezero field `name` ("moe." prefixed: the MoE config's)."""
    return getattr(moe, name[4:]) if name.startswith("moe.") else getattr(gpt, name)


def hub_text(value: Any) -> str:
    """A config.json value as an error message shows it: true/null as JSON writes them, strings quoted."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return repr(value) if isinstance(value, str) else str(value)


def _as_is(value: Any) -> Any:
    return value


_REQUIRED = object()


@dataclass(frozen=True)
class Same(Part):
    """A config.json field that is one moezero field, converted by `read_as` / `write_as` where the two spell it
    differently; `default` where a config may lack it (none given: the field is required)."""

    hub: str
    ours: str
    read_as: Callable[[Any], Any] = _as_is
    write_as: Callable[[Any], Any] = _as_is
    default: Any = _REQUIRED

    def read(self, hf):
        value = hf[self.hub] if self.default is _REQUIRED else hf.get(self.hub, self.default)
        return {self.ours: self.read_as(value)}

    def write(self, gpt, moe):
        return {self.hub: self.write_as(value_of(gpt, moe, self.ours))}


class Fixed(Part):
    """moezero settings every model of the family has: a model with others is no model of it."""

    def __init__(self, values: Dict[str, Any]):
        self.values = dict(values)

    def read(self, hf):
        return dict(self.values)

    def __repr__(self) -> str:
        return f"Fixed({self.values})"


@dataclass(frozen=True)
class Requires(Part):
    """A config.json field with the one value moezero reproduces: written so (unless not `written`), any other
    refused (`why` says what it would mean). A true/false value is compared as transformers tests it."""

    hub: str
    value: Any
    why: str = ""
    written: bool = True

    def refusal(self, hf):
        found = hf.get(self.hub, self.value)
        same = bool(found) == self.value if isinstance(self.value, bool) else found == self.value
        return None if same else f"{self.hub}={hub_text(found)}" + (f" ({self.why})" if self.why else "")

    def write(self, gpt, moe):
        return {self.hub: self.value} if self.written else {}


@dataclass(frozen=True)
class Written(Part):
    """A config.json field the family always writes so, and does not read."""

    hub: str
    value: Any

    def write(self, gpt, moe):
        return {self.hub: self.value}


@dataclass(frozen=True)
class Refuse(Part):
    """A config.json setting moezero does not reproduce: `what(hf)` names it, or is None where the config is fine."""

    what: Callable[[Dict[str, Any]], Optional[str]]

    def refusal(self, hf):
        return self.what(hf)
