"""moezero.hf.from_pretrained: a moezero GPTModel from a Hugging Face model directory.

With `groups`, the MoE layers hold this rank's experts only and only their tensors are read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from typing import Dict, Optional, Set, Tuple

import torch

from moezero.config import GPTConfig, MoEConfig
from moezero.hf.families import family_of, mtp_layers
from moezero.hf.files import CheckpointMismatch, HubDirectory
from moezero.hf.folder_tokenizer import folder_tokenizer_fields
from moezero.hf.keys import Link, links
from moezero.models import GPTModel
from moezero.moe import MoELayer, expert_parallel
from moezero.parallel import ParallelGroups
from moezero.deferred_values import allocate, defer_values, values_source
from moezero.parallel.expert_marker import expert_shard_of
from moezero.parallel.tensor_marker import tensor_shard_of
from moezero.hf.shard_reads import read_shard_range

# Hub tensors that are not weights of the model (older checkpoints stored RoPE's table)
_NOT_WEIGHTS = re.compile(r"rotary_emb\.inv_freq$")


def from_pretrained(
    path: str,
    dtype: Optional[torch.dtype] = None,
    groups: Optional[ParallelGroups] = None,
    seed: int = 0,
    lazy: bool = False,
) -> GPTModel:
    """The model of the Hub directory `path` in `dtype` (default: the config's), evaluation mode.

    The files' tensors (names, and shapes from the safetensors headers) are checked against the model the config
    describes before any of it is allocated: a config that leaves its sizes to the class defaults (a 20B model)
    beside files of another model is refused at once, not after allocating the default-size model.

    `model(tokens)[0]` are the logits.

    Args:
        path: a Hub model folder (config.json and safetensors files) of a family moezero holds.
        dtype: the params' dtype (default: the config's torch_dtype).
        groups: the process groups; experts are split over `groups.ep` and a rank reads only its own
            (default: a world of one).
        seed: the GPTModel's seed: keys its layout-invariant init (which the files' weights replace) and the
            randomness keyed from it.
        lazy: the params other than expert stacks stay unread (on the meta device) until a ZeroOptimizer
            stores them: at stage 3 a rank then reads only its shard of each; the model runs after that.

    Returns:
        The GPTModel, in evaluation mode.
    """
    hub = HubDirectory(path)
    family = family_of(hub.config)
    gpt, moe = hub_configs(hub)
    factory = expert_parallel(groups) if groups is not None else MoELayer
    table = links(family, gpt, moe)
    dtype = dtype or hub_dtype(hub.config)
    check_key_sets(hub, table, moe.num_experts if moe else 0, tied=not gpt.untie_embeddings_and_output_weights)
    if not lazy:  # the shapes too, of a model without storage, before the one with storage is built
        with torch.device("meta"):
            check_hub_shapes(hub, table, model_tensors(GPTModel(gpt, moe, seed=seed, moe_layer=factory), table))
    with torch.device("meta") if lazy else contextlib.nullcontext():
        model = GPTModel(gpt, moe, seed=seed, moe_layer=factory)
    model.to(dtype)
    _keep_fp32(model, family, table)
    load_weights(model, hub, table, lazy)
    if lazy:
        _refuse_forward_until_read(model)
    model.hub_config = hub.config  # save_pretrained keeps what moezero's configs do not hold (token ids)
    model.hub_generation_config = hub.generation_config
    return model.eval()


def run_configs(path: str) -> Dict[str, Dict]:
    """The configs a training run takes from the Hub directory `path` (what `tools/hf_checkpoint.py import`
    stores, what --load-hf applies): its model and MoE configs, the Hub config itself and its generation config
    (an export writes them back), and its tokenizer (checked readable: see folder_tokenizer)."""
    hub = HubDirectory(path)
    gpt, moe = hub_configs(hub)
    # the tensors' names now (a glance at the index or headers): a run or import of a folder that does not hold the
    # config's model stops before it creates anything
    check_key_sets(
        hub,
        links(family_of(hub.config), gpt, moe),
        moe.num_experts if moe else 0,
        tied=not gpt.untie_embeddings_and_output_weights,
    )
    configs = {"model": dataclasses.asdict(gpt), "moe": dataclasses.asdict(moe or MoEConfig()), "hf": hub.config}
    if hub.generation_config is not None:
        configs["hf_generation"] = hub.generation_config
    tokenizer = folder_tokenizer_fields(path)
    if tokenizer is not None:
        configs["data"] = tokenizer
    return configs


def load_hub_weights(model: GPTModel, path: str, whole: bool = True) -> None:
    """The weights of the Hub directory `path` into `model`, built (on the meta device) from its `run_configs`
    as a training run's: this rank's experts are read now, every other param is left to the ZeroOptimizer,
    which reads only what the rank keeps (at stage 3 its shard). `whole=False`: `model` is a part of the configs'
    model under its names (a pipeline rank's stages), which reads the tensors of its own params only."""
    hub = HubDirectory(path)
    load_weights(model, hub, links(family_of(hub.config), model.config, model.moe_config), lazy=True, whole=whole)
    _refuse_forward_until_read(model)
    model.hub_config = hub.config
    model.hub_generation_config = hub.generation_config


def _keep_fp32(model: GPTModel, family, table: Dict[str, Link]) -> None:
    """The params transformers keeps in fp32 whatever the model's dtype (DeepSeek's router) stay fp32 here too."""
    with torch.no_grad():
        for name, param in model_tensors(model, table).items():
            if family.keeps_fp32(table[name].keys[0]) and param.dtype in (torch.bfloat16, torch.float16):
                param.data = param.data.float()


def hub_configs(hub: HubDirectory) -> Tuple[GPTConfig, MoEConfig]:
    """moezero's (GPTConfig, MoEConfig) of a Hub directory's model."""
    gpt, moe = family_of(hub.config).configs(hub.config)
    if not gpt.untie_embeddings_and_output_weights and _holds_its_own_head(hub):
        warnings.warn(
            f"{hub.path}: the config ties the output layer to the embedding but the files hold a "
            "different lm_head.weight: it is used untied, as transformers does"
        )
        gpt = dataclasses.replace(gpt, untie_embeddings_and_output_weights=True)
    if gpt.mtp_num_layers and not _holds_mtp_layers(hub, gpt.num_layers):
        if "num_nextn_predict_layers" in hub.config or "num_mtp_layers" in hub.config:
            warnings.warn(
                f"{hub.path}: the config gives {gpt.mtp_num_layers} multi-token-prediction layer(s) but the "
                f"files hold no model.layers.{gpt.num_layers}.* (transformers does not save them): the "
                "model has none"
            )
        gpt = dataclasses.replace(gpt, mtp_num_layers=None)
    return gpt, moe


def _holds_mtp_layers(hub: HubDirectory, num_layers: int) -> bool:
    """Whether the files hold the first MTP layer (Hub layer `num_layers`), as DeepSeek's and GLM's own do."""
    prefix = f"model.layers.{num_layers}."
    return any(key.startswith(prefix) for key in hub.keys())


def _holds_its_own_head(hub: HubDirectory) -> bool:
    """A tied config whose files hold an lm_head.weight unlike the embedding: transformers then leaves the two
    untied (and warns)."""
    keys = set(hub.keys())
    if "lm_head.weight" not in keys or "model.embed_tokens.weight" not in keys:
        return False
    return not torch.equal(hub.read("lm_head.weight"), hub.read("model.embed_tokens.weight"))


# the dtypes a Hub folder's weights are written in (transformers' spelling in config.json)
HUB_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def hub_dtype(config: Dict) -> torch.dtype:
    """The dtype a Hub config names (`dtype`, or transformers 4's `torch_dtype`; float32 where it names none)."""
    field = "dtype" if config.get("dtype") else "torch_dtype"
    name = config.get(field) or "float32"
    dtype = HUB_DTYPES.get(str(name).replace("torch.", ""))
    if dtype is None:
        raise CheckpointMismatch(
            f"config.json {field} {name!r} is not a dtype Hub weights are written in (one of "
            f"{', '.join(HUB_DTYPES)}): correct the config"
        )
    return dtype


def load_weights(
    model: GPTModel, hub: HubDirectory, table: Dict[str, Link], lazy: bool = False, whole: bool = True
) -> None:
    """Every parameter of `model` from the Hub tensors its Link names (this rank's experts of a stack); with
    `lazy`, the params other than expert stacks are deferred to their readers instead. Names and shapes are
    checked first (the headers only), so a model on the meta device is allocated only for files that hold it.
    `whole=False`: `model` holds a part of the table's params (a pipeline rank's stages); the files must still
    hold the whole model."""
    check_key_sets(
        hub,
        table,
        model.moe_config.num_experts if model.moe_config else 0,
        tied=not model.config.untie_embeddings_and_output_weights,
    )
    params = model_tensors(model, table)
    if not whole:
        table = {name: link for name, link in table.items() if name in params}
    if set(params) != set(table):
        raise CheckpointMismatch(
            f"{hub.path}: moezero's model and the key table differ: {sorted(set(params) ^ set(table))[:5]}"
        )
    check_hub_shapes(hub, table, params)
    _materialize_buffers(model)
    with torch.no_grad():
        for name, param in params.items():
            shard = expert_shard_of(param)
            if lazy and shard is None and isinstance(param, torch.nn.Parameter):
                _defer(name, param, table[name], hub)
                continue
            if param.device.type == "meta":
                allocate(param)
            experts = (
                range(shard.first_global_expert, shard.first_global_expert + shard.num_local_experts)
                if shard
                else range(0)
            )
            link, tensor_shard = table[name], tensor_shard_of(param)
            if shard and tensor_shard is not None and not link.stacked:  # expert tp: each expert's slice alone
                value = link.assemble_slices(hub, experts, tensor_shard.item_shard())
            else:
                value = link.assemble(hub, experts)
            if tensor_shard is not None and tuple(value.shape) == global_shape(param):
                value = tensor_shard.local_of(value)  # the rank's slice of the global tensor
            if value.shape != param.shape:
                raise CheckpointMismatch(
                    f"{hub.file_of(table[name].keys[0])}: {name} is {tuple(param.shape)} in the "
                    f"model its config describes, {tuple(value.shape)} from "
                    f"{table[name].keys[0]}"
                )
            param.copy_(value.to(param.dtype))


def _defer(name: str, param: torch.nn.Parameter, link: Link, hub: HubDirectory) -> None:
    shard = tensor_shard_of(param)
    if shard is not None:  # a tensor-parallel slice: exactly its elements of the global tensor
        defer_values(param, lambda lo, hi: read_shard_range(link, hub, shard, lo, hi))
        return
    shape = tuple(param.shape)
    defer_values(param, lambda lo, hi: link.read_range(hub, lo, hi, shape))


def global_shape(param: torch.Tensor) -> Tuple[int, ...]:
    """The shape of the tensor `param` is (a tensor-parallel shard's: the global one) as the Hub files hold it."""
    shard = tensor_shard_of(param)
    return shard.global_shape if shard is not None else tuple(param.shape)


def check_hub_shapes(hub: HubDirectory, table: Dict[str, Link], params: Dict[str, torch.Tensor]) -> None:
    """Each param's Hub tensors (an expert stack's: expert 0's) have its shape (a tensor-parallel shard's: its
    global shape), read from the files' headers."""
    for name, param in params.items():
        link, param_shape = table[name], global_shape(param)
        if link.stacked:  # the Hub tensor holds every expert, each as moezero's
            shape, expected = hub.shape(link.keys[0])[1:], param_shape[1:]
            if shape != expected:
                raise CheckpointMismatch(
                    f"{hub.file_of(link.keys[0])}: {name} holds experts of "
                    f"{param_shape[1:]} in the model its config describes, "
                    f"{shape} in {link.keys[0]}"
                )
            continue
        keys = [key.format(e=0) for key in link.keys] if link.per_expert else list(link.keys)
        shapes = [hub.shape(key) for key in keys]
        shape = (sum(s[0] for s in shapes),) + tuple(shapes[0][1:])
        expected = param_shape[1:][::-1] if link.per_expert else param_shape
        if shape != expected:
            raise CheckpointMismatch(
                f"{hub.file_of(keys[0])}: {name} is {param_shape} in the model its "
                f"config describes, {shape} from {keys[0]}"
            )


class ParamsNotRead(RuntimeError):
    """A lazily loaded model ran before an optimizer read its params."""


def _refuse_forward_until_read(model: GPTModel) -> None:
    """A forward pre-hook naming the cause, instead of torch's device error on the meta params; it removes
    itself at the first forward that finds every param read (one scan, not one per step)."""

    def check(module, args):
        deferred = [name for name, p in module.named_parameters() if values_source(p) is not None]
        if deferred:
            raise ParamsNotRead(
                f"{len(deferred)} params of this model (e.g. {deferred[0]}) are not read yet: "
                "from_pretrained(lazy=True) leaves them to the ZeroOptimizer; build it first "
                "(or load without lazy)"
            )
        handle.remove()

    handle = model.register_forward_pre_hook(check)


def _materialize_buffers(model: GPTModel) -> None:
    """Buffers a meta-device build left without storage get their init (zeros: the routers' expert bias)."""
    for buffer in model.buffers():
        if buffer.device.type == "meta":
            allocate(buffer)
            buffer.zero_()


def _multi_token_prediction_keys(hub: HubDirectory, unexpected: Set[str]) -> Set[str]:
    """DeepSeek-V3's MTP modules: layers numbered from num_hidden_layers, num_nextn_predict_layers of them."""
    config = hub.config
    first, count = config.get("num_hidden_layers"), mtp_layers(config) or 0
    if not count or first is None:  # (a config leaving its depth to the class default names no MTP layer either)
        return set()
    pattern = re.compile(r"^model\.layers\.(\d+)\.")
    return {k for k in unexpected if (m := pattern.match(k)) and first <= int(m.group(1)) < first + count}


def model_tensors(model: GPTModel, table: Dict[str, Link]) -> Dict[str, torch.Tensor]:
    """The model's parameters and the buffers the checkpoint holds too (the expert bias)."""
    tensors = dict(model.named_parameters())
    tensors.update({name: b for name, b in model.named_buffers() if name in table})
    return tensors


def check_key_sets(hub: HubDirectory, table: Dict[str, Link], num_experts: int, tied: bool) -> None:
    expected = {key for link in table.values() for key in link.hub_keys(num_experts)}
    copies = {key for link in table.values() for key in link.copies}
    present = set(hub.keys())
    missing = sorted(expected - present)
    scales = {k for k in present if k.endswith("_scale_inv") and k[: -len("_scale_inv")] in expected}
    unexpected = present - expected - copies - scales
    mtp = _multi_token_prediction_keys(hub, unexpected)
    if mtp:
        warnings.warn(
            f"{hub.path}: skipping the multi-token-prediction layer stored after the last layer "
            f"({len(mtp)} tensors): this model has no MTP layers (--mtp-num-layers)"
        )
    extra = sorted(k for k in unexpected - mtp if not _NOT_WEIGHTS.search(k) and not (tied and k == "lm_head.weight"))
    if missing or extra:
        raise CheckpointMismatch(
            f"{hub.path}: tensors missing for the config's model: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; tensors the model has no place for: "
            f"{extra[:5]}{' ...' if len(extra) > 5 else ''}"
        )
