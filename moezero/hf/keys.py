"""Which Hugging Face tensors make each moezero parameter (and back).

A `Link` says: this moezero tensor is the Hub tensors `keys` concatenated along dim 0 (the fused q/k/v
projection from q_proj/k_proj/v_proj, a SwiGLU input projection from gate_proj/up_proj). A routed-expert
stack (L, in, out) is per expert: its keys hold "{e}" for the global expert, and expert e's slice is the
transpose of the concatenation (Hub weights are (out, in), moezero's expert stacks (in, out)); or `stacked`:
one Hub tensor holds every expert as moezero does (GPT-OSS's), a rank reading its experts' rows, with the gate
and up columns alternating where `interleaved` (moezero's gated input projection holds [gate | up]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from moezero.config import GPTConfig, MoEConfig, is_moe_layer
from moezero.hf.families import Family
from moezero.parallel.tensor_marker import TensorShard


@dataclass(frozen=True)
class Link:
    keys: Tuple[str, ...]
    per_expert: bool = False
    sizes: Optional[Tuple[int, ...]] = None  # rows of each key (None: equal shares)
    copies: Tuple[str, ...] = ()  # Hub keys holding the same tensor again (an MTP layer's embedding and head):
    # written on export, not read (nor required) on import
    stacked: bool = False  # an expert stack held whole by one Hub tensor, in moezero's layout
    interleaved: bool = False  # a stacked gated projection whose Hub columns alternate gate, up

    def hub_keys(self, num_experts: int) -> List[str]:
        if not self.per_expert or self.stacked:
            return list(self.keys)
        return [key.format(e=e) for e in range(num_experts) for key in self.keys]

    def assemble(self, hub, experts: range = range(0)) -> torch.Tensor:
        """The moezero tensor from the Hub tensors of `hub` (the experts `experts` of a stack)."""
        if self.stacked:
            value = hub.read_rows(self.keys[0], experts.start, experts.stop)
            return _deinterleave(value) if self.interleaved else value
        if not self.per_expert:
            return _cat([hub.read(key) for key in self.keys])
        return torch.stack([_cat([hub.read(key.format(e=e)) for key in self.keys]).t() for e in experts])

    def assemble_slices(self, hub, experts: range, item: TensorShard) -> torch.Tensor:
        """The experts `experts` of a per-expert stack split over expert tensor parallelism, each expert's slice
        `item` (the stack's TensorShard of one expert) read alone: a column slice of the moezero expert (fc1's,
        both GLU halves) is rows of its Hub tensors, a row slice (fc2's) their columns."""
        return torch.stack([self._expert_slices(hub, e, item) for e in experts])

    def _expert_slices(self, hub, expert: int, item: TensorShard) -> torch.Tensor:
        keys = [key.format(e=expert) for key in self.keys]
        if item.dim == 1:  # moezero's columns: the rows of the Hub tensors, one after the other
            rows = [hub.shape(key)[0] for key in keys]
            starts = [sum(rows[:k]) for k in range(len(rows))]
            parts = [
                hub.read_rows(key, max(lo - start, 0), min(hi - start, n))
                for lo, hi in item.blocks
                for key, start, n in zip(keys, starts, rows)
                if max(lo - start, 0) < min(hi - start, n)
            ]
            return _cat(parts).t()
        (key,) = keys  # moezero's rows: the columns of the one Hub tensor
        return torch.cat([hub.read_box(key, 0, hub.shape(key)[0], lo, hi) for lo, hi in item.blocks], dim=1).t()

    def read_range(self, hub, lo: int, hi: int, shape: Tuple[int, ...]) -> torch.Tensor:
        """Elements [lo, hi) of the flattened moezero tensor of `shape`, reading only the Hub rows they lie in
        (not for expert stacks, whose layout is transposed)."""
        row = math.prod(shape[1:])
        first, last = lo // row, -(-hi // row)
        parts, start = [], 0
        for key in self.keys:
            rows = hub.shape(key)[0]
            a, b = max(first - start, 0), min(last - start, rows)
            if a < b:
                parts.append(hub.read_rows(key, a, b))
            start += rows
        return _cat(parts).reshape(-1)[lo - first * row : hi - first * row]

    def read_box(self, hub, start: int, stop: int, col_start: int, col_stop: int) -> torch.Tensor:
        """Rows [start, stop) of the moezero tensor (its Hub tensors' rows in turn), of each row the flat elements
        [col_start, col_stop) of its trailing dims: a (rows, columns) tensor, read without the rest (not for
        expert stacks)."""
        parts, first = [], 0
        for key in self.keys:
            rows = hub.shape(key)[0]
            a, b = max(start - first, 0), min(stop - first, rows)
            if a < b:
                parts.append(hub.read_box(key, a, b, col_start, col_stop))
            first += rows
        return _cat(parts)

    def split(self, tensor: torch.Tensor, first_expert: int = 0) -> Dict[str, torch.Tensor]:
        """The Hub tensors of a moezero tensor (a stack's experts numbered from `first_expert`; a `stacked` one
        whole)."""
        if self.stacked:
            return {self.keys[0]: _interleave(tensor) if self.interleaved else tensor}
        if not self.per_expert:
            return dict(zip(self.keys + self.copies, self._parts(tensor) + (tensor,) * len(self.copies)))
        out = {}
        for l, expert in enumerate(tensor):
            parts = self._parts(expert.t())
            out.update({key.format(e=first_expert + l): part for key, part in zip(self.keys, parts)})
        return out

    def _parts(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        if len(self.keys) == 1:
            return (tensor,)
        return tensor.split(list(self.sizes)) if self.sizes else tensor.chunk(len(self.keys))


def _cat(tensors: List[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Last-dim columns g0 u0 g1 u1 ... -> [g0 g1 ... | u0 u1 ...]."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def links(family: Family, gpt: GPTConfig, moe: Optional[MoEConfig]) -> Dict[str, Link]:
    """moezero tensor name -> its Link, for every parameter (and the expert-bias buffers) of a model of these
    configs."""
    depths = [f"model.layers.{gpt.num_layers + k}." for k in range(gpt.mtp_num_layers or 0)]
    embedding = tuple(hub + "embed_tokens.weight" for hub in depths)
    heads = tuple(hub + "shared_head.head.weight" for hub in depths)
    tied = not gpt.untie_embeddings_and_output_weights
    out = {
        "embedding.weight": Link(("model.embed_tokens.weight",), copies=embedding + (heads if tied else ())),
        "final_norm.weight": Link(("model.norm.weight",)),
    }
    if not tied:
        out["output.weight"] = Link(("lm_head.weight",), copies=heads)
    for i in range(gpt.num_layers):
        out.update(_layer(f"layers.{i}.", f"model.layers.{i}.", i, family, gpt, moe))
    for k, hub in enumerate(depths):  # DeepSeek-V3's MTP modules: Hub layers after the last
        ours = f"mtp.{k}."
        out.update(
            {
                ours + mine: Link((hub + theirs,))
                for mine, theirs in (
                    ("enorm.weight", "enorm.weight"),
                    ("hnorm.weight", "hnorm.weight"),
                    ("eh_proj.weight", "eh_proj.weight"),
                    ("final_norm.weight", "shared_head.norm.weight"),
                )
            }
        )
        out.update(_layer(ours + "layer.", hub, gpt.num_layers - 1, family, gpt, moe))
    return out


def _layer(ours: str, hub: str, kind: int, family: Family, gpt: GPTConfig, moe: Optional[MoEConfig]) -> Dict[str, Link]:
    """A transformer layer's links; its MLP is of layer `kind`'s kind."""
    out = {
        ours + "input_norm.weight": Link((hub + "input_layernorm.weight",)),
        ours + "mlp_norm.weight": Link((hub + "post_attention_layernorm.weight",)),
    }
    attention = _latent_attention if gpt.multi_latent_attention else _attention
    out.update(attention(ours + "attention.", hub + "self_attn.", gpt))
    if moe is not None and is_moe_layer(kind, gpt.moe_layer_freq):
        out.update(_moe(ours + "mlp.", f"{hub}{family.moe_block}.", family, moe))
    else:
        out.update(_swiglu(ours + "mlp.", hub + "mlp.", ("gate_proj", "up_proj", "down_proj")))
    return out


def _attention(ours: str, hub: str, gpt: GPTConfig) -> Dict[str, Link]:
    qkv = tuple(hub + p for p in ("q_proj", "k_proj", "v_proj"))
    sizes = (gpt.num_attention_heads * gpt.kv_channels,) + (gpt.query_groups * gpt.kv_channels,) * 2
    out = {
        ours + "qkv.weight": Link(tuple(k + ".weight" for k in qkv), sizes=sizes),
        ours + "proj.weight": Link((hub + "o_proj.weight",)),
    }
    if gpt.add_qkv_bias or not gpt.disable_bias_linear:
        out[ours + "qkv.bias"] = Link(tuple(k + ".bias" for k in qkv), sizes=sizes)
    if not gpt.disable_bias_linear:
        out[ours + "proj.bias"] = Link((hub + "o_proj.bias",))
    if gpt.softmax_type == "learnable":  # GPT-OSS's attention sinks
        out[ours + "softmax_offset"] = Link((hub + "sinks",))
    if gpt.qk_layernorm:
        out[ours + "q_norm.weight"] = Link((hub + "q_norm.weight",))
        out[ours + "k_norm.weight"] = Link((hub + "k_norm.weight",))
    return out


def _latent_attention(ours: str, hub: str, gpt: GPTConfig) -> Dict[str, Link]:
    names = {"kv_down": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "kv_up": "kv_b_proj", "proj": "o_proj"}
    if gpt.q_lora_rank is None:
        names["q_proj"] = "q_proj"
    else:
        names.update(q_down="q_a_proj", q_norm="q_a_layernorm", q_up="q_b_proj")
    return {f"{ours}{mine}.weight": Link((f"{hub}{theirs}.weight",)) for mine, theirs in names.items()}


def _swiglu(ours: str, hub: str, projections: Tuple[str, str, str]) -> Dict[str, Link]:
    gate, up, down = (f"{hub}{p}.weight" for p in projections)
    return {ours + "fc1.weight": Link((gate, up)), ours + "fc2.weight": Link((down,))}


def _moe(ours: str, hub: str, family: Family, moe: MoEConfig) -> Dict[str, Link]:
    if family.stacked_experts:
        return _stacked_moe(ours, hub)
    gate, up, down = (f"{hub}experts.{{e}}.{p}.weight" for p in family.expert_projections)
    out = {
        ours + "router.wg.weight": Link((hub + "gate.weight",)),
        ours + "experts.w1": Link((gate, up), per_expert=True),
        ours + "experts.w2": Link((down,), per_expert=True),
    }
    if moe.enable_expert_bias:  # a buffer: the selection-only correction bias (DeepSeek-V3)
        out[ours + "router.expert_bias"] = Link((hub + "gate.e_score_correction_bias",))
    if moe.shared_expert_intermediate_size:
        out.update(
            _swiglu(
                ours + "shared_expert.", f"{hub}{family.shared_expert_module}.", ("gate_proj", "up_proj", "down_proj")
            )
        )
    if moe.shared_expert_gate:
        out[ours + "shared_expert_gate.weight"] = Link((hub + "shared_expert_gate.weight",))
    return out


def _stacked_moe(ours: str, hub: str) -> Dict[str, Link]:
    """GPT-OSS's: a router with its bias, each layer's experts in four stacked tensors, gate and up alternating."""
    return {
        ours + "router.wg.weight": Link((hub + "router.weight",)),
        ours + "router.wg.bias": Link((hub + "router.bias",)),
        ours + "experts.w1": Link((hub + "experts.gate_up_proj",), per_expert=True, stacked=True, interleaved=True),
        ours + "experts.b1": Link(
            (hub + "experts.gate_up_proj_bias",), per_expert=True, stacked=True, interleaved=True
        ),
        ours + "experts.w2": Link((hub + "experts.down_proj",), per_expert=True, stacked=True),
        ours + "experts.b2": Link((hub + "experts.down_proj_bias",), per_expert=True, stacked=True),
    }
