"""moezero.hf.save_pretrained: a Hugging Face model directory from a live moezero GPTModel.

Any layout, and no rank ever holds the whole model: every rank writes its share of the tensors into files of its
own (see `write_plan`), a routed-expert stack by one of the ranks holding those experts, and rank 0 adds the
index and config once all wrote. At ZeRO stage 3 pass the optimizer: it gathers one unit at a time while the
tensors are read.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from moezero.hf.defaults import attribute_aliases
from moezero.hf.families import FAMILIES, Family, UnsupportedModel, family_for
from moezero.hf.keys import Link, links
from moezero.hf.load import model_tensors
from moezero.hf.run_tokenizer import NO_TOKEN_IDS, TOKENIZER_FILES
from moezero.hf.staged_write import abandon_write, finish_write, start_write, write_shard
from moezero.hf.write_plan import Piece, WritePlan, plan_writes
from moezero.models import GPTModel
from moezero.parallel import ParallelGroups
from moezero.pipeline.stage_groups import PipelineGroups
from moezero.deferred_values import read_values, values_source
from moezero.parallel.expert_marker import expert_shard_of
from moezero.parallel.tensor_marker import tensor_shard_of
from moezero.hf.slice_gather import gather_slices, group_ranks

# the tensors whose rows are the vocabulary
VOCABULARY = ("embedding.weight", "output.weight")


def save_pretrained(
    model: GPTModel,
    path: str,
    groups: Optional[ParallelGroups] = None,
    family: Union[str, Family, None] = None,
    dtype: Optional[torch.dtype] = None,
    optimizer: Optional[Any] = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    token_ids: Optional[Dict[str, Optional[int]]] = None,
    tokenizer_files: Optional[Dict[str, str]] = None,
    vocab_size: Optional[int] = None,
) -> None:
    """Write `model` as a Hugging Face Hub folder. Collective under torch.distributed: call it on every rank.

    A model from from_pretrained keeps its source config's other fields (token ids, ...) and its
    generation_config.json; one with no source names the tokens `token_ids` gives, else none (never the family's
    defaults), and so does one whose source's end of document is not the run's (its run trained with another
    tokenizer than the source folder's). A source config that would read back as another model (another model's
    sliding window, ...) is refused.

    Args:
        model: the GPTModel to write.
        path: the folder to write; one holding weights already is refused unless `overwrite`.
        groups: the process groups the model was built with (default: a world of one); a pipeline rank's
            PipelineGroups for a StageModel, whose tensors are then written by the ranks of their stage.
        family: the Hub family (a name of `FAMILIES` or a Family; default: the one that holds the model).
        dtype: the dtype of the written tensors (default: the model's).
        optimizer: the ZeroOptimizer of the model: its params are read unit by unit through it (at stage 3 each
            gathered in turn); without one the model's tensors are read as they are.
        max_shard_bytes: the largest safetensors file (Hugging Face's 5 GiB by default).
        overwrite: replace the weights of a folder that holds some (see `staged_write.start_write`).
        token_ids: the token ids of a model with no source folder (`run_tokenizer.tokenizer_token_ids` of its
            run).
        tokenizer_files: {name: path} of tokenizer files copied in with the weights (`run_tokenizer_files`).
        vocab_size: the Hub model's vocabulary (default: the model's): the embedding's and output layer's rows
            after it are not written (the padding of a run at tp > 1 beyond what the same run pads at tp 1).
    """
    gpt, moe = model.config, model.moe_config
    if vocab_size is not None:
        if not 0 < vocab_size <= gpt.vocab_size:
            raise ValueError(f"vocab_size={vocab_size}: the model's vocabulary has {gpt.vocab_size} rows")
        gpt = dataclasses.replace(gpt, vocab_size=vocab_size)
    if isinstance(family, str) and family not in FAMILIES:
        raise UnsupportedModel(f"family {family!r}: no such Hugging Face family (one of {', '.join(FAMILIES)})")
    family = FAMILIES[family] if isinstance(family, str) else family or family_for(gpt, moe)
    family.check_expressible(gpt, moe)
    if _rank() == 0:
        _warn_of_routing_transformers_lacks(moe, family)
    dtype = dtype or _model_dtype(model, groups)
    config = _hub_config(model, gpt, family, dtype, token_ids)
    generation = _generation_config(model, token_ids)
    table = links(family, gpt, moe)
    tensors = model_tensors(model, table)
    layout = _HubLayout(table, family, dtype, groups, gpt.vocab_size)
    plan = plan_writes(layout.pieces(tensors), _world_size(), max_shard_bytes)
    staging = _agreed_staging(path, overwrite)
    files = _ShareWriter(staging, plan.files(_rank()))
    layout.read_own_tensors(tensors, plan, optimizer, files.add)
    _raise_on_every_rank(files.finish(), path, staging)
    failure = None
    if _rank() == 0:
        try:
            finish_write(
                staging, path, config, plan.file_of, layout.total_bytes, generation, tokenizer_files, TOKENIZER_FILES
            )
        except OSError as exc:
            failure = exc
    _raise_on_every_rank(failure, path, None)


class _HubLayout:
    """The Hub tensors of a model: which pieces there are, their bytes, and this rank's values of its own.

    A tensor-parallel slice (tp's, or an expert stack's etp's) is written as its global tensor: the ranks of the
    writer's tp (etp) group gather that one tensor (slice_gather.py), and the writer keeps it; the vocabulary's
    rows after `vocab_size` are left out."""

    def __init__(
        self,
        table: Dict[str, Link],
        family: Family,
        dtype: torch.dtype,
        groups: Optional[ParallelGroups],
        vocab_size: int,
    ):
        self.table, self.family, self.dtype, self.groups = table, family, dtype, groups
        self.vocab_size = vocab_size
        self.total_bytes = 0

    def dtype_of(self, key: str) -> torch.dtype:
        """`dtype`, but at least fp32 where transformers keeps fp32 (DeepSeek's router)."""
        return torch.promote_types(self.dtype, torch.float32) if self.family.keeps_fp32(key) else self.dtype

    def pieces(self, tensors: Dict[str, torch.Tensor]) -> List[Piece]:
        """Every piece of the model, with the ranks holding it (at pp > 1 a collective over the world)."""
        if isinstance(self.groups, PipelineGroups):
            out = self._every_stage_pieces(tensors)
        else:
            everyone = tuple(range(_world_size()))
            out = [
                self._piece(name, tensor, first, count, holders)
                for name, tensor in tensors.items()
                for first, count, holders in self._blocks(name, tensor, everyone)
            ]
        self.total_bytes = sum(piece.nbytes for piece in out)
        return out

    def _hub_shape(self, name: str, tensor: torch.Tensor) -> Tuple[int, ...]:
        """The shape of the tensor written for `tensor`: a slice's global one, the vocabulary's rows cut."""
        slices = tensor_shard_of(tensor)
        shape = slices.global_shape if slices is not None else tuple(tensor.shape)
        return (self.vocab_size,) + tuple(shape[1:]) if name in VOCABULARY else shape

    def _piece(self, name: str, tensor: torch.Tensor, first: Optional[int], count: Optional[int], holders) -> Piece:
        shape = self._hub_shape(name, tensor)
        shape = (count,) + shape[1:] if first is not None else shape
        parts = self.table[name].split(torch.empty(shape, device="meta"), first_expert=first or 0)
        keys = tuple((key, t.numel() * self.dtype_of(key).itemsize) for key, t in parts.items())
        return Piece(_piece_name(name, first), holders, keys)

    def _every_stage_pieces(self, tensors: Dict[str, torch.Tensor]) -> List[Piece]:
        """A pipeline rank holds its stages' tensors only: each rank lists its own pieces, and every rank merges
        the lists (rank order), a piece's holders the ranks that listed it (its stage's, of its experts' block)."""
        rank = _rank()
        own = [
            self._piece(name, tensor, first, count, (rank,))
            for name, tensor in tensors.items()
            for first, count, _ in self._blocks(name, tensor, (rank,), self.groups.stage)
        ]
        every: List[List[Piece]] = [[] for _ in range(_world_size())]
        dist.all_gather_object(every, own)
        merged: Dict[str, Piece] = {}
        for pieces in every:
            for piece in pieces:
                seen = merged.get(piece.name)
                merged[piece.name] = (
                    piece if seen is None else dataclasses.replace(seen, holders=seen.holders + piece.holders)
                )
        return list(merged.values())

    def _blocks(self, name: str, tensor: torch.Tensor, everyone, stage: Optional[ParallelGroups] = None):
        """(first global expert, experts, ranks holding them) of each block of an expert-parallel stack; one
        (None, None, every rank) for any other tensor. With `stage` (a pipeline rank's stage groups): this rank's
        block only, held by `everyone` (the rank)."""
        shard = expert_shard_of(tensor)
        if shard is None or shard.ep_size == 1:
            return [(None, None, everyone)]
        if self.table[name].stacked:
            raise UnsupportedModel(
                f"{self.family.model_type} holds all experts of a layer in one tensor "
                f"({self.table[name].keys[0]}), which no rank of an ep {shard.ep_size} layout "
                "holds whole: save from an ep 1 layout, or export a checkpoint with "
                "tools/hf_checkpoint.py export"
            )
        groups = stage if stage is not None else self.groups
        if groups is None or groups.ep_size != shard.ep_size:
            raise ValueError(
                f"{name} holds {shard.num_local_experts} of {shard.num_global_experts} experts: pass the "
                "ParallelGroups the model was built with"
            )
        n = shard.num_local_experts
        if stage is not None:
            return [(shard.first_global_expert, n, everyone)]
        return [(j * n, n, self.groups.layout.edp_groups[j]) for j in range(shard.ep_size)]

    def read_own_tensors(
        self,
        tensors: Dict[str, torch.Tensor],
        plan: WritePlan,
        optimizer: Optional[Any],
        put: Callable[[str, torch.Tensor], None],
    ) -> None:
        """put(Hub key, tensor) for each tensor this rank writes, read unit by unit (collective at stage 3)."""
        rank = _rank()
        waiting = dict(tensors)
        units: Iterable[List[torch.Tensor]] = optimizer.params_unit_by_unit() if optimizer is not None else []
        with torch.no_grad():
            for held in units:
                ids = {id(p) for p in held}
                for name in [n for n, t in waiting.items() if id(t) in ids]:
                    self._take(name, waiting.pop(name), plan, rank, put)
            for name, tensor in waiting.items():  # buffers, params outside the optimizer (or no optimizer)
                self._take(name, tensor, plan, rank, put)

    def _take(self, name: str, tensor: torch.Tensor, plan: WritePlan, rank: int, put) -> None:
        shard = expert_shard_of(tensor)
        first = shard.first_global_expert if shard is not None and shard.ep_size > 1 else None
        writer = plan.writer[_piece_name(name, first)]
        slices = tensor_shard_of(tensor)
        if slices is not None:  # the writer's group gathers the tensor
            group = self._slice_group(shard is not None)
            if writer not in group_ranks(group):
                return
            tensor = gather_slices(tensor, slices, group)
        if writer != rank:
            return
        link = self.table[name]
        for start, value in _values(tensor, per_expert=link.per_expert and not link.stacked):
            if name in VOCABULARY:
                value = value[: self.vocab_size]
            for key, part in link.split(value, first_expert=(first or 0) + start).items():
                put(key, part.to(dtype=self.dtype_of(key), memory_format=torch.contiguous_format, copy=True))

    def _slice_group(self, expert: bool) -> Any:
        """The group holding the slices of a tensor-parallel param: the experts' etp group, else the tp group."""
        groups = self.groups.stage if isinstance(self.groups, PipelineGroups) else self.groups
        group = (groups.etp if expert else groups.tp) if groups is not None else None
        if group is None:
            raise ValueError("a tensor-parallel model: pass the ParallelGroups it was built with")
        return group


def _values(tensor: torch.Tensor, per_expert: bool) -> Iterator[Tuple[int, torch.Tensor]]:
    """(first expert, values) of a tensor: itself, or for one whose values are still on disk (an export
    from a checkpoint) read as needed, an expert stack one expert at a time."""
    if values_source(tensor) is None:
        yield 0, tensor.detach().to(device="cpu")
    elif not per_expert:
        yield 0, read_values(tensor, 0, tensor.numel()).view(tensor.shape)
    else:
        size = tensor[0].numel()
        for e in range(tensor.shape[0]):
            yield e, read_values(tensor, e * size, (e + 1) * size).view((1,) + tuple(tensor.shape[1:]))


class _ShareWriter:
    """This rank's files, each written once its tensors are all there (so it holds about one file at a time);
    the first failed write is kept (the reading goes on: at stage 3 it is collective)."""

    def __init__(self, staging: str, files: List[Tuple[str, List[str]]]):
        self.staging = staging
        self.file_of = {key: name for name, keys in files for key in keys}
        self.missing = {name: len(keys) for name, keys in files}
        self.ready: Dict[str, Dict[str, torch.Tensor]] = {}
        self.failure: Optional[OSError] = None

    def add(self, key: str, tensor: torch.Tensor) -> None:
        name = self.file_of[key]
        self.ready.setdefault(name, {})[key] = tensor
        self.missing[name] -= 1
        if self.missing[name] == 0:
            tensors = self.ready.pop(name)
            if self.failure is None:
                try:
                    write_shard(self.staging, name, tensors)
                except OSError as exc:
                    self.failure = exc

    def finish(self) -> Optional[OSError]:
        unwritten = [name for name, count in self.missing.items() if count]
        if unwritten and self.failure is None:
            raise RuntimeError(f"save_pretrained: no values came for {unwritten[0]} (a bug)")
        return self.failure


def _model_dtype(model: GPTModel, groups: Optional[Any]) -> torch.dtype:
    """The word embedding's dtype; at pp > 1 rank 0's (it holds the first stage in either rank order)."""
    if not isinstance(groups, PipelineGroups):
        return model.embedding.weight.dtype
    box = [model.embedding.weight.dtype if model.embedding is not None else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _piece_name(name: str, first_expert: Optional[int]) -> str:
    return name if first_expert is None else f"{name}@experts{first_expert}"


def _hub_config(
    model: GPTModel, gpt, family: Family, dtype: torch.dtype, token_ids: Optional[Dict[str, Optional[int]]]
) -> Dict:
    source = getattr(model, "hub_config", None)
    # token ids and the like of the source (what it omits keeps its class default); with none, or a source whose
    # tokens are another tokenizer's than the run's, the run's tokens
    config = dict(source or {})
    if not source or _other_tokens(source, token_ids):
        config.update(token_ids or NO_TOKEN_IDS)
    config.pop("quantization_config", None)  # the tensors written are dense (an FP8 source's dequantized)
    config.pop("auto_map", None)  # the folder holds no remote code: transformers' own class of the family runs it
    # the family writes rope_parameters; a source's rope_scaling would come first in transformers' reading
    for stale in ("rope_scaling", "original_max_position_embeddings"):
        config.pop(stale, None)
    written = family.hf_config(gpt, model.moe_config, str(dtype).replace("torch.", ""))
    for alias, attribute in attribute_aliases(family).items():  # a source's other name of a field written
        for name, other in ((alias, attribute), (attribute, alias)):  # would be the one transformers reads
            if name in written:
                config.pop(other, None)
    config.update(written)
    problem = next(family.config_differences(config, gpt, model.moe_config), None)
    if problem:
        raise UnsupportedModel(
            "the Hub config whose other fields the export keeps (--hf-config, or the model's "
            f"source) describes another model than this one: {problem}; export with a config of "
            "this model, or none"
        )
    return config


def _other_tokens(source: Dict, token_ids: Optional[Dict[str, Optional[int]]]) -> bool:
    """Whether a source config's token ids are another tokenizer's than the run's `token_ids`: its eos (one id or
    several) does not hold the run's end of document (a run of a folder without a tokenizer, on the command
    line's)."""
    eod = (token_ids or {}).get("eos_token_id")
    if eod is None:  # the run's tokenizer is unknown here: the source's stay
        return False
    eos = source.get("eos_token_id")
    return eod not in (eos if isinstance(eos, list) else [eos])


def _generation_config(model: GPTModel, token_ids: Optional[Dict[str, Optional[int]]]) -> Optional[Dict]:
    """The source's generation config, with the run's token ids where the source's are another tokenizer's."""
    generation = getattr(model, "hub_generation_config", None)
    source = getattr(model, "hub_config", None)
    if generation is None or not source or not _other_tokens(source, token_ids):
        return generation
    return {**generation, **{k: v for k, v in token_ids.items() if k in generation or v is not None}}


def _warn_of_routing_transformers_lacks(moe, family: Family) -> None:
    """Routing the run did that transformers' model does not (the weights are the same; the outputs differ)."""
    if moe is not None and moe.capacity_factor is not None:
        warnings.warn(
            f"the model routes with an expert capacity factor ({moe.capacity_factor:g}: tokens over an "
            f"expert's capacity are dropped); transformers' {family.architecture} routes every token, so "
            "its outputs differ wherever this model drops tokens"
        )
    if moe is not None and moe.force_load_balancing:
        warnings.warn(
            "the model routes by random logits (--moe-router-force-load-balancing); transformers' "
            f"{family.architecture} routes by the trained router, so its outputs differ"
        )


def _agreed_staging(path: str, overwrite: bool) -> str:
    """Rank 0's staging folder, known to every rank; its refusal (a folder with weights) raised on every rank."""
    staging, failure = None, None
    if _rank() == 0:
        try:
            staging = start_write(path, overwrite)
        except OSError as exc:
            failure = exc
    if dist.is_initialized():
        box = [staging]
        dist.broadcast_object_list(box, src=0)
        staging = box[0]
    _raise_on_every_rank(failure, path, None)
    return staging


def _raise_on_every_rank(failure: Optional[BaseException], path: str, staging: Optional[str]) -> None:
    """Any rank's failed write is every rank's error (a barrier would leave the others waiting forever); the
    staging folder goes."""
    failed = [failure is not None]
    if dist.is_initialized():
        failed = [None] * dist.get_world_size()
        dist.all_gather_object(failed, failure is not None)
    if not any(failed):
        return
    if staging is not None and _rank() == 0:
        abandon_write(staging)
    if failure is not None:
        raise failure
    raise OSError(f"save_pretrained: rank {failed.index(True)} could not write {path} (its error says why)")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
