"""moezero.hf.save_pretrained: a Hugging Face model directory from a live moezero GPTModel.

Any layout: routed experts are gathered over `groups.ep` (every rank takes part), and rank 0 writes.
At ZeRO stage 3 pass the optimizer: its full_parameters() gathers the shards while the tensors are read.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional, Union

import torch
import torch.distributed as dist

from moezero.hf.families import FAMILIES, Family, family_for
from moezero.hf.files import write_hub_directory
from moezero.hf.keys import links
from moezero.hf.load import model_tensors
from moezero.models import GPTModel
from moezero.parallel import ParallelGroups, comm
from moezero.parallel.expert_marker import expert_shard_of


def save_pretrained(model: GPTModel, path: str, groups: Optional[ParallelGroups] = None,
                    family: Union[str, Family, None] = None, dtype: Optional[torch.dtype] = None,
                    optimizer: Optional[Any] = None, max_shard_bytes: int = 5 * 2 ** 30,
                    overwrite: bool = False) -> None:
    """Write `model` as the Hub family `family` (default: the one that holds it) in `dtype` (default: the
    model's). A model from from_pretrained keeps its source config's other fields (token ids, ...).
    A folder holding weights already is refused unless `overwrite` (see files.write_hub_directory).
    Collective when `groups` splits experts: call it on every rank."""
    gpt, moe = model.config, model.moe_config
    family = FAMILIES[family] if isinstance(family, str) else family or family_for(gpt, moe)
    family.check_expressible(gpt, moe)
    dtype = dtype or model.embedding.weight.dtype
    tensors = _hub_tensors(model, links(family, gpt, moe), groups, dtype, optimizer, family)
    failure = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        config = dict(getattr(model, "hub_config", None) or {})   # token ids and the like of the source
        config.pop("quantization_config", None)   # the tensors written are dense (an FP8 source's dequantized)
        config.update(family.hf_config(gpt, moe, str(dtype).replace("torch.", "")))
        try:
            write_hub_directory(path, config, tensors, max_shard_bytes, overwrite)
        except OSError as exc:
            failure = exc
    _raise_on_every_rank(failure, path)


def _raise_on_every_rank(failure: Optional[BaseException], path: str) -> None:
    """Rank 0's write failing is every rank's error (a barrier would leave the others waiting forever)."""
    if dist.is_initialized():
        failed = torch.tensor([float(failure is not None)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and failure is None:
            raise OSError(f"save_pretrained: rank 0 could not write {path} (its error says why)")
    if failure is not None:
        raise failure


def _hub_tensors(model: GPTModel, table, groups, dtype, optimizer, family: Family) -> Dict[str, torch.Tensor]:
    """{Hub key: tensor} in `dtype`, but at least fp32 where transformers keeps fp32 (DeepSeek's router)."""
    gathered = optimizer.full_parameters() if optimizer is not None else contextlib.nullcontext()
    wide = torch.promote_types(dtype, torch.float32)
    tensors: Dict[str, torch.Tensor] = {}
    with gathered, torch.no_grad():
        for name, param in model_tensors(model, table).items():
            whole = _all_experts(name, param, groups).detach().to(device="cpu")
            tensors.update({key: t.to(wide if family.keeps_fp32(key) else dtype).clone()
                            for key, t in table[name].split(whole).items()})
    return tensors


def _all_experts(name: str, param: torch.Tensor, groups: Optional[ParallelGroups]) -> torch.Tensor:
    """A routed-expert stack with every ep rank's experts (others as they are)."""
    shard = expert_shard_of(param)
    if shard is None or shard.ep_size == 1:
        return param
    if groups is None or groups.ep_size != shard.ep_size:
        raise ValueError(f"{name} holds {shard.num_local_experts} of {shard.num_global_experts} experts: pass the "
                         f"ParallelGroups the model was built with")
    out = param.new_empty((shard.num_global_experts,) + tuple(param.shape[1:]))
    comm.all_gather(out, param.detach().contiguous(), groups.ep)
    return out
