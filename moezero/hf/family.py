"""A Hugging Face family (`Family`): its names, one declaration of how its config.json maps to moezero's configs
(`parts`, see parts.py), and the facts of its files. Reading a config, writing one and the check of what the family
can hold all come from the declaration: the family holds a model exactly when the config.json it writes reads back
as the same model (definition.py), so the three cannot drift apart. families.py lists the families."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple

from moezero.config import ConfigError, GPTConfig, MoEConfig
from moezero.hf.defaults import with_defaults
from moezero.hf.definition import definition, differing
from moezero.hf.parts import Part


class UnsupportedModel(ValueError):
    """A Hugging Face config (or a moezero model to export) uses something moezero or the family lacks."""


@dataclass(frozen=True)
class Family:
    """Args:
    model_type, architecture: config.json's names of it (`aliases`: other model_types of the same model).
    parts: the declaration of its config.json, read and written in order.
    dense: no MoE layers (Llama, Qwen3: the sources of upcycling).
    moe_block, expert_projections, shared_expert_module: module names of its MoE MLP, of one expert's
        (gate, up, down) projections and of its shared expert.
    stacked_experts: each layer's experts in stacked tensors (GPT-OSS), not one key each.
    fp32_modules: transformers' _keep_in_fp32_modules_strict: fp32 in any model dtype.
    """

    model_type: str
    architecture: str
    parts: Tuple[Part, ...]
    aliases: Tuple[str, ...] = ()
    dense: bool = False
    moe_block: str = "mlp"
    expert_projections: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_expert_module: str = "shared_expert"
    stacked_experts: bool = False
    fp32_modules: Tuple[str, ...] = ()

    def keeps_fp32(self, hub_key: str) -> bool:
        """Whether transformers keeps the tensor of `hub_key` in fp32 whatever the model's dtype (matched as its
        modeling_utils matches those module names: anywhere in the key)."""
        return any(module in hub_key for module in self.fp32_modules)

    def configs(self, hf: Dict[str, Any]) -> Tuple[GPTConfig, Optional[MoEConfig]]:
        """moezero's configs of a config.json dict (MoEConfig None: a dense model)."""
        hf = with_defaults(hf, self)
        problem = self.refusal(hf)
        if problem:
            raise UnsupportedModel(f"{self.model_type} config {problem}: not supported by moezero")
        return self._read(hf)

    def refusal(self, hf: Dict[str, Any]) -> Optional[str]:
        """The first setting of a (completed) config.json that moezero would not reproduce, or None."""
        return next((why for why in (part.refusal(hf) for part in self.parts) if why), None)

    def _read(self, hf: Dict[str, Any]) -> Tuple[GPTConfig, Optional[MoEConfig]]:
        fields = _merged(part.read(hf) for part in self.parts)
        moe = {name[4:]: value for name, value in fields.items() if name.startswith("moe.")}
        gpt = GPTConfig(**{name: value for name, value in fields.items() if not name.startswith("moe.")})
        if self.dense and moe:
            raise TypeError(f"{self.model_type} is declared dense but reads {sorted(moe)}")
        return gpt, None if self.dense else MoEConfig(**moe)

    def hf_config(self, gpt: GPTConfig, moe: Optional[MoEConfig], dtype: str) -> Dict[str, Any]:
        """The config.json of a model of (gpt, moe) in `dtype`; UnsupportedModel where the family cannot hold it."""
        self.check_expressible(gpt, moe)
        return self._written(gpt, moe, dtype)

    def _written(self, gpt: GPTConfig, moe: Optional[MoEConfig], dtype: str) -> Dict[str, Any]:
        hf = {"architectures": [self.architecture], "model_type": self.model_type}
        hf.update(_merged(part.write(gpt, moe) for part in self.parts))
        hf.update(dtype=dtype, torch_dtype=dtype)
        return hf

    def check_expressible(self, gpt: GPTConfig, moe: Optional[MoEConfig]) -> None:
        """UnsupportedModel naming the first setting of (gpt, moe) this family cannot hold."""
        problem = next(self.differences(gpt, moe), None)
        if problem:
            raise UnsupportedModel(f"{self.model_type} cannot hold this model: {problem}")

    def differences(self, gpt: GPTConfig, moe: Optional[MoEConfig]) -> Iterator[str]:
        """Why the family cannot hold a model of (gpt, moe): where the model its config.json reads back as differs
        (nothing: it holds it exactly)."""
        if (moe is None) != self.dense:
            yield "MoE layers (it is dense)" if self.dense else "no MoE layers (it is an MoE)"
            return
        # the aux loss trains and defines no weights; a list of them has no config.json spelling
        model_only = (
            None if moe is None else dataclasses.replace(moe, load_balancing_type="aux_loss", aux_loss_coeff=0.0)
        )
        yield from self.config_differences(self._written(gpt, model_only, "float32"), gpt, moe)

    def config_differences(self, hf: Dict[str, Any], gpt: GPTConfig, moe: Optional[MoEConfig]) -> Iterator[str]:
        """Where the model config.json `hf` reads back as differs from (gpt, moe) (nothing: it is that model)."""
        hf = with_defaults(hf, self)
        problem = self.refusal(hf)
        if problem:
            yield f"its config.json would say {problem}"
            return
        try:
            back = self._read(hf)
        except (UnsupportedModel, ConfigError) as exc:
            yield str(exc)
            return
        yield from differing(definition(gpt, moe), definition(*back))


def _merged(parts_fields: Iterable[Dict[str, Any]]) -> Dict[str, Any]:
    """The fields of all parts; a field two parts give is a mistake in the declaration."""
    out: Dict[str, Any] = {}
    for fields in parts_fields:
        twice = out.keys() & fields.keys()
        if twice:
            raise TypeError(f"a family declares {sorted(twice)} twice")
        out.update(fields)
    return out
