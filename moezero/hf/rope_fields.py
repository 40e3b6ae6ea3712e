"""RoPE in a config.json (rope_theta, rope_parameters, YaRN's fields) and the `Rope` part of a declaration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from moezero.config import GPTConfig
from moezero.hf.family import UnsupportedModel
from moezero.hf.parts import Part


@dataclass(frozen=True)
class Rope(Part):
    """rope_theta and rope_parameters. `yarn`: YaRN too (else plain RoPE only); `partial`: the share of each head
    rotated where the config gives no partial_rotary_factor (None: the whole head whatever it says, as transformers'
    models of most families do); `when_absent`: the rope_parameters a config without any means (GPT-OSS's class
    fills in its YaRN)."""

    yarn: bool = False
    partial: Optional[float] = None
    when_absent: Optional[Dict[str, Any]] = None

    def read(self, hf):
        if self.when_absent and not (hf.get("rope_parameters") or hf.get("rope_scaling")):
            hf = dict(hf, rope_parameters=dict(self.when_absent, rope_theta=hf["rope_theta"]))
        rope = rope_parameters(hf, yarn=self.yarn)
        share = 1.0 if self.partial is None else float(rope.get("partial_rotary_factor", self.partial))
        return dict(rotary_base=float(rope["rope_theta"]), rotary_percent=share, **yarn_fields(rope))

    def write(self, gpt, moe):
        rope = rope_hf_parameters(gpt) if self.yarn else {"rope_type": "default", "rope_theta": gpt.rotary_base}
        out = {"rope_theta": gpt.rotary_base, "rope_parameters": rope}
        if self.partial is not None:
            rope["partial_rotary_factor"] = out["partial_rotary_factor"] = gpt.rotary_percent
        return out


def rope_parameters(hf: Dict[str, Any], yarn: bool = False) -> Dict[str, Any]:
    """The config's RoPE as transformers reads it (convert_rope_params_to_dict): rope_scaling before
    rope_parameters; YaRN's original length from a top-level original_max_position_embeddings, else from its
    own dict, else max_position_embeddings."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in hf:
        rope.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "yarn":
        if "original_max_position_embeddings" in hf:
            rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        else:
            rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    allowed = ("default", "yarn") if yarn else ("default",)
    if kind not in allowed:
        raise UnsupportedModel(f"rope_parameters.rope_type={kind!r}: not supported by moezero ({', '.join(allowed)})")
    if rope.get("attention_factor") is not None or (rope.get("truncate") is False and kind != "yarn"):
        raise UnsupportedModel("rope_parameters.attention_factor: not supported by moezero")
    return rope


def rope_hf_parameters(gpt: GPTConfig) -> Dict[str, Any]:
    """transformers' rope_parameters of a model's RoPE (YaRN's with its fields; truncate only where false)."""
    rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": gpt.rotary_base}
    if gpt.rope_type == "yarn":
        rope.update(
            rope_type="yarn",
            factor=gpt.rotary_scaling_factor,
            mscale=gpt.mscale,
            mscale_all_dim=gpt.mscale_all_dim,
            beta_fast=gpt.yarn_beta_fast,
            beta_slow=gpt.yarn_beta_slow,
            original_max_position_embeddings=gpt.yarn_original_max_position_embeddings,
        )
        if gpt.no_yarn_correction_range_round_to_int:
            rope["truncate"] = False
    return rope


def yarn_fields(rope: Dict[str, Any]) -> Dict[str, Any]:
    """The GPTConfig fields of a YaRN rope_parameters; plain RoPE's where it is not YaRN."""
    if rope.get("rope_type", rope.get("type")) != "yarn":
        return dict(rope_type="rope")
    return dict(
        rope_type="yarn",
        rotary_scaling_factor=float(rope.get("factor", 1.0)),
        mscale=float(rope.get("mscale") or 0.0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        yarn_original_max_position_embeddings=rope.get("original_max_position_embeddings"),
        yarn_beta_fast=rope.get("beta_fast"),
        yarn_beta_slow=rope.get("beta_slow"),
        no_yarn_correction_range_round_to_int=rope.get("truncate", True) is False,
    )
