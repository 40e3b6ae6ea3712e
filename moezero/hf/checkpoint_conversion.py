"""Hub folders to moezero training checkpoints and back, one piece at a time (tools/hf_checkpoint.py).

    import_hub(hf_dir, ckpt_dir)                       # iteration 0 of ckpt_dir
    export_checkpoint(ckpt, hf_dir, dtype=..., ...)    # a Hub folder of the checkpoint's fp32 masters

Neither builds the model in memory: the model exists on the meta device (names and shapes), the import reads
each piece of at most `piece_bytes` from the Hub files as DCP writes it, the export reads each param (an expert
stack one expert at a time) from the checkpoint as its Hub file is filled. The peak is about one Hub shard file
plus one piece, whatever the model's size.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch

from moezero import checkpoint
from moezero.checkpoint import CheckpointError
from moezero.compression.targets import canonical_name
from moezero.config import GPTConfig, MoEConfig, upgrade_stored_configs
from moezero.hf.families import family_of
from moezero.hf.files import HubDirectory
from moezero.hf.keys import Link, links
from moezero.hf.load import check_hub_shapes, hub_configs, hub_dtype, run_configs
from moezero.hf.save import save_pretrained
from moezero.hf.run_tokenizer import run_token_ids, run_tokenizer_files
from moezero.models import GPTModel
from moezero.deferred_values import allocate, defer_values

PIECE_BYTES = 1 << 30


def import_hub(hf_dir: str, ckpt_dir: str, piece_bytes: int = PIECE_BYTES) -> str:
    """Iteration 0 of `ckpt_dir` from the Hub folder: fp32 masters, fresh optimizer state, the configs
    (`run_configs`), so `--load ckpt_dir --use-checkpoint-args --finetune` continues it with no model flag typed."""
    saved = checkpoint.saved_iterations(ckpt_dir)
    if saved or os.path.exists(os.path.join(ckpt_dir, checkpoint.POINTER)):
        raise CheckpointError(
            f"{ckpt_dir}: holds a run's checkpoints (iterations {', '.join(map(str, saved))}); "
            "import into a new folder (the import is iteration 0 and would become latest)"
        )
    hub = HubDirectory(hf_dir)
    hub_dtype(hub.config)  # the dtype an export writes by default: a name it cannot write is refused now
    configs = run_configs(hf_dir)  # the tensors' names and the tokenizer checked, before a model is built
    gpt, moe = hub_configs(hub)
    table = links(family_of(hub.config), gpt, moe)
    with torch.device("meta"):
        model = GPTModel(gpt, moe)
    params = dict(model.named_parameters())
    check_hub_shapes(hub, table, params)
    reader = _HubPieces(hub, table, {name: tuple(p.shape) for name, p in params.items()})
    kept = set(model.state_dict())  # the persistent buffers, as a training save writes them
    buffers = {
        name: table[name].assemble(hub).float() if name in table else torch.zeros(b.shape, dtype=b.dtype)
        for name, b in model.named_buffers()
        if name in kept
    }
    train_state = {
        "param_shapes": reader.shapes,
        "optimizer": _fresh_adamw_scalars(),
        "configs": configs,
        "plugins": {},
        "progress": {},
        "opt_param_scheduler": {},
    }
    ranges = {name: reader.pieces(name, piece_bytes) for name in params}
    return checkpoint.save_read_checkpoint(ckpt_dir, 0, ranges, reader.read, buffers, train_state)


class _HubPieces:
    """Flat fp32 ranges of moezero params read from Hub files: rows of a tensor, whole experts of a stack."""

    def __init__(self, hub: HubDirectory, table: Dict[str, Link], shapes: Dict[str, Tuple[int, ...]]):
        self.hub, self.table, self.shapes = hub, table, shapes

    def pieces(self, name: str, piece_bytes: int) -> List[Tuple[int, int]]:
        """Ranges of at most `piece_bytes` (fp32), of whole rows (whole experts of a stack; at least one)."""
        shape = self.shapes[name]
        row = math.prod(shape[1:])
        rows = max(1, piece_bytes // (4 * row))
        return [(a * row, min(a + rows, shape[0]) * row) for a in range(0, shape[0], rows)]

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        link, shape = self.table[name], self.shapes[name]
        if not link.per_expert:
            return link.read_range(self.hub, lo, hi, shape).float()
        row = math.prod(shape[1:])
        return link.assemble(self.hub, range(lo // row, hi // row)).float().reshape(-1)


def _fresh_adamw_scalars() -> Dict:
    """The scalars a fresh one-group AdamW ZeroOptimizer checkpoints (the import's; a run with --finetune or
    --no-load-optim starts its own)."""
    hyper = {k: v for k, v in torch.optim.AdamW([torch.zeros(1)]).param_groups[0].items() if k != "params"}
    return {"param_groups": [hyper], "loss_scaler": None, "skipped_steps": 0, "consecutive_skips": 0}


def export_checkpoint(
    path: str,
    hf_dir: str,
    dtype: Optional[torch.dtype] = None,
    family: Optional[str] = None,
    hub_config: Optional[Dict] = None,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    generation_config: Optional[Dict] = None,
    report: Callable[[str], None] = lambda line: None,
) -> None:
    """The Hub folder of checkpoint `path`'s fp32 masters (a --save root, an iter_N folder), in `dtype` (default:
    an imported model's source dtype, else the run's params'), as `family` (default: the one that holds it);
    `hub_config`, `generation_config`: a Hub config whose other fields (token ids) to keep and the generation
    config to write (default: an imported model's; a run from scratch names its tokenizer's tokens); a run's
    Hugging Face tokenizer is copied in. The vocabulary is the one --save-hf writes (`exported_vocab_size`);
    `report` gets the notice of a checkpoint that does not record it."""
    reader = checkpoint.CheckpointReader(checkpoint.resolve_checkpoint(path))
    configs = upgrade_stored_configs(reader.train_state["configs"])
    saved_names = {canonical_name(n): n for n in reader.train_state["param_shapes"]}
    model = _model_reading(reader, configs, saved_names)
    model.hub_config, model.hub_generation_config, token_ids, tokenizer = export_sources(
        configs, hub_config, generation_config
    )
    dtype = dtype or (hub_dtype(configs["hf"]) if configs.get("hf") else _run_dtype(configs.get("train") or {}))
    save_pretrained(
        model,
        hf_dir,
        family=family,
        dtype=dtype,
        overwrite=overwrite,
        max_shard_bytes=max_shard_bytes,
        token_ids=token_ids,
        tokenizer_files=tokenizer,
        vocab_size=exported_vocab_size(configs, model.config.vocab_size, report),
    )


def exported_vocab_size(configs: Dict, rows: int, report: Callable[[str], None]) -> Optional[int]:
    """The vocabulary an export of a run with stored `configs` (`rows` in its embedding) writes: the tp 1 run's
    padding, as --save-hf writes it (Megatron pads to --make-vocab-size-divisible-by x tp: the rows tp adds are
    no part of the model). A checkpoint of an older moezero records none: all its rows (None), said where tp
    padded them."""
    recorded = (configs.get("vocabulary") or {}).get("exported")
    if recorded is not None:
        return recorded
    tp = (configs.get("parallel") or {}).get("tensor_parallel_size") or 1
    if tp > 1 and (configs.get("model") or {}).get("vocab_size") is None:
        report(
            f"notice: the checkpoint records no vocabulary (an older moezero's): all {rows} rows written, with "
            f"the padding of --tensor-model-parallel-size {tp} (--save-hf writes the rows a tp 1 run pads to)"
        )
    return None


def export_sources(configs: Dict, hub_config: Optional[Dict] = None, generation_config: Optional[Dict] = None):
    """What an export of a run with stored `configs` writes besides the weights: (the Hub config whose other
    fields it keeps and the generation config: --hf-config's, else an import's; the token ids of the run's
    tokenizer, which replace an import's where they are another tokenizer's; the run's tokenizer files)."""
    config = hub_config or configs.get("hf")
    generation = generation_config if hub_config else configs.get("hf_generation")
    data = configs.get("data") or {}
    if config is None:
        token_ids = run_token_ids(data)
    elif hub_config is None and data.get("tokenizer_type"):  # kept unless the run's tokenizer was another
        token_ids = run_token_ids(data, quiet=True)
    else:
        token_ids = None
    return config, generation, token_ids, run_tokenizer_files(data)


def _model_reading(reader, configs: Dict, saved_names: Dict[str, str]) -> GPTModel:
    """The checkpoint's model on the meta device, each param reading its masters from the checkpoint when asked."""
    shapes = reader.train_state["param_shapes"]
    vocab = shapes[saved_names["embedding.weight"]][0]
    gpt = GPTConfig(**dict(configs["model"], vocab_size=vocab))
    moe = MoEConfig(**configs["moe"]) if (configs.get("moe") or {}).get("num_experts") else None
    with torch.device("meta"):
        model = GPTModel(gpt, moe)
    for name, param in model.named_parameters():
        if name not in saved_names:
            raise CheckpointError(f"{reader.path}: has no {name} (saved from another model?)")
        defer_values(param, functools.partial(reader.read, saved_names[name]))
    stored, persistent = reader.model_state(), set(model.state_dict())
    for name, buffer in model.named_buffers():
        allocate(buffer)
        if name not in persistent:  # a checkpoint holds no non-persistent buffer (an unused expert bias): its zeros
            buffer.zero_()
            continue
        if name not in stored:
            raise CheckpointError(f"{reader.path}: has no '{name}' (saved from another model?)")
        buffer.copy_(stored[name])
    return model


def _run_dtype(train: Dict) -> torch.dtype:
    return (
        torch.bfloat16
        if train.get("bf16")
        else torch.float16
        if train.get("fp16")
        else torch.float64
        if train.get("fp64")
        else torch.float32
    )
